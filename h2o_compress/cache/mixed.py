"""`MixedPrecisionLayer`: a compressed layer whose top-ranked stored tokens are 8-bit and the rest 4-bit.

Mixed precision by importance, as MiKV keeps the important tokens' KV at higher precision and the rest at lower
(Yang et al. 2024, "No Token Left Behind", arXiv 2402.18096), with the importance the eviction policy's own
:meth:`~h2o_compress.policies.EvictionPolicy.rank` (H2O: accumulated attention; TOVA: the current query's).

Every token entering the store is quantized once at 8 bits and split into two 4-bit planes
(:class:`~h2o_compress.formats.split.SplitIntQuantizer`): the high plane goes into the slot store in the int4
layout (an int4 token costs exactly what it costs in a plain int4 cache); ``ceil(high_bits_fraction x slots)``
tokens per sequence and KV head also keep the low plane in a side buffer (:class:`~.refinement.RefinedPlanes`),
which makes them 8-bit. Which ones:

- a multi-token step (prefill, a chunk): the top ``rows`` by rank among the tokens refined before it and the
  tokens it stores (ties keep the older);
- a decode step: the token leaving the full-precision window takes a free row; when none is free, the
  lowest-ranked refined token loses its low plane if the new one ranks above it (ties keep the refined one);
- evicting a token frees its row. A token that lost its low plane never gets it back (it is not kept), and
  nothing is ever re-quantized.

Without scores (policies that keep none, or a frozen copy for compress-then-ask, which evicts nothing) every rank
is equal: free rows go to tokens as they arrive. The decode step is the torch form (the CPU kernel and the Triton
op do not read the side buffer) and still captures with ``torch.compile(fullgraph=True)``. The side buffer is
reached through two hooks of :class:`CompressedLayer` (``_after_insert``, ``_refine_read``), so the same code runs
on a head-adaptive pool (:class:`AdaptiveMixedPrecisionLayer`); global layer budgets get their rows from
:func:`spread_refined_rows`.
"""

from __future__ import annotations

import math

import torch

from ..attention.launch import mark_static_address
from ..errors import ConfigError
from ..formats import IntQuantizer
from ..formats.split import SplitIntQuantizer
from .head_adaptive_layer import HeadAdaptiveLayer
from .layer import CompressedLayer
from .refinement import RefinedPlanes


def _split(quantizer):
    """The split form of a 4-bit ``int`` quantizer; any other unchanged."""
    if type(quantizer) is IntQuantizer and quantizer.bits == 4:
        return SplitIntQuantizer(quantizer.group_size, quantizer.head_dim, quantizer.rotate)
    return quantizer


