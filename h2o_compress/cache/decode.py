"""The one-token step of a :class:`~h2o_compress.cache.layer.CompressedLayer` in torch form (DESIGN.md §2 and §5),
as :mod:`.chunk` is its multi-token step: static shapes, no host sync and no allocation of cache storage, so
``torch.compile(fullgraph=True)`` captures it.

:func:`update` takes the new token: into the ring, the ring's oldest token into the first empty slot of the store
(quantized once), and returns what attention reads, ``[batch, kv_heads, slots + residual, head_dim]``, with its
validity in ``layer.decode_valid``. :func:`attend` runs the attention over it, adds the probabilities to the
scores (:func:`add_scores`) and evicts (the layer's ``_evict``). The Triton op replaces the attention and the
scores (it reads the store in place: :func:`update` then returns early), the CPU kernel the whole step.
Head-adaptive layers write the pool with their own ``_decode_update`` and reach the same :func:`attend`; the
mixed-precision hooks (``_quantize_incoming``, ``_after_insert``, ``_refine_read``) are the layer's.
"""

from __future__ import annotations

import torch

from ..attention import decode_attention


def update(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one token, ``keys``/``values`` ``[batch, kv_heads, 1, head_dim]`` (in the layer's bases and residual
    dtype), and return the keys and values attention reads, ``[batch, kv_heads, slots + residual, head_dim]`` in
    the model dtype (a 16-bit store is read in place; the Triton op reads the store itself and gets the new token
    back). No host sync (except the host counter of an unbounded cache of unknown length, eager only)."""
    position = layer.seen
    layer._grow_for_token()
    keys, values, leaving, score = ring_in(layer, keys, values)
    slot = layer.store.first_free()
    layer.store.insert(
        slot, *layer._quantize_incoming(keys, values), leaving.unsqueeze(1).expand(-1, layer.kv_heads, -1), score,
    )
    layer._after_insert(slot)
    layer.first_real.clamp_(max=position)
    layer.seen.add_(1)
    if layer.fused:  # the Triton op reads the store and ring in place: nothing is dequantized here
        layer.leaving = (keys, values, slot)
        return keys, values
    if not layer.quantized:  # 16-bit: attention reads the store itself, no copy
        keys, values = layer.store.dequantize(layer.key_quantizer, layer.value_quantizer, layer.dtype)
        layer.decode_valid = layer.store.positions >= 0
        return keys, values
    index = slot.unsqueeze(-1).expand(-1, -1, -1, layer.head_dim)
    ring_keys, ring_values = (None, None) if layer.ring is None else (layer.ring.keys, layer.ring.values)
    keys = read(layer, "keys", layer.key_quantizer, layer.store.keys, ring_keys, keys, index)
    values = read(layer, "values", layer.value_quantizer, layer.store.values, ring_values, values, index)
    valid = layer.store.positions >= 0
    if layer.ring is not None:
        ring_valid = (layer.ring.positions >= 0).unsqueeze(1).expand(-1, layer.kv_heads, -1)
        valid = torch.cat((valid, ring_valid), dim=2)
    layer.decode_valid = valid
    return keys, values


def ring_in(layer, keys: torch.Tensor, values: torch.Tensor):
    """The new token, ``keys``/``values`` ``[batch, kv_heads, 1, head_dim]``, into the ring; returns the token that
    leaves the window for the store: ``(keys, values, positions int32 [batch, 1], scores fp32 [batch, kv_heads, 1]
    | None)`` (positions ``-1`` where the ring's slot was empty). Without a ring the new token itself goes to the
    store, at position ``seen``, with score 0. In place, no host sync."""
    if layer.ring is not None:
        return layer.ring.push(keys, values, layer.seen)
    leaving = layer.seen.to(torch.int32).expand(layer.batch, 1)
    score = torch.zeros(layer.batch, layer.kv_heads, 1, device=layer.device) if layer.with_scores else None
    return keys, values, leaving, score


def read(layer, name: str, quantizer, stored, ring, leaving, index) -> torch.Tensor:
    """What attention reads of the ``name`` (``"keys"`` or ``"values"``) side, ``[batch, kv_heads, slots +
    residual, head_dim]`` in the model dtype, built in one buffer: the store (``stored``) dequantized in place, the
    token leaving the window (``leaving`` ``[batch, kv_heads, 1, head_dim]``) at full precision in its new slot
    (``index``: its last step at full precision, as in a chunk), then the ``ring`` (or ``None``)."""
    slots = layer.store.slots
    size = 0 if ring is None else ring.shape[2]
    out = torch.empty(layer.batch, layer.kv_heads, slots + size, layer.head_dim, dtype=layer.dtype,
                      device=layer.device)
    held = out[:, :, :slots]
    quantizer.dequantize_into(stored, held)
    layer._refine_read(name, held)
    held.scatter_(2, index, leaving.to(layer.dtype))
    if ring is not None:
        out[:, :, slots:].copy_(ring)
    return out


def attend(layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None,
           variant=None):
    """Attention of one query per sequence, ``[batch, q_heads, 1, head_dim]`` (in the key basis), over what
    :func:`update` returned, masked by ``layer.decode_valid``, with the layer's softmax ``variant``
    (:class:`~h2o_compress.attention.variant.AttentionVariant` or ``None``); then :func:`add_scores` and the
    eviction. Returns ``[batch, q_heads, 1, head_dim]`` (in the value basis)."""
    output, sums = decode_attention(query, keys, values, layer.decode_valid, scaling, layer.with_scores, variant)
    layer.decode_valid = None
    add_scores(layer, sums)
    layer._evict()
    return output


def add_scores(layer, sums: torch.Tensor | None) -> None:
    """Add this query's probability sums, fp32 ``[batch, kv_heads, slots + residual]`` (store then ring, or
    ``None`` without scores), to the scores; a policy that does not accumulate (TOVA) takes them as they are. In
    place, no host sync."""
    if sums is None:
        return
    sums = per_kv_head(sums, layer.kv_heads)
    slots = layer.store.slots
    if layer.policy.accumulates:
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
