"""`SlotPool`: one layer's kept tokens in one pool of slots shared by its KV heads, each slot tagged with its head.

The layout behind head-adaptive budgets (Ada-KV, Feng et al. 2024, arXiv 2407.11550): a [`SlotStore`][h2o_compress.cache.SlotStore] with a
single head row, ``[batch, 1, pool_slots, ...]``, plus ``owner`` ``[batch, 1, pool_slots]`` naming the KV head
whose token a slot holds. A head that keeps more tokens simply holds more slots of the pool, so the bytes are those
of the layer's total budget, however it is spread over the heads (kvpress's AdaKV masks evicted tokens with a fake
key and keeps their bytes; here an evicted token's slot is free for any head). Static shapes, no host sync.
"""

from __future__ import annotations

import torch

from h2o_compress.formats import KVQuantizer
from h2o_compress.policies.base import keep_top
from h2o_compress.cache.slots import SlotStore


class SlotPool(SlotStore):
    """Keys, values, positions, scores and owning head of ``pool_slots`` slots per sequence, shared by ``kv_heads``.

    Attributes (beside [`SlotStore`][h2o_compress.cache.SlotStore]'s, all with head dim 1):
        owner: int8 (int16 above 127 heads) ``[batch, 1, pool_slots]``, the KV head of each held token
            (meaningless where ``positions`` is ``-1``).

    Args:
        key_quantizer: storage format of the keys.
        value_quantizer: storage format of the values.
        shape: ``(batch, kv_heads, pool_slots, head_dim)``.
        dtype: as [`SlotStore`][h2o_compress.cache.SlotStore].
        device: as [`SlotStore`][h2o_compress.cache.SlotStore].
        with_scores: as [`SlotStore`][h2o_compress.cache.SlotStore].
        with_norms: as [`SlotStore`][h2o_compress.cache.SlotStore].
        value_basis: as [`SlotStore`][h2o_compress.cache.SlotStore].
        value_weight: as [`SlotStore`][h2o_compress.cache.SlotStore].
        value_dim: as [`SlotStore`][h2o_compress.cache.SlotStore].
    """

    def __init__(
        self, key_quantizer: KVQuantizer, value_quantizer: KVQuantizer, shape: tuple[int, int, int, int],
        dtype: torch.dtype, device: torch.device, with_scores: bool, with_norms: bool = False,
        value_basis: torch.Tensor | None = None, value_weight=None, value_dim: int | None = None,
    ):
        batch, heads, slots, head_dim = shape
        super().__init__(key_quantizer, value_quantizer, (batch, 1, slots, head_dim), dtype, device, with_scores,
                         with_norms, value_basis, value_weight, value_dim)
        self.heads = heads
        tag = torch.int8 if heads <= 127 else torch.int16
        self.owner = torch.zeros(batch, 1, slots, dtype=tag, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer, by name ([`SlotStore`][h2o_compress.cache.SlotStore]'s and ``owner``)."""
        return super().tensors() | {"owner": self.owner}

    def map_batch(self, fn) -> None:
        """[`SlotStore.map_batch`][h2o_compress.cache.SlotStore.map_batch], and the ``owner`` tags."""
        super().map_batch(fn)
        self.owner = fn(self.owner)

    def head_mask(self) -> torch.Tensor:
        """bool ``[batch, kv_heads, pool_slots]``: slot ``s`` holds a token of head ``h``."""
        heads = torch.arange(self.heads, device=self.owner.device).view(1, -1, 1)
        return (self.owner == heads) & (self.positions >= 0)

    def head_positions(self) -> torch.Tensor:
        """int32 ``[batch, kv_heads, pool_slots]``: the position each slot holds for each head, ``-1`` elsewhere."""
        return torch.where(self.head_mask(), self.positions, -1)

    @property
    def slots_per_head(self) -> int:
        """The pool's slots over its heads (a uniform layer's slots per head: the same bytes)."""
        return self.slots // self.heads

    def head_value_norms(self) -> torch.Tensor:
        """fp32 ``[batch, kv_heads, pool_slots]``: each slot's value norm under every head (the head positions mask
        the slots a head does not own)."""
        return self.value_norms().expand(-1, self.heads, -1)

    def head_scores(self) -> torch.Tensor:
        """fp32 ``[batch, kv_heads, pool_slots]``: each slot's score under its owner head, 0 under the others."""
        return torch.where(self.head_mask(), self.scores, 0.0)

    def score_share(self, sums: torch.Tensor) -> torch.Tensor:
        """A slot's score is its owner's: the other heads gave it probability 0 (masked), so the sum over heads,
        ``[batch, 1, pool_slots]``."""
        return sums.sum(1, keepdim=True)

    def keep(self, priority: torch.Tensor, positions: torch.Tensor, capacity: int) -> torch.Tensor:
        """The flat top ``kv_heads x capacity`` over every head of a sequence (Ada-KV §3; ties keep the older
        token, then the lower head): bool ``[batch, kv_heads, tokens]``."""
        batch, heads, tokens = priority.shape
        keep = keep_top(priority.reshape(batch, 1, heads * tokens), positions.reshape(batch, 1, heads * tokens),
                        heads * capacity)
        return keep.view(batch, heads, tokens)

    def keep_only(self, keep: torch.Tensor, scores: torch.Tensor | None) -> None:
        """[`SlotStore.keep_only`][h2o_compress.cache.SlotStore.keep_only] over the pool: a slot stays when its owner head keeps it; its score is the sum
        over heads (its owner's)."""
        self.positions.masked_fill_(~keep.any(1, keepdim=True), -1)
        if scores is not None:
            self.scores.copy_(scores.sum(1, keepdim=True))

    def free_slots(self, count: int) -> torch.Tensor:
        """int64 ``[batch, 1, count]``: the ``count`` lowest empty slots of each sequence (callers guarantee that
        many are empty; static shapes, no host sync)."""
        free = self.positions < 0
        rank = free.to(torch.int32).cumsum(-1)
        wanted = torch.arange(1, count + 1, device=free.device, dtype=torch.int32).view(1, count, 1)
        return (free & (rank == wanted)).to(torch.uint8).argmax(-1).unsqueeze(1)

    def as_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A per-head tensor ``[batch, kv_heads, 1, ...]`` (one token per head; ``...`` may be empty) as the pool's
        one row: ``[batch, 1, kv_heads, ...]``."""
        return t.transpose(1, 2)

    def free_for_heads(self, heads: int) -> torch.Tensor:
        """int64 ``[batch, 1, heads]``: the ``heads`` lowest empty slots of each sequence ([`free_slots`][h2o_compress.cache.SlotPool.free_slots])."""
        return self.free_slots(heads)

    def enter(self, keys, values, position, score, rank) -> torch.Tensor:
        """[`SlotStore.enter`][h2o_compress.cache.SlotStore.enter] into the pool's lowest empty slots, each tagged with its head."""
        slot = super().enter(keys, values, position, score, rank)
        heads = torch.arange(self.heads, device=slot.device).view(1, 1, -1).expand(slot.shape[0], 1, -1)
        self.owner.scatter_(2, slot, heads.to(self.owner.dtype))
        return slot

    def place_tokens(self, incoming, keys, values, positions, scores, rank, when_full):
        """[`SlotStore.place_tokens`][h2o_compress.cache.SlotStore.place_tokens] over the pool seen as one row of ``kv_heads x n`` tokens, lowest free
        slots first, each tagged with its head."""
        batch, heads, n = incoming.shape

        def one_row(t: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, n, ...] -> [batch, 1, kv_heads * n, ...]
            return t.reshape(batch, 1, heads * n, *t.shape[3:])

        placed = super().place_tokens(one_row(incoming), one_row(keys), one_row(values), positions.repeat(1, heads),
                                      None if scores is None else one_row(scores), rank, when_full)
        if placed is not None:
            b, row, slot, j = placed
            self.owner[b, row, slot] = (j // n).to(self.owner.dtype)
        return placed

    def evict_over(self, priority: torch.Tensor, ring_held: torch.Tensor | int, capacity: int) -> None:
        """A decode step's eviction over the pool (Ada-KV §3): while a sequence holds more than ``kv_heads x
        capacity`` tokens (pool plus ``ring_held`` per head, int ``[batch, 1]`` or 0), evict the lowest-``priority``
        pool token of any head (fp32 ``[batch, 1, pool_slots]``), at most ``kv_heads`` a step: one masked argmin +
        scatter each, ties evicting the newer token. In place, no host sync."""
        limit, ring = self.heads * capacity, self.heads * ring_held
        for _ in range(self.heads):
            priority = priority.masked_fill(self.positions < 0, float("inf"))
            self.evict_lowest(priority, (self.positions >= 0).sum(-1) + ring > limit)

    def resize(self, slots: int) -> None:
        raise NotImplementedError("a slot pool has a fixed size (head-adaptive layers are always bounded)")
