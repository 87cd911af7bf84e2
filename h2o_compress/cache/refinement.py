"""`RefinedPlanes`: the low 4-bit planes of the top-ranked stored tokens of one layer (mixed precision).

Every stored token of a mixed-precision layer keeps the high plane of its 8-bit code in the slot store (int4
layout, `SplitIntQuantizer`); ``rows`` of them also keep the low plane here,
which makes them 8-bit again. Per sequence and KV head, row ``r`` holds the low plane of the token in store slot
``slots[b, h, r]`` (``-1``: free). A row is in use only while its slot holds a token (``positions >= 0``) that
was there when the row was given: evicting a token frees its low plane; a slot reused by a new token drops the
stale row first. Demoting a token frees its row, nothing is re-quantized, and a token never regains its low plane.
Fixed buffers, no host sync in a decode step (``torch.compile(fullgraph=True)`` captures it).

Mixed precision by importance (the store's optional part), as MiKV keeps the important tokens' KV at higher
precision and the rest at lower
(Yang et al. 2024, "No Token Left Behind", arXiv 2402.18096), with the importance the eviction policy's own
[`rank`][h2o_compress.policies.EvictionPolicy.rank] (H2O: accumulated attention; TOVA: the current query's).

Every token entering the store is quantized once at 8 bits and split into two 4-bit planes
(`SplitIntQuantizer`): the high plane goes into the slot store in the int4
layout (an int4 token costs exactly what it costs in a plain int4 cache); ``ceil(high_bits_fraction x slots)``
tokens per sequence and KV head also keep the low plane in a side buffer ([`RefinedPlanes`][h2o_compress.cache.RefinedPlanes]),
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
reached through the store ([`enter`][h2o_compress.cache.SlotStore.enter], [`place_tokens`][h2o_compress.cache.SlotStore.place_tokens],
[`read`][h2o_compress.cache.SlotStore.read]), so the same code runs on a head-adaptive pool; global layer budgets get their rows from
`spread_refined_rows`.
"""

from __future__ import annotations

import math

import torch

from h2o_compress.policies.base import keep_top

NAMES = ("keys", "values")


