"""Eviction policy interface: which tokens a layer keeps when it holds more than its capacity."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EvictionPolicy:
    """Chooses the tokens to keep, per sequence and KV head.

    Subclasses set ``needs_scores`` when they read accumulated attention scores, and say how much of the
    capacity is the recent window (:meth:`recent_window`). ``sink_tokens`` first real tokens are always kept
    (StreamingLLM's attention sinks); left padding is never kept while real tokens can be.
    """

    heavy_ratio: float = 0.5
    sink_tokens: int = 0
    needs_scores = False

    def recent_window(self, capacity: int) -> int:
        """Tokens of the recent window at ``capacity``: the newest tokens, never evicted."""
        return max(capacity - min(self.sink_tokens, capacity), 0)

    def ranking_scores(self, scores: torch.Tensor, positions: torch.Tensor, seen: int) -> torch.Tensor:
        """The scores :meth:`keep_indices` ranks by, from the accumulated ``scores`` (fp32 ``[batch, kv_heads,
        kept]``), the absolute ``positions`` of those tokens (same shape) and the ``seen`` token count. Default:
        the accumulated sums themselves (H2O). May return ``scores`` itself: callers copy before editing."""
        return scores

    def keep_indices(
        self,
        scores: torch.Tensor | None,
        length: int,
        capacity: int,
        leading_pads: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Indices of the ``capacity`` tokens to keep out of ``length``, ascending.

        Priority: the recent window and the sinks first, then the highest ``scores`` (ties keep the older
        token), padding last.

        Args:
            scores: fp32 ``[batch, kv_heads, length]`` accumulated attention (policies with ``needs_scores``).
            length: tokens now held (> capacity).
            capacity: tokens to keep.
            leading_pads: ``[batch]`` count of left-padding tokens at the start of each sequence, or ``None``.

        Returns:
            ``[capacity]`` (same for every sequence and head) or ``[batch, kv_heads | 1, capacity]``, int64.
        """
        sinks, recent = min(self.sink_tokens, capacity), self.recent_window(capacity)
        if scores is None and leading_pads is None:  # fast path: the same window for every sequence
            window = torch.arange(length - recent, length)
            return window if sinks == 0 else torch.cat((torch.arange(sinks), window))
        if scores is not None:
            priority = scores.clone()
        else:
            priority = torch.zeros(leading_pads.shape[0], 1, length, device=leading_pads.device)
        if leading_pads is not None or sinks:
            position = torch.arange(length, device=priority.device)
            first_real = torch.zeros(1, device=priority.device, dtype=torch.long)
            if leading_pads is not None:
                first_real = leading_pads.view(-1, 1, 1)
                priority.masked_fill_(position < first_real, float("-inf"))
            if sinks:
                priority.masked_fill_((position >= first_real) & (position < first_real + sinks), float("inf"))
        if recent:
            priority[..., length - recent :] = float("inf")
        # A stable descending sort keeps the older token first among equal priorities.
        order = torch.sort(priority, dim=-1, descending=True, stable=True).indices[..., :capacity]
        return order.sort(dim=-1).values
