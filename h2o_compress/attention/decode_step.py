"""One decode step of one compressed layer as the attention function runs it, entirely on this side of the
cache/attention boundary.

A cache layer's ``update`` of one token writes what needs the cache (the token into the ring and store, the
policy's eviction left by the step before, A2SF's fading of the scores) and packs the rest of the step into a
`DecodeCall`: plain data (which kernel, the layer's buffers as `SlotBuffers`, the CPU kernel's `Eviction`, the
token, the validity of what attention reads) plus two small objects of this module the layer owns: its
`ModuleLink` (the attention module that used the layer first, and whether the layer awaits its attention call) and,
for the Triton op, its `ScratchHolder`. ``update`` announces the call (`h2o_compress.attention.interface.announce`,
the one hand-off); the attention function runs it here (`DecodeCall.run`): the query into the keys' basis, the
kernel, the probabilities added to the scores, the output from the values' basis, and returns to the model without
calling back into the cache. What the kernel does not evict, the layer evicts at the start of its next step.

`decode_attention` is the torch form's attention over the slots (static shapes, no host sync: what
``torch.compile`` captures).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from h2o_compress.attention import cpu
from h2o_compress.attention.buffers import Eviction, SlotBuffers
from h2o_compress.attention.variant import AttentionVariant, softmax_probabilities
from h2o_compress.utils.errors import CacheStateError


class ModuleLink:
    """What a cache layer shares with its attention calls beyond their tensors (owned by the layer, carried by each
    `DecodeCall`).

    Attributes:
        layer_idx: the layer's index (messages).
        module: weakref to the attention module that used the layer first, or ``None``.
        awaiting: the layer's ``update`` ran and its attention call has not come yet.
    """

    def __init__(self, layer_idx: int):
        self.layer_idx, self.module, self.awaiting = layer_idx, None, False

    def arrive(self, module) -> None:
        """The attention call of ``module`` came. Raises CacheStateError: the layer was filled through another
        model's module."""
        self.awaiting = False
        if self.module is None:
            self.module = weakref.ref(module)
        elif self.module() is not module:
            raise CacheStateError(f"layer {self.layer_idx}: this cache was filled by another model; a cache holds one "
                                  "model's keys and values, so build a new one with make_cache(model, ...)")


class ScratchHolder:
    """The Triton op's scratch of one layer (workspace, not cache state), one per shape: `for_shape` allocates it
    when the shape changes (eager steps: the prefill, the first decode step, rows moved in); a compiled step finds
    it."""

    def __init__(self):
        self.scratch = None

    def for_shape(self, buffers: SlotBuffers, q_heads: int, head_dim: int):
        """The scratch for ``buffers``' shape (batch, slots, ring) and ``q_heads`` query heads of ``head_dim``."""
        from h2o_compress.attention import slot_attention  # deferred: needs triton, an optional dependency

        batch, kv_heads, slots = buffers.positions.shape
        ring, with_scores = buffers.ring_size, buffers.scores is not None
        key = (batch, q_heads, slots + ring, with_scores)
        if self.scratch is None or self.scratch.key != key:
            self.scratch = slot_attention.make_scratch(batch, q_heads, kv_heads, head_dim, slots, ring, with_scores,
                                                       buffers.keys.bits, buffers.values.bits,
                                                       buffers.positions.device)
        return self.scratch


