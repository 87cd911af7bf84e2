"""``snapkv``: SnapKV (Li et al. 2024, arXiv 2404.14469 §4.2, Algorithm 1): the prompt read whole, then ranked by
the attention of its last queries (the observation window) and evicted once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.attention import attention_probability_sums
from h2o_compress.policies.context_scored import ContextScoredPolicy


@dataclass
class SnapKVPolicy(ContextScoredPolicy):
    """Ranks a prompt's tokens by the attention of its last ``window`` queries (the observation window: where a
    prompt ends with its question, the question votes), summed over those queries and the query heads of each KV
    group and max-pooled over ``pool`` neighbouring positions so that kept tokens come with their context; decode
    steps then accumulate attention as ``h2o``.

    The prompt is read whole first (`h2o_compress.runtime.context_scores.read_prompt`: in chunks for the
    activations, every key and value kept in an uncompressed cache), so the tokens it ranks are every token of
    the prompt, and it is evicted to the capacity once; its first new token is the uncompressed model's. Where a
    prompt is read in chunks without that pass (a stream, a prompt continuing a loaded cache, a memory limit too
    small for the whole prompt's keys and values), each chunk's own last ``window`` queries vote and the cache
    evicts after every chunk. The capacity is split as for ``h2o``: the recent window holds the observation
    window's tokens when ``(1 - heavy_ratio) x capacity >= window``.

    Args:
        window: prompt queries that vote (paper: 32).
        pool: max-pool width over the positions of the step's own tokens, odd (paper and kvpress: 5 to 7).
    """

    summary: ClassVar[str] = "the prompt read whole, then ranked by the attention of its last queries (SnapKV)"
    scorer: ClassVar[str] = "observation_window"

    window: int = 32
    pool: int = 5

    def chunk_scores(self, query, keys, mask, scaling, chunk_size: int, variant=None) -> torch.Tensor:
        """The scores handed by the prompt's reading pass, if any; else the step's last ``window`` queries'
        attention, max-pooled over ``pool`` neighbouring keys."""
        scores = self.handed_scores(keys)
        if scores is not None:
            return scores
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
