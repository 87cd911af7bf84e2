"""Shared hypothesis settings and strategies of the property tests (test_properties, test_persistence).

Settings: ``max_examples`` as given per test (``H2O_HYPOTHESIS_SCALE`` multiplies it for a longer local fuzz),
``deadline=None``, ``derandomize=True`` (the same examples in every CI run, so CI is reproducible).
"""

from __future__ import annotations

import functools
import os

from conftest import tiny_llama
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("H2O_HYPOTHESIS_SCALE", "1"))


def fuzz(max_examples: int):
    """Hypothesis settings of the property tests: bounded, no deadline, reproducible."""
    return settings(
        max_examples=max(1, int(max_examples * SCALE)),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@st.composite
def configs(draw, head_dim: int, bits=(16, 8, 4)):
    """A valid CompressionConfig whose group size divides ``head_dim`` (budget filled in by the caller)."""
    quant = draw(st.sampled_from(["int", "int", "nf4", "fp4", "int8-blockwise"]))
    allowed_bits = tuple(b for b in bits if not (quant == "int8-blockwise" and b == 4))
    return dict(
        policy=draw(st.sampled_from(["h2o", "h2o", "h2o-mean", "local", "sink", "full"])),
        heavy_ratio=draw(st.sampled_from([0.0, 0.25, 0.5, 0.5, 0.75, 1.0])),
        sink_tokens=draw(st.one_of(st.none(), st.integers(0, 4))),
        k_bits=draw(st.sampled_from(allowed_bits)),
        v_bits=draw(st.sampled_from(allowed_bits)),
        quant=quant,
        group_size=draw(st.sampled_from([g for g in (32, 64, 128) if head_dim % g == 0])),
        residual=draw(st.integers(0, 6)),
        rotate=draw(st.booleans()),
        score_chunk_size=draw(st.sampled_from([1, 3, 8, 256])),
    )


@functools.lru_cache(maxsize=None)
def cached_llama(seed, kv_heads, group, head_dim, layers):
    return tiny_llama(seed=seed, kv_heads=kv_heads, heads=kv_heads * group, head_dim=head_dim, layers=layers)


def llama_shapes(head_dim: int):
    """``(seed, kv_heads, GQA group, head_dim, layers)`` of a tiny LLaMA."""
    return st.tuples(st.integers(0, 1), st.integers(1, 3), st.integers(1, 3), st.just(head_dim), st.integers(1, 2))


def _no_hub(text: str) -> bool:
    """A text that no ``load_model`` takes for a hub id (``org/name``: a network look-up) or a path elsewhere."""
    return "/" not in text and "\\" not in text and "\x00" not in text


#: Texts of every kind (no lone surrogates: see `wrong_values` for one), none a hub id or a path outside the folder.
texts = st.text(max_size=12).filter(_no_hub)


def wrong_values(extremes: bool = True):
    """Arguments of the wrong type (or of the right type and a bad value) for any parameter of the public API:
    ``None``, bools, integers from negative to 10**5000 (beyond Python's 4300-digit str limit), floats with NaN and
    Inf, texts (a lone surrogate among them), bytes, lists, dicts, tuples, sets, a tensor and a bare object. No
    callables: a callback that raises is the caller's error and propagates. ``extremes=False``: without the
    5,000-digit integer and the lone surrogate."""
    extreme = [st.just(10**5000), st.just("a \ud800")] if extremes else []
    return st.one_of(
        st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), texts,
        st.binary(max_size=6), st.lists(st.integers(-3, 3), max_size=3),
        st.dictionaries(texts, st.integers(-3, 3), max_size=2), st.sampled_from([(1, "x"), frozenset({2}), object()]),
        st.builds(lambda: __import__("torch").zeros(2)), *extreme,
    )
