"""`attention_probability_sums` goes over one KV head at a time (issue 49: the scoring peak is ``chunk x keys x
group``, not ``x kv_heads``): the sums are bit-identical to the former all-heads-at-once formula, kept here as the
reference, on random inputs with GQA, causal / boolean / additive / per-KV-head masks, padding rows, decay, soft-cap
and sink logits."""

from __future__ import annotations

import pytest
import torch

from h2o_compress.attention import attention_probability_sums
from h2o_compress.attention.interface import _visible
from h2o_compress.attention.variant import AttentionVariant, softmax_probabilities


def all_heads_sums(query, key, attention_mask, scaling, chunk_size=256, decay=1.0, variant=None):
    """The formula before issue 49: every KV head's chunk of logits at once."""
    batch, q_heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    key_t = key.float().transpose(-1, -2)
    total = torch.zeros(batch, kv_heads, keys, dtype=torch.float32, device=key.device)
    for start in range(0, queries, chunk_size):
        stop = min(start + chunk_size, queries)
        seen = keys if attention_mask is not None else keys - queries + stop
        q = query[:, :, start:stop].float().reshape(batch, kv_heads, group * (stop - start), head_dim)
        logits = torch.matmul(q, key_t[..., :seen]).mul_(scale).view(batch, kv_heads, group, stop - start, seen)
        visible = _visible(attention_mask, start, stop, queries, keys, key.device)
        probs = softmax_probabilities(logits, None if visible is None else visible[..., :seen], variant,
                                      (1, kv_heads, group, 1, 1))
        if attention_mask is not None:
            probs = probs.nan_to_num_(0.0)
        if decay != 1.0:
            weights = decay ** torch.arange(queries - 1 - start, queries - 1 - stop, -1, device=key.device,
                                            dtype=torch.float64)
            probs = probs * weights.float().view(1, 1, 1, stop - start, 1)
        total[..., :seen] += probs.sum(dim=(2, 3))
    return total


def _mask(kind, batch, kv_heads, queries, keys, generator):
    if kind == "none":
        return None
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    heads = kv_heads if kind == "per-head" else 1
    drop = torch.rand(batch, heads, queries, keys, generator=generator) < 0.3
    mask = causal & ~drop
    mask[0, :, 1] = False  # a padding row that sees nothing
    if kind == "additive":
        return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask


@pytest.mark.parametrize("mask_kind", ["none", "bool", "per-head", "additive"])
@pytest.mark.parametrize("decay, variant", [(1.0, None), (0.8, None), (1.0, "softcap"), (0.9, "sinks")])
@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_per_head_sums_equal_the_all_heads_formula(mask_kind, decay, variant, chunk_size):
    generator = torch.Generator().manual_seed(7)
    batch, kv_heads, group, queries, keys, head_dim = 2, 3, 2, 11, 17, 16
    query = torch.randn(batch, kv_heads * group, queries, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, keys, head_dim, generator=generator)
    mask = _mask(mask_kind, batch, kv_heads, queries, keys, generator)
    if variant == "softcap":
        variant = AttentionVariant(softcap=5.0)
    elif variant == "sinks":
        variant = AttentionVariant(sinks=torch.randn(kv_heads * group, generator=generator))
    got = attention_probability_sums(query, key, mask, 0.3, chunk_size, decay, variant)
    expected = all_heads_sums(query, key, mask, 0.3, chunk_size, decay, variant)
    assert got.shape == (batch, kv_heads, keys) and got.dtype == torch.float32
    assert torch.equal(got, expected)


def test_per_head_sums_in_bfloat16_and_without_gqa():
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 9, 8, generator=generator).bfloat16()
    key = torch.randn(1, 4, 9, 8, generator=generator).bfloat16()
    assert torch.equal(attention_probability_sums(query, key, None, None, 4), all_heads_sums(query, key, None, None, 4))
