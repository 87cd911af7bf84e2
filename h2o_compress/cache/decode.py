"""The one-token step of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer] on the cache's side (DESIGN.md §2
and §5), as `h2o_compress.cache.chunk` is its multi-token step: static shapes, no host sync and no allocation of cache
storage, so ``torch.compile(fullgraph=True)`` captures it. Read top to bottom, the torch form's step is:

1. `update`: the new token into the ring, the ring's oldest token into the store (quantized once, the
   store's [`enter`][h2o_compress.cache.SlotStore.enter]: the lowest empty slot of its head, or of the head-adaptive pool);
2. `read`: what attention reads, ``[batch, kv_heads, slots + residual, head_dim]``, and its validity;
3. `forget`: A2SF's fading of the held scores, before this step's query adds to them;
4. `slot_buffers`: the layer's buffers packed for the attention side, which runs the attention and adds the
   scores (`h2o_compress.attention.decode_step`) without calling back; the layer's eviction (tokens outside a
   sliding window or chunk first, then the lowest priority over capacity) runs at the start of its next step
   ([`CompressedLayer.run_deferred_eviction`][h2o_compress.cache.CompressedLayer.run_deferred_eviction]).

The Triton op replaces step 2 (it reads the store in place), the CPU kernel steps 1 and 2
(`h2o_compress.cache.backends`).
"""

from __future__ import annotations

import torch

from h2o_compress.attention.buffers import RingBuffers, SlotBuffers, StoredSide
from h2o_compress.attention.decode_step import add_scores
from h2o_compress.cache.refinement import stored_rank
from h2o_compress.cache.setting import GROWTH


def _side(quantizer, stored, basis: torch.Tensor | None, codes: bool = True) -> StoredSide:
    """One stored format of the layer as the kernels read it (``codes=False``: its basis only, for the torch form,
    which reads the store dequantized, in any format)."""
    if not codes:
        return StoredSide(quantizer.bits, 1, None, None, basis)
    if quantizer.bits == 16:
        return StoredSide(16, 1, stored.parts["x"], None, basis)
    return StoredSide(quantizer.bits, quantizer.group_size, stored.parts["data"], stored.parts["scale_zero"], basis)


def slot_buffers(layer, codes: bool = True) -> SlotBuffers:
    """The buffers of ``layer`` (its own tensors, not copies) that a decode kernel reads and writes, packed for the
    call (`h2o_compress.attention.buffers`): built each step, so a resized or re-batched store is what the kernel
    sees. ``codes=False``: without the stored codes (the torch form reads them dequantized, in any format)."""
    store, ring, counters, setting, geometry = layer.store, layer.ring, layer.counters, layer.setting, layer.geometry
    return SlotBuffers(
        _side(setting.key_quantizer, store.keys, geometry.key_basis, codes),
        _side(setting.value_quantizer, store.values, geometry.value_basis, codes),
        store.positions, store.scores, getattr(store, "owner", None), store.norms,
        None if ring is None else RingBuffers(ring.keys, ring.values, ring.positions, ring.scores),
        counters.seen, counters.first_real, counters.finite, counters.consistent,
    )


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


def add_layer_scores(layer, sums: torch.Tensor | None) -> None:
    """Add one query's probability sums fp32 ``[batch, heads, slots + residual]`` (or ``None``) to ``layer``'s
    scores, as a decode step's attention does (`h2o_compress.attention.decode_step.add_scores`)."""
    add_scores(slot_buffers(layer, codes=False), sums, layer.geometry.kv_heads, layer.setting.policy.accumulates)


def forget(layer, factor: float) -> None:
    """Scale every held score by ``factor`` (in place, no host sync): A2SF's forgetting factor (Jo and Shin 2024,
    arXiv 2407.20485), applied in a decode step's ``update`` before its attention is added, on every decode path
    (CPU kernel, Triton op, torch form)."""
    layer.store.scores.mul_(factor)
    if layer.ring is not None:
        layer.ring.scores.mul_(factor)
