"""``strided``: a strided static pattern (Sparse Transformer, Child et al. 2019, arXiv 1904.10509 §4.1) composed
with H2O under one budget, as the H2O paper composes them (Zhang et al. 2023, arXiv 2306.14048 §5.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.policies.h2o import H2OPolicy


@dataclass
class StridedPolicy(H2OPolicy):
    """The heavy-hitter share of the capacity goes first to every ``stride``-th position (positions ``0, stride,
    2 x stride, ...``), then to heavy hitters by accumulated attention; the rest is the recent window, as for
    ``h2o``. When there are more strided positions than the share holds, the ones with least attention go first.

    Args:
        stride: the pattern's step, in tokens (default 8).
    """

    stride: int = 8
    summary: ClassVar[str] = "every stride-th position, then heavy hitters, + recent window"
    ranks_by: ClassVar[str] = "custom"
    shares_heads: ClassVar[bool] = False  # the pattern is the same for every head

    def rank(self, scores: torch.Tensor | None, positions: torch.Tensor, seen) -> torch.Tensor:
        """Strided positions above every other token, each group ordered by accumulated attention."""
        strided = (positions >= 0) & (positions % self.stride == 0)
        above = scores.amax(-1, keepdim=True).clamp(min=0) + 1
        return torch.where(strided, scores + above, scores)
