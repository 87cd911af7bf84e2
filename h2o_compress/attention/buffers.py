"""What a decode kernel reads and writes of one compressed layer: plain tensors and sizes, no cache object.

The cache packs its parts into these (``h2o_compress.cache.backends`` builds them for each step); the kernels (the
native CPU step, `h2o_compress.attention.cpu`; the Triton op, `h2o_compress.attention.slot_attention`) take them and
know nothing of the layer. The tensors are the layer's own
buffers (not copies): what a kernel writes in place (scores, positions, counters) lands in the cache.

Shapes: ``rows`` is ``kv_heads`` for per-head slots, or 1 for a head-adaptive pool (``owner`` says which head holds a
slot).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StoredSide(NamedTuple):
    """One side (keys or values) of the slot store as the kernels read it.

    Attributes:
        bits: 4 or 8 (``IntQuantizer`` codes) or 16 (raw storage).
        group: quantization group along ``head_dim`` (1 for 16-bit storage).
        data: uint8 codes ``[batch, rows, slots, head_dim * bits / 8]``, or raw ``[batch, rows, slots, head_dim]``
            (``None`` for the torch form, which reads the store dequantized, in any format).
        scale_zero: fp16 ``[batch, rows, slots, head_dim / group, 2]``, or ``None`` for 16-bit storage.
        basis: fp32 ``[head_dim, head_dim]`` Hadamard basis the tokens are held in, or ``None``.
    """

    bits: int
    group: int
    data: torch.Tensor | None
    scale_zero: torch.Tensor | None
    basis: torch.Tensor | None


class RingBuffers(NamedTuple):
    """The full-precision window of the newest tokens.

    Attributes:
        keys: ``[batch, kv_heads, ring, head_dim]`` in the storage bases.
        values: as ``keys``.
        positions: int32 ``[batch, ring]`` (``-1`` = empty).
        scores: fp32 ``[batch, kv_heads, ring]``, or ``None`` without scores.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor | None


class SlotBuffers(NamedTuple):
    """A layer's decode state: its slot store, ring and counters.

    Attributes:
        keys: the stored keys (`StoredSide`).
        values: the stored values (`StoredSide`).
        positions: int32 ``[batch, rows, slots]`` (``-1`` = empty).
        scores: fp32 ``[batch, rows, slots]`` accumulated attention, or ``None`` without scores.
        owner: int8 ``[batch, 1, slots]`` head tags of a head-adaptive pool, or ``None`` for per-head slots.
        norms: fp32 ``[batch, rows, slots]`` stored values' norms (a policy that weighs values), or ``None``.
        ring: the window (`RingBuffers`), or ``None`` without one.
        seen: int64 0-dim, tokens seen.
        first_real: int64 ``[batch]``, position of each sequence's first real token.
        finite: bool 0-dim, every key and value so far was finite.
        consistent: bool 0-dim, this layer saw every step layer 0 saw.
    """

    keys: StoredSide
    values: StoredSide
    positions: torch.Tensor
    scores: torch.Tensor | None
    owner: torch.Tensor | None
    norms: torch.Tensor | None
    ring: RingBuffers | None
    seen: torch.Tensor
    first_real: torch.Tensor
    finite: torch.Tensor
    consistent: torch.Tensor

    @property
    def ring_size(self) -> int:
        """Tokens the ring holds (0 without one)."""
        return 0 if self.ring is None else self.ring.positions.shape[1]


class Eviction(NamedTuple):
    """How the native CPU step evicts (the policy's priority rules, stated by the cache), or that it does not.

    Attributes:
        capacity: tokens kept per sequence and head (0: the kernel does not evict).
        recent: the newest tokens never evicted.
        sinks: the first tokens never evicted.
        rank: fp32 ``[batch, kv_heads, slots]`` the kernel ranks by (the scores), or ``None`` (by position).
        evict: whether the kernel evicts at all.
        replace_scores: the query's attention replaces the scores (TOVA) instead of adding to them.
        prior_weights: fp32 ``[kv_heads, head_dim + 4]`` of a calibrated policy, or ``None``.
    """

    capacity: int = 0
    recent: int = 0
    sinks: int = 0
    rank: torch.Tensor | None = None
    evict: bool = False
    replace_scores: bool = False
    prior_weights: torch.Tensor | None = None
