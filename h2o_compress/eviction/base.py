"""Eviction policy interface: which tokens a layer keeps when it holds more than its capacity."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EvictionPolicy:
    """Chooses the tokens to keep, per sequence and KV head.

    Subclasses set ``needs_scores`` when they read accumulated attention scores, and implement
    :meth:`keep_indices`. ``sink_tokens`` first tokens are always kept (StreamingLLM's attention sinks).
    """

    heavy_ratio: float = 0.5
    sink_tokens: int = 0
    needs_scores = False

    def recent_window(self, capacity: int) -> int:
        """Tokens of the recent window at ``capacity``: the newest tokens, never evicted."""
        return max(capacity - min(self.sink_tokens, capacity), 0)

    def keep_indices(self, scores: torch.Tensor | None, length: int, capacity: int) -> torch.Tensor:
        """Indices of the ``capacity`` tokens to keep out of ``length``, ascending.

        Args:
            scores: fp32 ``[batch, kv_heads, length]`` accumulated attention (only for ``needs_scores``).
            length: tokens now held (> capacity).
            capacity: tokens to keep.

        Returns:
            ``[capacity]`` (same for every sequence and head) or ``[batch, kv_heads, capacity]``, int64.
        """
        sinks = min(self.sink_tokens, capacity)
        recent = torch.arange(length - (capacity - sinks), length)
        if sinks == 0:
            return recent
        return torch.cat((torch.arange(sinks), recent))
