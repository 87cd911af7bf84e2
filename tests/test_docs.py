"""Every code block of README.md and docs/**/*.md runs, and the documentation site holds together.

- ```python blocks: the blocks of one page run in order in one namespace (like a doctest session: a later block
  may use an earlier block's names), in a scratch directory that holds ``h2o_compress/data``, ``tests/data`` and
  ``examples`` (the paths the pages use, "run from the repository root"). A page whose Python loads the real model
  (``load_model(``) is marked ``integration``.
- ```bash / ```sh / ```console blocks: each block runs as one bash script, in page order in one scratch directory of
  its page (a block may read a file an earlier one wrote), with
  ``h2o-compress`` = ``python -m h2o_compress`` of this checkout (bounded by a timeout). Comment lines are not run,
  nor commands outside the package (``pip install``, ``git``, ``cd``, benchmarks, the test suite, ``mkdocs``);
  commands that only prepare input files (``head``, ``echo``, ``cat``, ``printf``, ``python -c``) are. A block that
  runs the real model (any command but ``plan``) is marked ``integration``.
- A block that cannot run here (a GPU, a network download, a Ray cluster, many minutes) carries, on the line
  before it, ``<!-- docs-test: skip (the reason) -->``: it is reported skipped with that reason. A block that runs
  here but takes minutes carries ``<!-- docs-test: slow (the reason) -->``: skipped with its reason too, unless
  ``H2O_COMPRESS_DOCS_SLOW=1`` (then run, marked ``integration``). ``<!-- docs-test: integration -->`` marks a block
  ``integration``. Together the blocks that run took 8 minutes on 2 busy CPU cores (load 3), 106 s of it a block
  since marked slow.
- Output blocks (no language, ``text``) are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RUN_LANGUAGES = {"python", "bash", "sh", "console"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|slow|integration)\s*(?:\((.*)\))?\s*-->")
SLOW = os.environ.get("H2O_COMPRESS_DOCS_SLOW", "") not in ("", "0")  # run the blocks marked slow too
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")
COMMAND_TIMEOUT_S = 300  # one h2o-compress command
BLOCK_TIMEOUT_S = 900  # a whole block


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None = None  # "skip", "slow" or "integration"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the docs-test marker on the last non-blank line before each."""
    lines = page.read_text().splitlines()
    blocks, i, previous = [], 0, ""
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, ticks, language = match.groups()
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(ticks) and lines[end].strip().strip("`") == ""):
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        block = Block(page, i + 1, language.lower(), "\n".join(body) + "\n")
        marker = MARKER.fullmatch(previous)
        if marker:
            block.marker, block.reason = marker.group(1), (marker.group(2) or "").strip()
        blocks.append(block)
        previous, i = "", end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.language == "python"]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.language in {"bash", "sh", "console"}]


def _page_loads_the_model(page: Path) -> bool:
    return any("load_model(" in b.code for b in PYTHON_BLOCKS if b.page == page and _runs(b))


def _runs(block: Block) -> bool:
    return block.marker != "skip" and (block.marker != "slow" or SLOW)


def _param(block: Block, integration: bool):
    marks = []
    if block.marker == "skip" or (block.marker == "slow" and not SLOW):
        marks.append(pytest.mark.skip(reason=block.reason or f"marked {block.marker} in the page"))
    if integration or block.marker in ("integration", "slow"):
        marks.append(pytest.mark.integration)
    return pytest.param(block, id=block.id, marks=marks)


# -- shell blocks --------------------------------------------------------------------------------------------------
def commands_of(code: str, console: bool = False) -> list[str]:
    """The logical command lines of a shell block (continuations joined), comments and blank lines dropped."""
    commands, current = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if console:
            if not current and not line.startswith("$ "):
                continue  # output
            line = line[2:] if not current else line
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    if current:
        commands.append(current.strip())
    return commands


def is_run(command: str) -> bool:
    """h2o-compress commands, and the commands that prepare their input files."""
    words = shlex.split(command, comments=True)
    if not words:
        return False
    if words[0] == "h2o-compress" or words[0] in {"head", "echo", "cat", "printf"}:
        return True
    if words[0] in {"python", "python3"} and len(words) > 2:
        return words[1] == "-c" or (words[1] == "-m" and words[2].split(".")[0] == "h2o_compress")
    return False


