"""``vatp``: heavy hitters ranked by attention x value norm (Guo et al. 2024, arXiv 2406.12335 §3, VATP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.policies.h2o import H2OPolicy


@dataclass
class VATPPolicy(H2OPolicy):
    """H2O (arXiv 2306.14048 §4) with each heavy-hitter candidate's accumulated attention multiplied by the norm of
    its value vector (Value-Aware Token Pruning, Guo et al. 2024, "Attention Score is not All You Need for Token
    Importance Indicator in KV Cache Reduction: Value Also Matters", arXiv 2406.12335 §3): a token's share of the
    attention output is its probability times its value, so a heavily attended token with a near-zero value (an
    attention sink's typical shape) is worth less than the probability alone says.

    The norm is the paper's L1 norm of the value in the model's basis (values held in the Hadamard basis are turned
    back first), of the stored (dequantized) value, taken once when the token enters the store and kept per slot
    (`norms`, one fp32 per slot, like the score). Chosen on
    the tuning text only: in the reference simulation (``benchmarks/eviction_directions.py``, SmolLM2, the tuning text
    read token by token, budget 0.2, 16 bits: ``benchmarks/results/eviction_directions_choose.md``) ranking by
    attention x L1 norm came closest to the uncompressed perplexity, ahead of x L2 norm and ``h2o``. Same budget split,
    recent window, sinks and tie rule as ``h2o``; the scores accumulated are H2O's.
    """

    summary: ClassVar[str] = "heavy hitters ranked by accumulated attention x value norm (VATP)"

    ranks_by: ClassVar[str] = "scores"  # H2O's rank; the priority multiplies it by the norms (weighs_values)
    weighs_values: ClassVar[bool] = True

    def priority(self, scores: torch.Tensor | None, positions: torch.Tensor, seen, first_real: torch.Tensor,
                 capacity: int, value_norms: torch.Tensor | None = None) -> torch.Tensor:
        """H2O's eviction priority ([`EvictionPolicy.priority`][h2o_compress.policies.EvictionPolicy.priority]) of ``scores x value_norms`` (fp32, shaped like
        ``positions``); of the scores alone where no norms are given (`rank` stays H2O's: the importance the
        mixed-precision refinement reads)."""
        weighed = scores if value_norms is None else scores * value_norms
        return super().priority(weighed, positions, seen, first_real, capacity)
