"""The package's docstrings and comments carry no project issue numbers and no measured figures (speeds, timings,
a GPU's results: those live in benchmarks/results and the docs), and every dotted ``h2o_compress.`` name they give
in backticks (or as a mkdocs cross-reference target) names a module or attribute that exists; so does every
``h2o_compress.`` name of README.md and docs/**/*.md (in prose, code, cross-references, ``::: h2o_compress.x``
directives and their ``members``, ``from h2o_compress.x import a, b``)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import re
import tokenize
from pathlib import Path

import h2o_compress

PACKAGE = Path(h2o_compress.__file__).parent
ISSUE = re.compile(r"\b[Ii]ssues? \d+")
# `h2o_compress.a.b`, ``h2o_compress.a.b``, `h2o_compress.a.b()` and the target of [`b`][h2o_compress.a.b]
DOTTED = re.compile(r"`{1,2}(h2o_compress(?:\.\w+)+)(?:\(\))?`{1,2}|\]\[(h2o_compress(?:\.\w+)+)\]")
REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# In Markdown every dotted name counts: prose, code, `[x][h2o_compress.a.b]`, `::: h2o_compress.a` (not a path's
# `h2o_compress/data`, not the tail of another name)
MARKDOWN_NAME = re.compile(r"(?<![\w/.-])h2o_compress(?:\.\w+)+")
IMPORT = re.compile(r"^\s*from (h2o_compress(?:\.\w+)*) import \(?([\w ,\n]+?)\)?\s*$", re.M)
DIRECTIVE = re.compile(r"^:::\s*(h2o_compress(?:\.\w+)*)\s*\n((?:[ \t]+.*\n|[ \t]*\n)*)", re.M)
MEMBERS = re.compile(r"^[ \t]*members:[ \t]*(?:\[([^\]]*)\]|\n((?:[ \t]*- *\w+[ \t]*\n)+))", re.M)
# A measured figure: a rate, a time, a speed-up, a bandwidth, or a GPU named beside what it measured. A docstring
# may say what a constant is and which benchmark chose it (``benchmarks/results/...``), not the figure of a run.
NUMBER = r"\d[\d,]*(?:\.\d+)?"
MEASURED = re.compile("|".join([
    rf"{NUMBER} ?(?:tokens?|tok|steps?|prompts?|rows?|requests?)/s\b",
    rf"{NUMBER} ?(?:ms|µs|us|ns)\b",
    rf"\b(?:took|takes|ran in|runs in|in about) ~?{NUMBER} ?(?:s|seconds?|minutes?|min|hours?)\b",
    rf"{NUMBER} ?[KMGT]i?B/s\b",
    rf"{NUMBER} ?(?:x|times) (?:faster|slower|the speed|as fast)",
    rf"{NUMBER} ?% (?:faster|slower|quicker)",
    rf"\b(?:speed-?up|faster|slower) (?:of|by) ~?{NUMBER}",
    r"\b(?:H100|H200|A100|L40S?|RTX ?\d{4})\b[^.\n]*?\b(?:measured|took|ran|decoded|prefilled|timed)\b",
    r"\b(?:measured|took|ran|decoded|prefilled|timed)\b[^.\n]*?\b(?:H100|H200|A100|L40S?|RTX ?\d{4})\b",
]), re.I)


def _sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE.parent)): path.read_text(encoding="utf-8")
            for path in sorted(PACKAGE.rglob("*.py"))}


def _module_parts(parts: list[str]) -> int:
    """How many leading ``parts`` name a module or package of h2o_compress (its file exists)."""
    for count in range(len(parts), 0, -1):
        path = PACKAGE.parent.joinpath(*parts[:count])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return count
    return 0


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module of the package or an attribute (a dataclass field counts) of one."""
    parts = name.split(".")
    count = _module_parts(parts)
    if count == len(parts):
        return True
    try:
        obj = importlib.import_module(".".join(parts[:count]))
    except ImportError as error:  # an optional dependency missing here: the name cannot be checked, not wrong
        return not (error.name or "").startswith("h2o_compress")
    for attribute in parts[count:]:
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        if attribute in fields and not hasattr(obj, attribute):
            return True  # a field without a default: no class attribute, and nothing after it to follow
        if not hasattr(obj, attribute):
            return False
        obj = getattr(obj, attribute)
    return True


def _markdown_names(text: str) -> list[tuple[int, str]]:
    """(offset, name) of every ``h2o_compress.`` name a Markdown page gives: dotted names anywhere, the names a
    ``from h2o_compress... import`` line imports, and the ``members`` of a ``::: h2o_compress...`` directive."""
    names = [(match.start(), match.group()) for match in MARKDOWN_NAME.finditer(text)]
    for match in IMPORT.finditer(text):
        names += [(match.start(), f"{match.group(1)}.{item.split()[0]}")
                  for item in match.group(2).split(",") if item.strip()]
    for directive in DIRECTIVE.finditer(text):
        for members in MEMBERS.finditer(directive.group(2)):
            listed = members.group(1).split(",") if members.group(1) is not None \
                else [line.strip().lstrip("-") for line in members.group(2).splitlines()]
            names += [(directive.start(), f"{directive.group(1)}.{member.strip()}")
                      for member in listed if member.strip()]
    return names