def runs_a_model(command: str) -> bool:
    words = shlex.split(command, comments=True)
    if words[:1] == ["h2o-compress"]:
        rest = words[1:]
    elif words[:2] in (["python", "-m"], ["python3", "-m"]) and words[2].startswith("h2o_compress"):
        rest = words[3:]
    else:
        return False
    return bool(rest) and rest[0] != "plan" and "--help" not in rest


def _shell_param(block: Block):
    run = [c for c in commands_of(block.code, block.language == "console") if is_run(c)]
    param = _param(block, any(runs_a_model(c) for c in run))
    if not run and _runs(block):
        others = sorted({" ".join(shlex.split(c, comments=True)[:1]) for c in commands_of(block.code)})
        reason = f"no h2o-compress command to run (not run here: {', '.join(others)})"
        param = pytest.param(block, id=block.id, marks=[pytest.mark.skip(reason=reason)])
    return param


PAGE_DIRECTORIES: dict[Path, Path] = {}


def _scratch(tmp_path: Path) -> Path:
    """A working directory with the repository's data paths the pages use."""
    (tmp_path / "h2o_compress").mkdir(exist_ok=True)
    (tmp_path / "tests").mkdir(exist_ok=True)
    for link, target in ((tmp_path / "h2o_compress" / "data", REPO / "h2o_compress" / "data"),
                         (tmp_path / "tests" / "data", REPO / "tests" / "data"),
                         (tmp_path / "examples", REPO / "examples")):
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)
    return tmp_path


