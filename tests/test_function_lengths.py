"""No function of the package is over 60 lines, docstring included (the engineering standard; issue 48 found 15)."""

from __future__ import annotations

import ast
from pathlib import Path

import h2o_compress

PACKAGE = Path(h2o_compress.__file__).parent
MAX_LINES = 60


def test_no_function_in_the_package_is_over_60_lines():
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if node.end_lineno - first + 1 > MAX_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - first + 1
    assert not long, long
