"""``h2o``: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv 2306.14048 §4, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.policies.base import EvictionPolicy


@dataclass
class H2OPolicy(EvictionPolicy):
    """Keeps the heavy hitters (largest accumulated attention) plus the recent window.

    Of the capacity ``C`` (after ``sink_tokens``), ``round(heavy_ratio * C)`` tokens go to heavy hitters
    and the rest to the recent window; a ``heavy_ratio`` below 1 always leaves the recent window at least one
    token (0.99 at ``C = 20``: 19 + 1, not 20 + 0). Heavy hitters are the top scores among tokens outside the recent
    window and the sinks; ties keep the older token. Scores are the summed post-softmax attention each token
    received since it entered the cache, GQA query heads summed per KV head (DESIGN.md §2).
    """

    summary: ClassVar[str] = "heavy hitters (largest accumulated attention) + recent window"
    needs_scores = True
    shares_heads: ClassVar[bool] = True
    ranks_by: ClassVar[str] = "scores"

    def heavy(self, capacity: int) -> int:
        """Heavy-hitter slots at ``capacity``."""
        free = capacity - min(self.sink_tokens, capacity)
        heavy = min(free, round(self.heavy_ratio * free))
        return heavy - 1 if heavy == free > 0 and self.heavy_ratio < 1 else heavy

    def recent_window(self, capacity: int) -> int:
        return capacity - min(self.sink_tokens, capacity) - self.heavy(capacity)

    def rank(self, scores: torch.Tensor | None, positions: torch.Tensor, seen) -> torch.Tensor:
        """The accumulated attention itself (the paper's sum)."""
        return scores
