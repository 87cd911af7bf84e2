"""The package's docstrings and comments carry no project issue numbers, and every dotted ``h2o_compress.`` name
they give in backticks (or as a mkdocs cross-reference target) names a module or attribute that exists."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import h2o_compress

PACKAGE = Path(h2o_compress.__file__).parent
ISSUE = re.compile(r"\b[Ii]ssues? \d+")
# `h2o_compress.a.b`, ``h2o_compress.a.b``, `h2o_compress.a.b()` and the target of [`b`][h2o_compress.a.b]
DOTTED = re.compile(r"`{1,2}(h2o_compress(?:\.\w+)+)(?:\(\))?`{1,2}|\]\[(h2o_compress(?:\.\w+)+)\]")


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
