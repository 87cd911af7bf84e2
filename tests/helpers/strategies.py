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
