"""`RingWindow`: the newest tokens of one layer in full precision (KIVI's residual), in a fixed ring buffer.

The token at absolute position ``p`` sits in slot ``p % size``, so a decode step overwrites exactly the slot of
the token that leaves the window, which then enters the quantized store, quantized once (KIVI, Liu et al. 2024,
arXiv 2402.02750 §3.3, with a window of exactly ``size`` tokens). Positions are kept per sequence (``-1``: empty
or padding) and are the same for every KV head.
"""

from __future__ import annotations

import torch


class RingWindow:
    """Keys ``[batch, kv_heads, size, head_dim]``, values ``[batch, kv_heads, size, value_dim]``, positions int32
    ``[batch, size]``, scores fp32 ``[batch, kv_heads, size]`` (or ``None``).

    Args:
        shape: ``(batch, kv_heads, size, head_dim)``; ``size >= 1``.
        dtype: dtype of the window (fp16 for fp32 models: its bytes count, DESIGN.md §2).
        device: where the buffers live.
        with_scores: keep a score per slot.
        value_dim: the values' width (``None``: ``head_dim``).
    """

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, with_scores: bool,
                 value_dim: int | None = None):
        batch, heads, size, head_dim = shape
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, size, value_dim or head_dim, dtype=dtype, device=device)
        self.positions = torch.full((batch, size), -1, dtype=torch.int32, device=device)
        self.scores = torch.zeros(batch, heads, size, device=device) if with_scores else None

    @property
    def size(self) -> int:
        return self.positions.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer, by name (``keys``, ``values``, ``positions``, ``scores``)."""
        held = {"keys": self.keys, "values": self.values, "positions": self.positions}
        if self.scores is not None:
            held["scores"] = self.scores
        return held

    def map_batch(self, fn) -> None:
        """Replace every buffer by ``fn`` of it (a function of one tensor acting on the batch dim 0)."""
        self.keys, self.values, self.positions = fn(self.keys), fn(self.values), fn(self.positions)
        if self.scores is not None:
            self.scores = fn(self.scores)

    def valid(self, heads: int) -> torch.Tensor:
        """bool ``[batch, heads, size]``: slots holding a token, per KV head."""
        return (self.positions >= 0).unsqueeze(1).expand(-1, heads, -1)

    def push(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor):
        """Decode step: write one token (``[batch, kv_heads, 1, head_dim]`` at 0-dim int64 ``position``) into its
        slot and return the token it replaces: ``(keys, values, positions int32 [batch, 1], scores [batch,
        kv_heads, 1] | None)``; positions ``-1`` when that slot was empty. In place, no host sync."""
        slot = torch.remainder(position, self.size).view(1)
        leaving = (
            self.keys.index_select(2, slot), self.values.index_select(2, slot), self.positions.index_select(1, slot),
            None if self.scores is None else self.scores.index_select(2, slot),
        )
        self.keys.index_copy_(2, slot, keys)
        self.values.index_copy_(2, slot, values)
        self.positions.index_copy_(1, slot, position.to(torch.int32).expand(self.positions.shape[0], 1))
        if self.scores is not None:
            self.scores.index_fill_(2, slot, 0.0)
        return leaving

    def order(self, seen: int) -> torch.Tensor:
        """int64 ``[size]``: the slots of positions ``seen - size .. seen - 1``, oldest first."""
        return torch.remainder(torch.arange(seen, seen + self.size, device=self.positions.device), self.size)

    def write(self, keys, values, positions, scores, seen: int) -> None:
        """Fill the window with the ``size`` tokens at positions ``seen - size .. seen - 1`` (oldest first):
        ``keys``/``values`` ``[batch, kv_heads, size, head_dim]``, int ``positions`` ``[batch, size]`` (``-1``:
        padding), fp32 ``scores`` ``[batch, kv_heads, size]`` (ignored without scores). In place."""
        slot = self.order(seen)
        self.keys.index_copy_(2, slot, keys.to(self.keys.dtype))
        self.values.index_copy_(2, slot, values.to(self.values.dtype))
        self.positions.index_copy_(1, slot, positions.to(torch.int32))
        if self.scores is not None:
            self.scores.index_copy_(2, slot, scores)


def held_positions(store, ring: RingWindow | None, heads: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[batch, heads, slots + size]``: the position each slot of a layer's ``store`` (per KV head) and
    ``ring`` (in ``order`` of slots when given, else as laid out; none without a ring) holds, ``-1`` where empty."""
    held = store.head_positions().long()
    if ring is None:
        return held
    positions = ring.positions if order is None else ring.positions.index_select(1, order)
    return torch.cat((held, positions.long().unsqueeze(1).expand(-1, heads, -1)), dim=2)
