"""The one-token step of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer] in torch form (DESIGN.md §2 and §5),
as `h2o_compress.cache.chunk` is its multi-token step: static shapes, no host sync and no allocation of cache storage, so
``torch.compile(fullgraph=True)`` captures it. Read top to bottom, a step is:

1. `update`: the new token into the ring, the ring's oldest token into the store (quantized once, the
   store's [`enter`][h2o_compress.cache.SlotStore.enter]: the lowest empty slot of its head, or of the head-adaptive pool);
2. `read`: what attention reads, ``[batch, kv_heads, slots + residual, head_dim]``, and its validity;
3. `attend`: the attention over it, the probabilities added to the scores (`add_scores`), then the
   layer's eviction (tokens outside a sliding window or chunk first, then the lowest priority over capacity).

The Triton op replaces steps 2 and 3's attention (it reads the store in place), the CPU kernel the whole step
(`h2o_compress.cache.backends`).
"""

from __future__ import annotations

import torch

from h2o_compress.attention import decode_attention
from h2o_compress.cache.refinement import stored_rank
from h2o_compress.cache.setting import GROWTH


def update(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write one token, ``keys``/``values`` ``[batch, kv_heads, 1, head_dim]`` (in the layer's bases and residual
    dtype). Returns the token that entered the store (the ring's oldest, or the new one without a ring) and its
    slots, int64 ``[batch, rows, k]``. No host sync (except the host counter of an unbounded cache of unknown
    length, eager only)."""
    position = layer.counters.seen
    grow_for_token(layer)
    keys, values, leaving, score = ring_in(layer, keys, values)
    rank = lambda: stored_rank(layer.setting.policy, layer.store, layer.counters.seen)  # noqa: E731 - on demand
    slot = layer.store.enter(keys, values, leaving, score, rank)
    layer.counters.first_real.clamp_(max=position)
    layer.counters.seen.add_(1)
    return keys, values, slot


def grow_for_token(layer) -> None:
    """Make room for one more token in an unbounded cache of unknown length (a host counter; eager only)."""
    if layer.setting.growable:
        layer.counters.grown_to += 1
        if layer.counters.grown_to - layer.setting.residual >= layer.store.slots:
            layer.store.resize(layer.store.slots + GROWTH)


def read(layer, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor):
    """What attention reads after `update`: ``(keys, values)`` ``[batch, kv_heads, slots + residual,
    head_dim]`` in the model dtype (a 16-bit store is read in place; a quantized one dequantized once, the token
    that just entered it at full precision, then the ring) and their validity, bool ``[batch, kv_heads, slots +
    residual]``."""
    store, ring, heads = layer.store, layer.ring, layer.geometry.kv_heads
    valid = store.head_positions() >= 0
    if not layer.setting.quantized:  # 16-bit: the store itself (broadcast over a pool's heads), no copy
        keys, values = store.held(layer.geometry.dtype, heads)
        return keys, values, valid
    dtype = layer.geometry.dtype
    keys = store.read("keys", None if ring is None else ring.keys, store.as_rows(keys), slot, dtype, heads)
    values = store.read("values", None if ring is None else ring.values, store.as_rows(values), slot, dtype,
                        heads)
    if ring is not None:
        valid = torch.cat((valid, ring.valid(heads)), dim=2)
    return keys, values, valid


def ring_in(layer, keys: torch.Tensor, values: torch.Tensor):
    """The new token, ``keys``/``values`` ``[batch, kv_heads, 1, head_dim]``, into the ring; returns the token that
    leaves the window for the store: ``(keys, values, positions int32 [batch, 1], scores fp32 [batch, kv_heads, 1]
    | None)`` (positions ``-1`` where the ring's slot was empty). Without a ring the new token itself goes to the
    store, at position ``seen``, with score 0. In place, no host sync."""
    if layer.ring is not None:
        return layer.ring.push(keys, values, layer.counters.seen)
    leaving = layer.counters.seen.to(torch.int32).expand(layer.geometry.batch, 1)
    geometry = layer.geometry
    score = torch.zeros(geometry.batch, geometry.kv_heads, 1, device=geometry.device) if layer.setting.with_scores else None
    return keys, values, leaving, score


def attend(layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
           scaling: float | None, variant=None):
    """Attention of one query per sequence, ``[batch, q_heads, 1, head_dim]`` (in the key basis), over what
    `read` returned, masked by ``valid``, with the layer's softmax ``variant``
    (`AttentionVariant` or ``None``); then `add_scores` and the
    eviction. Returns ``[batch, q_heads, 1, head_dim]`` (in the value basis)."""
    output, sums = decode_attention(query, keys, values, valid, scaling, layer.setting.with_scores, variant)
    add_scores(layer, sums)
    layer.evict()
    return output


def add_scores(layer, sums: torch.Tensor | None) -> None:
    """Add this query's probability sums, fp32 ``[batch, kv_heads, slots + residual]`` (store then ring, or
    ``None`` without scores), to the scores; a policy that does not accumulate (TOVA) takes them as they are. In
    place, no host sync."""
    if sums is None:
        return
    sums = per_kv_head(sums, layer.geometry.kv_heads)
    slots = layer.store.slots
    if layer.setting.policy.accumulates:
        layer.store.scores += layer.store.score_share(sums[..., :slots])
        if layer.ring is not None:
            layer.ring.scores += sums[..., slots:]
    else:  # the current query's attention replaces the scores (TOVA)
        layer.store.scores.copy_(layer.store.score_share(sums[..., :slots]))
        if layer.ring is not None:
            layer.ring.scores.copy_(sums[..., slots:])


def per_kv_head(sums: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Probability sums fp32 ``[batch, heads, keys]`` over the heads of the keys attention read, summed to the
    cache's ``kv_heads`` (a multi-head latent attention model expands one cached latent into a key per query head:
    the latent's score is what every head gave it, as GQA sums a group)."""
    if sums.shape[1] == kv_heads:
        return sums
    return sums.view(sums.shape[0], kv_heads, -1, sums.shape[2]).sum(2)


def forget(layer, factor: float) -> None:
    """Scale every held score by ``factor`` (in place, no host sync): A2SF's forgetting factor (Jo and Shin 2024,
    arXiv 2407.20485), applied before a decode step's attention is added, on every decode path (CPU kernel, Triton
    op, torch form)."""
    layer.store.scores.mul_(factor)
    if layer.ring is not None:
        layer.ring.scores.mul_(factor)
