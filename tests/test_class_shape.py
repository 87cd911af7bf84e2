"""The package's classes keep short seams: none derives from two of the package's own classes (a second parent from
a library, as a transformers layer mixin, is a declaration, not a second body of code), and the cache layer keeps its
transformers contract and a handful of readers (reports, persistence and tests read its parts)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "h2o_compress"
LAYER = PACKAGE / "cache" / "layer.py"
MOST_LAYER_METHODS = 25
MOST_LAYER_LINES = 250


def _classes():
    """``(path, class node)`` for every class defined in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                yield path, node


def _base_name(base: ast.expr) -> str:
    return base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""


def test_no_class_has_two_parents_from_the_package():
    ours = {node.name for _, node in _classes()}
    twice = [f"{path.relative_to(PACKAGE)}:{node.name}" for path, node in _classes()
             if sum(_base_name(base) in ours for base in node.bases) > 1]
    assert not twice, f"classes with two parents from h2o_compress: {twice}"


def test_the_scan_sees_a_class_with_a_package_parent():
    """The scan is not blind: the hybrid layer's parent is the package's CompressedLayer (its second, transformers'
    LinearAttentionCacheLayerMixin, is not the package's)."""
    ours = {node.name for _, node in _classes()}
    hybrid = next(node for _, node in _classes() if node.name == "CompressedStateLayer")
    assert [_base_name(base) for base in hybrid.bases if _base_name(base) in ours] == ["CompressedLayer"]


def _layer_class() -> ast.ClassDef:
    return next(node for node in ast.parse(LAYER.read_text(encoding="utf-8")).body
                if isinstance(node, ast.ClassDef) and node.name == "CompressedLayer")


def test_the_cache_layer_keeps_few_methods_and_lines():
    """Every def (properties included) and every method alias (``prefetch = offload``) of the class body counts."""
    layer = _layer_class()
    methods = [node.name for node in layer.body if isinstance(node, ast.FunctionDef)]
    aliases = [target.id for node in layer.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
               for target in node.targets if isinstance(target, ast.Name)]
    assert len(methods) + len(aliases) <= MOST_LAYER_METHODS, methods + aliases
    assert layer.end_lineno - layer.lineno + 1 <= MOST_LAYER_LINES
    assert len(LAYER.read_text(encoding="utf-8").splitlines()) <= MOST_LAYER_LINES


def test_the_cache_layer_keeps_the_transformers_contract():
    from transformers.cache_utils import CacheLayerMixin

    from h2o_compress.cache import CompressedLayer

    contract = {"lazy_initialization", "update", "get_mask_sizes", "get_seq_length", "get_max_length", "reset",
                "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "crop", "offload", "prefetch"}
    assert contract <= set(vars(CompressedLayer))
    assert not CompressedLayer.__abstractmethods__ and issubclass(CompressedLayer, CacheLayerMixin)


def test_model_support_reads_no_source_text():
    """Whether a model is supported comes from what it declares (``_supports_attention_backend``, its layer types)
    and the names its compiled code reads, never from a module's source text."""
    reading = [path.relative_to(PACKAGE).as_posix() for path in sorted(PACKAGE.rglob("*.py"))
               if "getsource" in path.read_text(encoding="utf-8")]
    assert not reading, f"modules that read source text: {reading}"