@pytest.mark.parametrize("block", [_shell_param(b) for b in SHELL_BLOCKS])
def test_shell_block(block: Block, tmp_path_factory):
    # the shell blocks of a page share a directory, in page order (a block may read what an earlier one wrote)
    if block.page not in PAGE_DIRECTORIES:
        PAGE_DIRECTORIES[block.page] = _scratch(tmp_path_factory.mktemp("docs-shell"))
    run = [c for c in commands_of(block.code, block.language == "console") if is_run(c)]
    script = "\n".join([
        "set -euo pipefail",
        f'h2o-compress() {{ timeout {COMMAND_TIMEOUT_S} "$DOCS_PYTHON" -m h2o_compress "$@"; }}',
        'python() { "$DOCS_PYTHON" "$@"; }',
        'python3() { "$DOCS_PYTHON" "$@"; }',
        *(f"echo '+ '{shlex.quote(c)} >&2\n{c}" for c in run),
    ])
    env = dict(os.environ, DOCS_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        out = subprocess.run(["bash", "-c", script], cwd=PAGE_DIRECTORIES[block.page], env=env, capture_output=True,
                             text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id}: took longer than {BLOCK_TIMEOUT_S} s")
    assert out.returncode == 0, f"{block.id}: exit code {out.returncode}\n{out.stderr[-4000:]}"


# -- python blocks -------------------------------------------------------------------------------------------------
@dataclass
class Session:
    """One page's Python session: a namespace, a working directory, the blocks run so far."""
    directory: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__docs__"})
    ran: set = field(default_factory=set)


SESSIONS: dict[Path, Session] = {}


def _run(block: Block, session: Session) -> None:
    session.ran.add(block.line)
    previous = Path.cwd()
    os.chdir(session.directory)
    try:
        exec(compile(block.code, block.id, "exec"), session.namespace)
    except Exception:
        pytest.fail(f"{block.id} raised:\n{traceback.format_exc()}")
    finally:
        os.chdir(previous)


@pytest.mark.parametrize("block", [_param(b, _page_loads_the_model(b.page)) for b in PYTHON_BLOCKS])
def test_python_block(block: Block, tmp_path_factory):
    session = SESSIONS.get(block.page)
    if session is None:
        session = SESSIONS[block.page] = Session(_scratch(tmp_path_factory.mktemp("docs")))
    for earlier in PYTHON_BLOCKS:  # a block run alone (-k) first runs the page's blocks before it
        if earlier.page == block.page and earlier.line < block.line and _runs(earlier) \
                and earlier.line not in session.ran:
            _run(earlier, session)
    try:
        _run(block, session)
    finally:
        if block.line == max(b.line for b in PYTHON_BLOCKS if b.page == block.page and _runs(b)):
            SESSIONS.pop(block.page, None)  # the page's last block: its models go


# -- the site ------------------------------------------------------------------------------------------------------
def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    return []


def test_every_docs_page_is_in_the_nav():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = set(_nav_pages(config["nav"]))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert pages - nav == set(), f"pages under docs/ missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines (at most 300: the manual lives under docs/)"


def test_the_site_home_has_the_readme_set_up():
    setup = re.compile(r"## Set-up: two commands\n.*?```bash\n(.*?)```", re.S)
    readme = setup.search((REPO / "README.md").read_text()).group(1)
    assert setup.search((REPO / "docs" / "index.md").read_text()).group(1) == readme


def test_markers_name_a_reason_and_a_block():
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            marker = MARKER.fullmatch(line.strip())
            if marker is None:
                continue
            if marker.group(1) in ("skip", "slow"):
                assert (marker.group(2) or "").strip(), f"{page.name}:{i + 1}: a skip marker without its reason"
            following = next((l for l in lines[i + 1:] if l.strip()), "")
            assert FENCE.match(following), f"{page.name}:{i + 1}: a docs-test marker not followed by a code block"


def test_the_readme_starts_with_the_user():
    """What it is, the set-up, the first command, Python, the docs; the measurements after them."""
    headings = re.findall(r"^## (.+)$", (REPO / "README.md").read_text(), re.M)
    assert headings[:4] == ["Set-up: two commands", "The first command", "From Python", "Documentation"], headings
    assert "Speed on CPU" in headings[4:]


NOTES = re.compile(r"\bissues? \d|\bsession \d|\bsessions? notes?\b|shared notes|\bshared/|\bissue[- ]\d+", re.I)


@pytest.mark.parametrize("page", [REPO / "README.md", REPO / "docs" / "index.md",
                                  *sorted((REPO / "docs" / "guide").glob("*.md"))],
                         ids=lambda page: page.relative_to(REPO).as_posix())
def test_user_pages_carry_no_issue_numbers_or_session_notes(page):
    found = [f"{page.name}:{n}: {line.strip()[:100]}" for n, line in enumerate(page.read_text().splitlines(), 1)
             if NOTES.search(line)]
    assert not found, f"issue numbers or session notes in a user page (they belong in the history): {found}"


# -- the model counts ----------------------------------------------------------------------------------------------
# The models guide is the source: the architecture matrix's counts (exact, refused, skipped) and transformers'
# version; the README and the site's home quote them.
GUIDE_COUNTS = re.compile(r"transformers (\d+\.\d+)'s `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`.*?for (\d+) classes, "
                          r"(\d+) are refused, (\d+) skipped \((\d+) the generic", re.S)
QUOTED_COUNTS = re.compile(r"\((\d+) causal-LM classes of transformers (\d+\.\d+) exact at budget 1\.0, (\d+) refused")


def _matrix_sets() -> dict[str, set]:
    """The architecture matrix's lists (``REFUSED``, ``NOT_BUILT``, ``OWN_INPUTS``), read from its source."""
    import ast

    tree = ast.parse((REPO / "tests" / "models" / "test_architectures.py").read_text())
    return {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)
            and target.id in ("REFUSED", "NOT_BUILT", "OWN_INPUTS")}


