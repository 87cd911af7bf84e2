"""`RefinedPlanes`: the low 4-bit planes of the top-ranked stored tokens of one layer (mixed precision).

Every stored token of a mixed-precision layer keeps the high plane of its 8-bit code in the slot store (int4
layout, :class:`~h2o_compress.formats.split.SplitIntQuantizer`); ``rows`` of them also keep the low plane here,
which makes them 8-bit again. Per sequence and KV head, row ``r`` holds the low plane of the token in store slot
``slots[b, h, r]`` (``-1``: free). A row is in use only while its slot holds a token (``positions >= 0``) that
was there when the row was given: evicting a token frees its low plane; a slot reused by a new token drops the
stale row first. Demoting a token frees its row, nothing is re-quantized, and a token never regains its low plane.
Fixed buffers, no host sync in a decode step (``torch.compile(fullgraph=True)`` captures it).
"""

from __future__ import annotations

import torch

from ..policies.base import keep_top

NAMES = ("keys", "values")


class RefinedPlanes:
    """Low planes ``{keys, values}`` uint8 ``[batch, kv_heads, rows, head_dim / 2]`` (only the split tensors) and
    the slot of each row, int32 ``[batch, kv_heads, rows]`` (``-1``: free).

    Args:
        rows: refined tokens per sequence and KV head (``ceil(fraction x slots)``).
        batch, kv_heads, head_dim: the layer's geometry.
        names: which of ``keys``/``values`` are split (4-bit).
        device: where the buffers live.
    """

    def __init__(self, rows: int, batch: int, kv_heads: int, head_dim: int, names: tuple[str, ...], device):
        self.slots = torch.full((batch, kv_heads, rows), -1, dtype=torch.int32, device=device)
        self.low = {n: torch.zeros(batch, kv_heads, rows, head_dim // 2, dtype=torch.uint8, device=device) for n in names}

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
        """Multi-token step (eager): of the tokens refined before it (``refined``, :meth:`in_use` taken before the
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