class DecodeCall(NamedTuple):
    """The rest of a layer's decode step after its ``update``, for the attention function: plain tensors and sizes.

    Attributes:
        kernel: ``"torch"`` (`decode_attention`), ``"cpu"`` (`h2o_compress.attention.cpu.decode_layer`: the whole
            step, ring and store included) or ``"triton"`` (`h2o_compress.attention.slot_attention.decode_layer`).
        link: the layer's `ModuleLink`.
        buffers: the layer's store, ring and counters (`SlotBuffers`; its own tensors, written in place).
        kv_heads: the layer's KV heads (the scores' heads).
        with_scores: the layer keeps attention scores.
        accumulates: this query's probabilities add to the scores (else they replace them: TOVA).
        token: cpu: the new token's ``(keys, values)`` ``[batch, kv_heads, 1, head_dim]`` as the model made them;
            triton: ``(keys, values, slot)``, the token that entered the store this step and its int64 slot.
        valid: torch: bool ``[batch, kv_heads, slots + residual]``, what attention may read.
        eviction: cpu: the kernel's `Eviction`.
        reference_seen: cpu: int64 0-dim, layer 0's count (the consistency flag), or ``None``.
        scratch: triton: the layer's `ScratchHolder`.
    """

    kernel: str
    link: ModuleLink
    buffers: SlotBuffers
    kv_heads: int
    with_scores: bool
    accumulates: bool
    token: tuple | None = None
    valid: torch.Tensor | None = None
    eviction: Eviction | None = None
    reference_seen: torch.Tensor | None = None
    scratch: ScratchHolder | None = None

    def run(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
            kwargs: dict) -> torch.Tensor:
        """The step's attention for ``module``'s ``query`` ``[batch, q_heads, 1, head_dim]`` over ``key``/``value``
        (what ``update`` returned): ``[batch, 1, q_heads, head_dim]`` in the model's basis, the scores updated.
        Raises CacheStateError (another model's module) or UnsupportedModelError (a soft-cap or sink logits the
        kernel cannot run)."""
        self.link.arrive(module)
        variant = AttentionVariant.from_call(kwargs, self.kernel, self.link.layer_idx)
        if self.kernel == "cpu":
            keys, values = self.token
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            return cpu.decode_layer(self.buffers, self.eviction, query, keys, values, scale, self.reference_seen)
        if self.kernel == "triton":
            from h2o_compress.attention import slot_attention  # deferred: needs triton, an optional dependency

            scratch = self.scratch.for_shape(self.buffers, query.shape[1], query.shape[-1])
            output = slot_attention.decode_layer(self.buffers, scratch, query, self.token, scaling, self.accumulates)
            return output.transpose(1, 2).contiguous()
        return self._torch(query, key, value, scaling, variant)

    def _torch(self, query, key, value, scaling, variant) -> torch.Tensor:
        """The torch form: `decode_attention` in the keys' basis, `add_scores`, the output from the values' basis."""
        key_basis, value_basis = self.buffers.keys.basis, self.buffers.values.basis
        query = query if key_basis is None else (query.float() @ key_basis).to(query.dtype)
        output, sums = decode_attention(query, key, value, self.valid, scaling, self.with_scores, variant)
        add_scores(self.buffers, sums, self.kv_heads, self.accumulates)
        output = output.transpose(1, 2)
        output = output if value_basis is None else (output.float() @ value_basis).to(query.dtype)
        return output.contiguous()


def add_scores(buffers: SlotBuffers, sums: torch.Tensor | None, kv_heads: int, accumulates: bool) -> None:
    """Add one query's probability sums fp32 ``[batch, heads, slots + residual]`` (or ``None``: nothing) to the
    store's and ring's scores (``accumulates``), or replace them (TOVA); a head-adaptive pool's slot takes the sum
    over heads (its owner's: the other heads gave it 0). In place, no host sync."""
    if sums is None:
        return
    sums = per_kv_head(sums, kv_heads)
    slots = buffers.positions.shape[-1]
    stored = sums[..., :slots] if buffers.owner is None else sums[..., :slots].sum(1, keepdim=True)
    ring = None if buffers.ring is None else buffers.ring.scores
    if accumulates:
        buffers.scores.add_(stored)
        if ring is not None:
            ring.add_(sums[..., slots:])
    else:  # the current query's attention replaces the scores (TOVA)
        buffers.scores.copy_(stored)
        if ring is not None:
            ring.copy_(sums[..., slots:])


def per_kv_head(sums: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Probability sums fp32 ``[batch, heads, keys]`` over the heads of the keys attention read, summed to the
    cache's ``kv_heads`` (a multi-head latent attention model expands one cached latent into a key per query head:
    the latent's score is what every head gave it, as GQA sums a group)."""
    if sums.shape[1] == kv_heads:
        return sums
    return sums.view(sums.shape[0], kv_heads, -1, sums.shape[2]).sum(2)


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scaling: float | None,
    with_sums: bool, variant: AttentionVariant | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step's attention over fixed slots, and the H2O probability sums from the same softmax.

    Slots where ``valid`` is False (empty, evicted, padding) get zero weight. Static shapes, no host sync: the
    step ``torch.compile`` captures. GQA without copying keys: the query heads of one KV head are one matmul.

    Args:
        query: ``[batch, q_heads, 1, head_dim]``.
        keys: ``[batch, kv_heads, slots, head_dim]``; ``q_heads`` a multiple of ``kv_heads``.
        values: ``[batch, kv_heads, slots, head_dim]``, as ``keys``.
        valid: bool ``[batch, kv_heads, slots]``; at least one True per sequence and head.
        scaling: softmax scale; ``None`` means ``head_dim ** -0.5``.
        with_sums: also return the probabilities summed over each KV head's query heads.
        variant: soft-cap / sink logits of the layer's softmax (`h2o_compress.attention.variant`), or ``None``.

    Returns:
        ``(output [batch, q_heads, 1, value_dim], sums fp32 [batch, kv_heads, slots] | None)`` (H2O, arXiv
        2306.14048 §4: what each key receives from this query).
    """
    batch, q_heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    scale = head_dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    logits = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    probs = softmax_probabilities(logits, valid.unsqueeze(2), variant, (1, kv_heads, q_heads // kv_heads, 1))
    output = torch.matmul(probs.to(values.dtype), values).reshape(batch, q_heads, 1, values.shape[-1])
    return output, probs.sum(2) if with_sums else None
