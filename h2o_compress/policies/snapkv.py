"""``snapkv``: SnapKV (Li et al. 2024, arXiv 2404.14469 §4.2, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.policies.h2o import H2OPolicy
from h2o_compress.attention import attention_probability_sums


@dataclass
class SnapKVPolicy(H2OPolicy):
    """Ranks prompt tokens by the attention of the last ``window`` prompt queries (the observation window), summed
    over those queries and the query heads of each KV group, then max-pooled over neighbouring positions
    (``pool`` wide) so that kept tokens come with their context; decode steps then accumulate attention as
    ``h2o`` does. The capacity is split as for ``h2o``: the recent window holds the observation window's tokens
    when ``(1 - heavy_ratio) x capacity >= window``.

    Args:
        window: prompt queries that vote (paper: 32).
        pool: max-pool width over the positions of the step's own tokens, odd (paper and kvpress: 5 to 7).
    """

    summary: ClassVar[str] = "prompt tokens ranked by the attention of the last prompt queries (SnapKV)"

    window: int = 32
    pool: int = 5

    def chunk_scores(self, query, keys, mask, scaling, chunk_size: int, variant=None) -> torch.Tensor:
        """The last ``window`` queries' attention, max-pooled over ``pool`` neighbouring keys."""
        queries = query.shape[2]
        window = min(self.window, queries)
        last = None if mask is None else mask[..., -window:, :]  # None: causal, bottom-right aligned
        votes = attention_probability_sums(query[:, :, -window:], keys, last, scaling, chunk_size, variant=variant)
        if self.pool <= 1:
            return votes
        # pool over the chunk's own tokens only (the last `queries` keys, in position order); held tokens sit in
        # slots in no particular order
        batch, heads, _ = votes.shape
        own = votes[..., -queries:].reshape(batch * heads, 1, queries)
        pooled = torch.nn.functional.max_pool1d(own, self.pool, stride=1, padding=self.pool // 2)
        return torch.cat((votes[..., :-queries], pooled.view(batch, heads, queries)), dim=-1)
