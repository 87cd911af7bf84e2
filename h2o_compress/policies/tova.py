"""``tova``: Token Omission Via Attention (Oren et al. 2024, arXiv 2401.06104 §3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.policies.h2o import H2OPolicy
from h2o_compress.attention import attention_probability_sums


@dataclass
class TOVAPolicy(H2OPolicy):
    """Evicts the token with the lowest attention from the *current* query, averaged over the query heads of a KV
    group (ranking by the group's sum is the same order): the scores are not accumulated, each step's attention
    replaces them. A multi-token step (prefill) ranks by its last query's attention, as the paper and kvpress's
    ``TOVAPress`` do. The capacity is split as for ``h2o`` (``heavy_ratio``); the paper keeps no separate recent
    window, so a heavy ratio near 1 (0.9 or more; at least one recent token stays) is closest to it.
    """

    summary: ClassVar[str] = "the current query's attention only (TOVA)"

    accumulates: ClassVar[bool] = False

    def chunk_scores(self, query, keys, mask, scaling, chunk_size: int, variant=None) -> torch.Tensor:
        """The attention of the chunk's last query only."""
        last = None if mask is None else mask[..., -1:, :]
        return attention_probability_sums(query[:, :, -1:], keys, last, scaling, chunk_size, variant=variant)