class MixedPrecisionLayer(CompressedLayer):
    """A :class:`CompressedLayer` with ``high_bits_fraction`` of its store's tokens at 8 bits (see the module
    docstring); takes :class:`CompressedLayer`'s arguments plus:

    Args:
        high_bits_fraction: share of the store's slots whose tokens are kept at 8 bits, in (0, 1].
        refined_per_head: 8-bit rows per KV head when given (the layers of ``layer_budgets="global"``:
            :func:`spread_refined_rows`), else ``ceil(high_bits_fraction x slots per head)``.

    Raises:
        ConfigError: no 4-bit ``int`` keys or values, ``attention_kernel='triton'``, or an unbounded cache of
            unknown length (pass ``max_length``).
    """

    def __init__(self, *args, high_bits_fraction: float, refined_per_head: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.high_bits_fraction, self.refined_per_head = high_bits_fraction, refined_per_head
        self.key_quantizer, self.value_quantizer = _split(self.key_quantizer), _split(self.value_quantizer)
        self.split = {n: q for n, q in (("keys", self.key_quantizer), ("values", self.value_quantizer))
                      if isinstance(q, SplitIntQuantizer)}
        if not self.split:
            raise ConfigError(f"high_bits_fraction={high_bits_fraction} needs 4-bit int keys or values; allowed: "
                              "kv_bits (or k_bits / v_bits) 4 with quant='int'")
        if self.attention_kernel == "triton":
            raise ConfigError("high_bits_fraction > 0 runs the torch decode step (the Triton op does not read the "
                              "8-bit tokens' low planes); allowed: attention_kernel='auto' or 'torch'")
        if self.growable:
            raise ConfigError("high_bits_fraction > 0 needs a cache of known length; pass max_length to make_cache")

    def _own_args(self) -> dict:
        own = {"high_bits_fraction": self.high_bits_fraction}
        return own if self.refined_per_head is None else own | {"refined_per_head": self.refined_per_head}

    def reset(self) -> None:
        super().reset()
        self.refine: RefinedPlanes | None = None
        self.pending_low: dict | None = None  # the low planes of the tokens being stored in this step

    def refined_rows(self) -> int:
        """Tokens kept at 8 bits per sequence and store row: ``ceil(high_bits_fraction x slots per head)`` (or
        ``refined_per_head``) per KV head; a head-adaptive pool shares ``kv_heads x`` that."""
        per_head = self.refined_per_head
        if per_head is None:
            per_head = math.ceil(self.high_bits_fraction * self.store.slots_per_head)
        return per_head * (self.store.slots // self.store.slots_per_head)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.native = self.fused = False  # the torch form reads the side buffer
        self.refine = RefinedPlanes(  # per store row: a KV head, or the whole pool of a head-adaptive layer
            self.refined_rows(), self.batch, self.store.positions.shape[1], self.head_dim, tuple(self.split),
            self.device,
        )
        if self.device.type != "meta":
            mark_static_address(self.refine.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`CompressedLayer.tensors` plus ``refine.slots`` and ``refine.keys.data``/``refine.values.data``."""
        held = super().tensors()
        if self.refine is not None:
            held |= {f"refine.{k}": v for k, v in self.refine.tensors().items()}
        return held

    def _map_batch(self, fn, in_place: bool) -> None:
        super()._map_batch(fn, in_place)  # in place: tensors() covers the side buffer too
        if self.is_initialized and not in_place:
            self.refine.map_batch(fn)

    def _rank(self) -> torch.Tensor:
        """The policy's rank of every stored token, fp32 ``[batch, kv_heads, slots]`` (all equal without scores)."""
        positions = self.store.positions
        if self.store.scores is None and self.policy.needs_scores:
            return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
        return self.policy.rank(self.store.scores, positions, self.seen).float()

    # -- the hooks of CompressedLayer ----------------------------------------------------------------
    def _quantize_incoming(self, keys: torch.Tensor, values: torch.Tensor):
        stored, low = {}, {}
        for name, x, quantizer in (("keys", keys, self.key_quantizer), ("values", values, self.value_quantizer)):
            if name in self.split:
                stored[name], low[name] = quantizer.quantize_split(x)
            else:
                stored[name] = quantizer.quantize(x)
        self.pending_low = low
        return stored["keys"], stored["values"]

    def _after_insert(self, slot: torch.Tensor) -> None:
        """Decode step: admit the tokens that entered ``slot`` (int64 ``[batch, store rows, k]``: one per KV head,
        ``k`` of them in one row of a head-adaptive pool), one after the other."""
        low, self.pending_low = self.pending_low, None
        rank = self._rank()
        for k in range(slot.shape[2]):
            self.refine.admit_one(slot[..., k:k + 1], {n: t[:, :, k:k + 1] for n, t in low.items()}, rank,
                                  self.store.positions)

    def _refine_read(self, name: str, held: torch.Tensor) -> None:
        """The refined tokens of the store part just read at 4 bits get their low planes back (8-bit values)."""
        if name in self.split:
            stored = getattr(self.store, name)
            self.refine.correct(held, name, self.split[name], stored.parts["scale_zero"], self.store.positions)

    def _store_incoming(self, incoming, keys, values, positions, scores):
        refined = self.refine.in_use(self.store.positions)  # before the new tokens take their slots
        placed = super()._store_incoming(incoming, keys, values, positions, scores)
        low, self.pending_low = self.pending_low, None
        self.refine.admit_many(refined, placed, low, self._rank(), self.store.positions)
        return placed


def spread_refined_rows(slots: list[int], fraction: float, uniform_slots: int) -> list[int]:
    """8-bit rows per KV head for layers of ``slots`` store slots per head (``layer_budgets="global"``: sized by
    the scores, so unknown to the planner), summing to ``len(slots) x ceil(fraction x uniform_slots)``, the
    uniform layers' rows, which is what the planner counts: ``floor(fraction x slots)`` each, then one more row at a
    time to the largest remainders (never more rows than slots)."""
    rows = [min(s, math.floor(fraction * s)) for s in slots]
    spare = len(slots) * math.ceil(fraction * uniform_slots) - sum(rows)
    order = sorted(range(len(slots)), key=lambda i: rows[i] - fraction * slots[i])
    while spare > 0:
        growing = [i for i in order if rows[i] < slots[i]][:spare]
        if not growing:
            break
        for i in growing:
            rows[i] += 1
        spare -= len(growing)
    return rows


class AdaptiveMixedPrecisionLayer(MixedPrecisionLayer, HeadAdaptiveLayer):
    """Mixed precision by importance on a head-adaptive layer (``head_budgets="adaptive"`` with
    ``high_bits_fraction``): the 8-bit rows are shared by the KV heads as the pool's slots are, ``kv_heads x
    ceil(high_bits_fraction x slots per head)`` per sequence (uniform heads' count), given to the top-ranked tokens
    of any head (the rank is comparable across heads: the same ranking Ada-KV shares the slots by); the pool's
    ``kv_heads`` entering tokens of a decode step are admitted one after the other. Arguments and errors as both
    parents."""