class RefinedPlanes:
    """Low planes ``{keys, values}`` uint8 ``[batch, kv_heads, rows, head_dim / 2]`` (values: ``value_dim / 2``;
    only the split tensors) and the slot of each row, int32 ``[batch, kv_heads, rows]`` (``-1``: free).

    Args:
        rows: refined tokens per sequence and KV head (``ceil(fraction x slots)``).
        batch: the layer's batch size.
        kv_heads: the layer's KV heads.
        head_dim: the layer's head dim.
        names: which of ``keys``/``values`` are split (4-bit).
        device: where the buffers live.
        value_dim: the values' width (``None``: ``head_dim``).
    """

    def __init__(self, rows: int, batch: int, kv_heads: int, head_dim: int, names: tuple[str, ...], device,
                 value_dim: int | None = None):
        self.slots = torch.full((batch, kv_heads, rows), -1, dtype=torch.int32, device=device)
        width = {"keys": head_dim, "values": value_dim or head_dim}
        self.low = {n: torch.zeros(batch, kv_heads, rows, width[n] // 2, dtype=torch.uint8, device=device)
                    for n in names}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer, by name (``slots``, ``keys.data``, ``values.data``)."""
        return {"slots": self.slots} | {f"{n}.data": t for n, t in self.low.items()}

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (acting on dim 0) to every buffer, into new ones (batch selection, repetition)."""
        self.slots = fn(self.slots)
        self.low = {n: fn(t) for n, t in self.low.items()}

    def in_use(self, positions: torch.Tensor) -> torch.Tensor:
        """bool ``[batch, kv_heads, rows]``: rows whose slot holds a token (store ``positions`` int ``[batch,
        kv_heads, slots]``)."""
        held = positions.gather(2, self.slots.long().clamp(min=0)) >= 0
        return (self.slots >= 0) & held

    def admit_one(self, slot: torch.Tensor, low: dict, rank: torch.Tensor, positions: torch.Tensor) -> None:
        """Decode step: the token just written into ``slot`` (int64 ``[batch, kv_heads, 1]``) with low planes
        ``low[name]`` ``[batch, kv_heads, 1, head_dim / 2]`` takes a free row, or else the row of the lowest-ranked
        refined token when it ranks above it (``rank`` fp32 ``[batch, kv_heads, slots]``, higher = more important;
        ties keep the refined token). In place, no host sync."""
        self.slots.masked_fill_(self.slots.long() == slot, -1)  # a stale row of the reused slot
        rows = self.slots.long().clamp(min=0)
        row_rank = rank.gather(2, rows).masked_fill(~self.in_use(positions), float("-inf"))
        victim = row_rank.argmin(-1, keepdim=True)  # a free row first
        entering = positions.gather(2, slot) >= 0
        take = entering & ((rank.gather(2, slot) > row_rank.gather(2, victim)) | (row_rank.gather(2, victim) == float("-inf")))
        self.slots.scatter_(2, victim, torch.where(take, slot.to(torch.int32), self.slots.gather(2, victim)))
        for name, buffer in self.low.items():
            index = victim.unsqueeze(-1).expand(-1, -1, -1, buffer.shape[-1])
            buffer.scatter_(2, index, torch.where(take.unsqueeze(-1), low[name], buffer.gather(2, index)))

    def admit_many(self, refined: torch.Tensor, placed, low: dict, rank: torch.Tensor, positions: torch.Tensor) -> None:
        """Multi-token step (eager): of the tokens refined before it (``refined``, [`in_use`][h2o_compress.cache.RefinedPlanes.in_use] taken before the
        new tokens were placed) and the new ones (``placed = (b, h, slot, i)``, 1-D int64 index tensors; their low
        planes ``low[name][b, h, i]``), keep the top ``rows`` by ``rank`` (ties keep the older position)."""
        batch, heads, count = positions.shape
        eligible = torch.zeros(batch, heads, count, dtype=torch.bool, device=positions.device)
        by_slot = {n: t.new_zeros(batch, heads, count, t.shape[-1]) for n, t in self.low.items()}
        b, h, r = refined.nonzero(as_tuple=True)
        s = self.slots[b, h, r].long()
        eligible[b, h, s] = True
        for name, buffer in self.low.items():
            by_slot[name][b, h, s] = buffer[b, h, r]
        if placed is not None:
            b, h, s, i = placed
            eligible[b, h, s] = True
            for name in self.low:
                by_slot[name][b, h, s] = low[name][b, h, i]
        chosen = keep_top(rank.masked_fill(~eligible, float("-inf")), positions.long().masked_fill(~eligible, -1),
                          self.slots.shape[2])
        order = torch.sort(chosen.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., : self.slots.shape[2]]
        self.slots.copy_(torch.where(chosen.gather(2, order), order, -1))
        for name, buffer in self.low.items():
            buffer.copy_(by_slot[name].gather(2, order.unsqueeze(-1).expand(-1, -1, -1, buffer.shape[-1])))

    def correct(self, out: torch.Tensor, name: str, quantizer, scale_zero: torch.Tensor,
                positions: torch.Tensor) -> None:
        """Add the low planes' corrections to ``out`` ``[batch, kv_heads, slots, head_dim]`` (the store read at
        4 bits), in place: refined slots then hold their 8-bit values. ``scale_zero``: the store's fp16
        ``[batch, kv_heads, slots, groups, 2]``."""
        rows = self.slots.long().clamp(min=0)
        use = self.in_use(positions)
        pairs = scale_zero.gather(2, rows[..., None, None].expand(-1, -1, -1, *scale_zero.shape[3:]))
        delta = quantizer.correction(self.low[name], pairs) * use.unsqueeze(-1)
        out.scatter_add_(2, rows.unsqueeze(-1).expand(-1, -1, -1, out.shape[-1]), delta.to(out.dtype))


def refined_rows(fraction: float, per_head: int | None, store) -> int:
    """Tokens kept at 8 bits per sequence and store row: ``ceil(fraction x slots per head)`` (or ``per_head``) per
    KV head; a head-adaptive pool shares ``kv_heads x`` that."""
    if per_head is None:
        per_head = math.ceil(fraction * store.slots_per_head)
    return per_head * (store.slots // store.slots_per_head)


def stored_rank(policy, store, seen: torch.Tensor) -> torch.Tensor:
    """The policy's rank of every stored token, fp32 ``[batch, rows, slots]`` (all equal without scores): which
    tokens keep their low planes (MiKV, arXiv 2402.18096, with the eviction policy's own importance)."""
    if store.scores is None and policy.needs_scores:
        return torch.zeros(store.positions.shape, dtype=torch.float32, device=store.positions.device)
    return policy.rank(store.scores, store.positions, seen).float()


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
