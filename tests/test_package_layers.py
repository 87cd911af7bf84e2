"""The package's layers (pyproject.toml's [tool.importlinter] contracts), checked by import-linter: the package
keeps them, and a circle added on purpose breaks them (so the check can fail). Function-level imports count."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "h2o_compress"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the test extra)")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_package_keeps_its_layers_and_has_no_import_circle():
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, circle", [
    # a leaf utility reaching up into the cache, inside a function (a hidden circle)
    ("utils/errors.py", "def _hidden():\n    from h2o_compress.cache import CompressedCache\n"),
    # two runtime modules importing each other (the generation <-> prompt_cache circle of old)
    ("runtime/prefill.py", "def _hidden():\n    from h2o_compress.runtime.prompt_cache import prepare_prompt_cache\n"),
])
def test_a_circle_added_on_purpose_breaks_the_contract(tmp_path, module, circle):
    shutil.copytree(PACKAGE, tmp_path / "h2o_compress", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "h2o_compress" / module, "a") as handle:
        handle.write("\n\n" + circle)
    result = _lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-3000:]


def _function_level_imports(path: Path):
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` imports never run: what type checkers see of a lazy module
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            top |= {id(child) for child in node.body}
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and id(node) not in top and node.module
                and node.module.startswith("h2o_compress")):
            yield node


def test_every_function_level_import_of_the_package_says_why():
    """Only an optional or heavy dependency is a reason to import inside a function (never a circle: the contract
    above rules those out), and the line says which: ``# deferred: ...``."""
    lines_of = {}
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = lines_of.setdefault(path, path.read_text().splitlines())
        for node in _function_level_imports(path):
            said = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
            if "# deferred:" not in said:
                unexplained.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not unexplained, f"function-level imports without a '# deferred: <reason>' comment: {unexplained}"
