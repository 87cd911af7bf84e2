"""A policy that overrides ``rank`` is evicted by its own ranking on every kernel: a subclass that does not declare
``ranks_by`` is ``custom``, so the CPU kernel does not rank it by its parent's scores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.policies import POLICIES, H2OPolicy


@dataclass
class LowestFirst(H2OPolicy):
    """Keeps the least attended tokens: the reverse of its parent's ranking (a test policy)."""

    summary: ClassVar[str] = "the least attended tokens (a test policy)"

    def rank(self, scores, positions, seen):
        return -scores.float()


def test_a_rank_override_is_declared_custom():
    assert LowestFirst.ranks_by == "custom"
    assert H2OPolicy.ranks_by == "scores" and POLICIES["tova"].ranks_by == "scores"  # declared by each


def _kept_positions(model, kernel: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (1, 24), generator=generator)
    tokens = torch.randint(0, 128, (1, 12), generator=generator)
    cache = make_cache(model, CompressionConfig(policy="lowest", budget=10, attention_kernel=kernel), max_length=36)
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache)
        for i in range(tokens.shape[1]):
            model(input_ids=tokens[:, i:i + 1], past_key_values=cache,
                  cache_position=torch.tensor([prompt.shape[1] + i]))
    return [layer.positions().sort(dim=-1).values for layer in cache.layers]


def test_the_cpu_kernel_evicts_by_an_overridden_rank(monkeypatch):
    from conftest import tiny_llama

    monkeypatch.setitem(POLICIES, "lowest", LowestFirst)
    model = tiny_llama()
    for ours, reference in zip(_kept_positions(model, "auto"), _kept_positions(model, "torch")):
        assert torch.equal(ours, reference)