def _notes(source: str, c: bool = False) -> list[tuple[int, str]]:
    """(line, text) of the docstrings and comments of a Python (or ``c``: C) source (not its code or messages)."""
    if c:
        return [(source.count("\n", 0, match.start()) + 1, match.group())
                for match in re.finditer(r"//[^\n]*|/\*.*?\*/", source, re.S)]
    notes = [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
             and isinstance(node.value.value, str)]  # docstrings, and the strings documenting a constant
    return notes + [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
                    if token.type == tokenize.COMMENT]


def _measured_figures(notes: list[tuple[int, str]]) -> list[str]:
    return [f"{line}: ...{text[max(0, match.start() - 40):match.end() + 20]}..."
            for line, text in notes for match in MEASURED.finditer(text)]


def test_no_issue_numbers_in_the_package():
    found = [f"{path}:{text.count(chr(10), 0, match.start()) + 1}: {match.group()}"
             for path, text in _sources().items() for match in ISSUE.finditer(text)]
    assert not found, "project issue numbers belong in commits, not in the code:\n" + "\n".join(found)


def test_dotted_names_in_docstrings_exist():
    missing = []
    for path, text in _sources().items():
        for match in DOTTED.finditer(text):
            name = match.group(1) or match.group(2)
            if not _resolves(name):
                missing.append(f"{path}:{text.count(chr(10), 0, match.start()) + 1}: {name}")
    assert not missing, "names of modules or attributes that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_what_they_look_for():
    assert ISSUE.search("fused (issue 14: kernels per layer)") and not ISSUE.search("lm-eval issues #1105")
    assert [m.group(1) for m in DOTTED.finditer("the cache (`h2o_compress.cache.mixed`)")] == ["h2o_compress.cache.mixed"]
    assert not _resolves("h2o_compress.cache.mixed") and not _resolves("h2o_compress.evaluation.run_profile")
    assert _resolves("h2o_compress.cache.refinement") and _resolves("h2o_compress.profiling.run_profile")
    assert _resolves("h2o_compress.config.CompressionConfig.storage")
    page = ("See [the layer][h2o_compress.cache.mixed] and `h2o_compress.runtime.generation.make_cache(model)`;\n"
            "files live in `h2o_compress/data` (a path, not a name).\n\n"
            "```python\nfrom h2o_compress import generate, not_exported as renamed\n```\n\n"
            "::: h2o_compress.runtime.generation\n    options:\n      members: [generate, gone]\n\n"
            "::: h2o_compress.cache\n    options:\n      members:\n        - CompressedCache\n        - Mixed\n")
    names = [name for _, name in _markdown_names(page)]
    assert sorted(names) == sorted([
        "h2o_compress.cache.mixed", "h2o_compress.runtime.generation.make_cache", "h2o_compress.runtime.generation",
        "h2o_compress.cache", "h2o_compress.generate", "h2o_compress.not_exported",
        "h2o_compress.runtime.generation.generate", "h2o_compress.runtime.generation.gone",
        "h2o_compress.cache.CompressedCache", "h2o_compress.cache.Mixed"]), names
    assert sorted(name for name in names if not _resolves(name)) == [
        "h2o_compress.cache.Mixed", "h2o_compress.cache.mixed", "h2o_compress.not_exported",
        "h2o_compress.runtime.generation.gone"]


def test_the_measured_figure_check_fails_on_a_figure():
    measured = ["decodes at 41.2 tokens/s on 2 cores", "a step takes 12.5 ms here", "int8 is 1.8x faster than fp32",
                "the op reads int4 at 0.8 TB/s", "on an H100 the split pass took 0.21 ms", "the fit ran in 95 s",
                "measured on an H200: the batch job holds 64 rows", "torch's kernel was 3 times slower"]
    assert [text for text in measured if not MEASURED.search(text)] == []
    kept = ["H100_SMS = 132  # streaming multiprocessors of an H100/H200 SXM", "``(16 s, z + 7.5 s)``: the centre",
            "the smallest chunk within 1.05x of the one-pass time (benchmarks/results/prefill_chunks_cpu.md)",
            "with bf16 activations several times faster (``benchmarks/results/cpu_weights_int8.md``)",
            "a timeout of 300 s per command", "budget 0.2, 4 bits: 6.4% of the bytes"]
    assert [text for text in kept if MEASURED.search(text)] == []
    source = ('"""Decodes at 41.2 tokens/s."""\nRATE = 3  # 1.8x faster on an H100\n'
              'def f():\n    """What f does."""\n    return f"{RATE:.1f} tok/s 12 ms"\n')
    assert [figure.split(":")[0] for figure in _measured_figures(_notes(source))] == ["1", "2"]
    assert [figure.split(":")[0] for figure in _measured_figures(_notes("int f; // 2.5 ms a step\n", c=True))] == ["1"]


def test_dotted_names_in_the_docs_exist():
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        missing += [f"{page.relative_to(REPO)}:{text.count(chr(10), 0, offset) + 1}: {name}"
                    for offset, name in _markdown_names(text) if not _resolves(name)]
    assert not missing, "names of modules or attributes that do not exist:\n" + "\n".join(missing)


def test_no_measured_figures_in_the_package():
    """Speeds, timings and a GPU's results are measurements of one run: benchmarks/results and the docs hold them
    (with the command that made them); a docstring says what a constant is and names the benchmark that chose it."""
    found = [f"{path.relative_to(REPO)}:{figure}" for path in sorted(PACKAGE.rglob("*")) if path.suffix in (".py", ".c")
             for figure in _measured_figures(_notes(path.read_text(encoding="utf-8"), c=path.suffix == ".c"))]
    assert not found, "measured figures belong in benchmarks/results or the docs:\n" + "\n".join(found)
