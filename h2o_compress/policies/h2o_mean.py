"""``h2o-mean``: H2O ranked by mean instead of summed attention (DESIGN.md §3, pitfall 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.policies.h2o import H2OPolicy


@dataclass
class H2OMeanPolicy(H2OPolicy):
    """H2O (Zhang et al. 2023, arXiv 2306.14048 §4) with heavy hitters ranked by the *mean* attention a token
    received: its accumulated score divided by the number of queries that have seen it (``seen - position``).

    The paper's sum favours early tokens, which every later query has seen; the mean ranks a token by how
    strongly it is attended when it is visible, as kvpress's ``ObservedAttentionPress`` does for a prompt
    (NVIDIA kvpress). Same budget split, recent window, sinks and tie rule as ``h2o``; the same scores are
    accumulated and stored (the slot positions the cache keeps give the counts, so it costs no memory).
    """

    summary: ClassVar[str] = "heavy hitters ranked by mean instead of summed attention"

    ranks_by: ClassVar[str] = "custom"

    def rank(self, scores: torch.Tensor | None, positions: torch.Tensor, seen) -> torch.Tensor:
        return scores / (seen - positions).clamp(min=1).to(scores.dtype)