def test_the_model_counts_come_from_the_models_guide():
    guide = GUIDE_COUNTS.search((REPO / "docs" / "guide" / "models.md").read_text())
    assert guide, "docs/guide/models.md no longer states the matrix's counts in the sentence this test reads"
    version, exact, refused, skipped, not_built = guide.group(1), *map(int, guide.groups()[1:])
    for page in (REPO / "README.md", REPO / "docs" / "index.md"):
        quoted = QUOTED_COUNTS.search(page.read_text())
        assert quoted, f"{page.name} no longer quotes the model counts in the sentence this test reads"
        assert (int(quoted.group(1)), quoted.group(2), int(quoted.group(3))) == (exact, version, refused), \
            f"{page.name} quotes {quoted.group(0)!r}; the models guide says {exact} exact, {refused} refused " \
            f"with transformers {version}"
    matrix = _matrix_sets()
    assert (len(matrix["REFUSED"]), len(matrix["NOT_BUILT"] | matrix["OWN_INPUTS"]), len(matrix["NOT_BUILT"])) \
        == (refused, skipped, not_built), \
        "the models guide's counts are not tests/models/test_architectures.py's lists"
    transformers = pytest.importorskip("transformers")
    if ".".join(transformers.__version__.split(".")[:2]) == version:  # the matrix runs this version's classes
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        assert len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) == exact + refused + skipped, \
            f"transformers {version} has {len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} causal-LM classes"


# -- the files the pages name --------------------------------------------------------------------------------------
FOLDERS = "utils|formats|attention|policies|cache|models|persistence|runtime|planner|evaluation|calibration|" \
          "integrations|profiling|jobs|serving|cli|data"
# a path from the repository root (not one a command writes: after --out or ->)
ROOTED_PATH = re.compile(r"(?<![\w/.-])(?<!--out )(?<!-> )((?:h2o_compress|tests|benchmarks|docs|examples)/[\w/.-]*\w"
                         r"\.(?:py|c|md|json|jsonl|txt|toml|yml|yaml|png|csv))\b")
# a path inside the package (or its tests' mirror): `cache/layer.py`
PACKAGE_PATH = re.compile(rf"(?<![\w/.-])((?:{FOLDERS})/\w+\.(?:py|c|json))\b")


def _missing_paths(text: str) -> list[str]:
    rooted = [m.group(1) for m in ROOTED_PATH.finditer(text) if not (REPO / m.group(1)).exists()]
    inside = [m.group(1) for m in PACKAGE_PATH.finditer(text)
              if not any((REPO / root / m.group(1)).exists() for root in ("h2o_compress", "tests"))]
    return rooted + inside


def test_the_files_the_pages_name_exist():
    missing = [f"{page.relative_to(REPO)}: {path}" for page in PAGES for path in _missing_paths(page.read_text())]
    assert not missing, f"files named in the docs that do not exist: {missing}"
    assert _missing_paths("`cache/mixed.py`, `tests/cache/test_gone.py`; `cache/layer.py`, --out benchmarks/x.json") \
        == ["tests/cache/test_gone.py", "cache/mixed.py"]


# -- the layout page -----------------------------------------------------------------------------------------------
# In the layout page's drawings, ``name (folder/file.py)``: the function, class or field named is defined in that file
NAMED_IN_FILE = re.compile(r"([A-Za-z_][\w.]*)\s+\(((?:\w+/)*\w+\.py)\)")


def _not_in_their_files(code: str) -> list[str]:
    missing = []
    for match in NAMED_IN_FILE.finditer(code):
        name, path = match.group(1).split(".")[-1], REPO / "h2o_compress" / match.group(2)
        defined = re.compile(rf"^\s*(?:def|class) {name}\b|^\s+{name}\s*[:=]", re.M)
        if not path.is_file() or not defined.search(path.read_text()):
            missing.append(f"{match.group(1)} ({match.group(2)})")
    return missing


def test_the_layout_page_names_functions_where_they_are():
    """The package's shape and a token's path, drawn in docs/guide/layout.md, name functions that exist where drawn."""
    drawings = [b.code for b in blocks_of(REPO / "docs" / "guide" / "layout.md") if not b.language]
    assert sum(len(NAMED_IN_FILE.findall(code)) for code in drawings) >= 20, "the drawings name few functions"
    missing = [name for code in drawings for name in _not_in_their_files(code)]
    assert not missing, f"docs/guide/layout.md names what its files do not define: {missing}"
    assert _not_in_their_files("  -> CompressedLayer.update (cache/layer.py)\n  -> mix_tokens\n  (cache/layer.py)"
                               " -> evict (cache/gone.py)") == ["mix_tokens (cache/layer.py)", "evict (cache/gone.py)"]
