"""Eviction policy interface: the priority by which a layer keeps tokens when it holds more than its capacity."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EvictionPolicy:
    """Ranks the tokens of one layer, per sequence and KV head, for eviction (DESIGN.md §2).

    A policy states its ranking once, in :meth:`rank`; :meth:`priority` adds the rules every policy shares and
    is the one function prefill eviction (keep the top ``capacity``), decode eviction (evict the lowest) and the
    planner's window arithmetic (:meth:`recent_window`) read.

    Subclasses set ``needs_scores`` when they rank by accumulated attention scores, and say how much of the
    capacity is the recent window (:meth:`recent_window`). ``sink_tokens`` first real tokens are always kept
    (StreamingLLM's attention sinks); padding is never kept.
    """

    heavy_ratio: float = 0.5
    sink_tokens: int = 0
    needs_scores = False

    def recent_window(self, capacity: int) -> int:
        """Tokens of the recent window at ``capacity``: the newest tokens, never evicted."""
        return max(capacity - min(self.sink_tokens, capacity), 0)

    def rank(self, scores: torch.Tensor | None, positions: torch.Tensor, seen: int | torch.Tensor) -> torch.Tensor:
        """The policy's own ranking of evictable tokens (higher = kept longer), fp32, shaped like ``positions``.

        Args:
            scores: fp32 ``[batch, kv_heads, tokens]`` accumulated attention (``None`` unless ``needs_scores``).
            positions: int ``[batch, kv_heads, tokens]`` absolute positions (``-1``: empty slot).
            seen: tokens seen so far (int or 0-dim tensor).

        Default: all equal, so the tie rule (evict the older) makes it a recent window.
        """
        return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)

    def priority(
        self,
        scores: torch.Tensor | None,
        positions: torch.Tensor,
        seen: int | torch.Tensor,
        first_real: torch.Tensor,
        capacity: int,
    ) -> torch.Tensor:
        """Eviction priority, fp32 ``[batch, kv_heads, tokens]``: ``+inf`` for the recent window (positions
        ``>= seen - recent_window(capacity)``) and the sinks (the first ``sink_tokens`` real tokens, from
        ``first_real`` int64 ``[batch]``), ``-inf`` for empty slots and padding (``positions < 0``), else
        :meth:`rank`. Ties are broken by the caller towards keeping the older token.
        """
        priority = self.rank(scores, positions, seen)
        recent, sinks = self.recent_window(capacity), min(self.sink_tokens, capacity)
        protected = positions >= seen - recent
        if sinks:
            start = first_real.view(-1, 1, 1)
            protected = protected | ((positions >= start) & (positions < start + sinks))
        return priority.masked_fill(protected, float("inf")).masked_fill(positions < 0, float("-inf"))
