"""``a2sf``: Accumulative Attention Score with Forgetting Factor (Jo & Shin 2024, arXiv 2407.20485 §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.utils.checks import is_real
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.policies.base import policy_option
from h2o_compress.policies.h2o import H2OPolicy
from h2o_compress.attention import attention_probability_sums


@dataclass
class A2SFPolicy(H2OPolicy):
    """H2O's accumulated attention with a forgetting factor: each query first scales every held token's score by
    `forgetting_factor`, then adds its attention (GQA query heads summed per KV head), so a token's score is
    ``sum_t factor ** (age of query t) x p_t``. Between ``h2o`` (factor 1: every past query counts alike, which
    favours old tokens) and ``tova`` (factor 0: the current query alone). A multi-token step weighs its queries the
    same way, in order. The capacity is split as for ``h2o`` (``heavy_ratio``).

    The default 0.8 is what streamed SmolLM2 best at budget 0.1 + 4 bits among 0.5 / 0.8 / 0.9
    (``benchmarks/results/a2sf_cpu.md``); ``CompressionConfig(forgetting_factor=...)`` (``--forgetting-factor``)
    sets another. Every decode path (CPU kernel, Triton op, torch form) runs it: the
    scores are scaled in place before the step's attention accumulates into them.

    Raises:
        ConfigError: a factor outside (0, 1].
    """

    summary: ClassVar[str] = "H2O with a forgetting factor (--forgetting-factor)"
    forgetting_factor: float = policy_option(0.8, help="the factor in (0, 1] each query scales the held scores by "
                                             "before adding its attention.")

    def __post_init__(self) -> None:
        factor = self.forgetting_factor
        if not is_real(factor):
            raise ConfigError(f"forgetting_factor={short(factor)} is invalid; allowed: a number in (0, 1]")
        if not 0 < factor <= 1:  # (NaN fails too)
            raise ConfigError(f"forgetting_factor={short(factor)} is out of range; allowed: a number in (0, 1]")

    @property
    def score_decay(self) -> float:
        return float(self.forgetting_factor)

    def chunk_scores(self, query, keys, mask, scaling, chunk_size: int, variant=None) -> torch.Tensor:
        """The chunk's probabilities, query ``i`` of ``n`` weighed ``factor ** (n - 1 - i)``."""
        return attention_probability_sums(query, keys, mask, scaling, chunk_size, decay=self.score_decay,
                                          variant=variant)
