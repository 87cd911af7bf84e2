"""The package, the tests and the benchmarks pass ruff's lint (the rules of ``[tool.ruff]`` in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    """The ruff command: the executable beside this Python (a venv's), else the one on PATH; skip without one."""
    beside = Path(sys.executable).with_name("ruff")
    if beside.is_file():
        return [str(beside)]
    if shutil.which("ruff"):
        return [shutil.which("ruff")]
    pytest.skip("ruff is not installed (pip install -e '.[test]')")


def test_ruff_check_finds_nothing():
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise",
                             "h2o_compress", "tests", "benchmarks"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
