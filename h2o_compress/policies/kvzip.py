"""``kvzip``: KVzip-style question-agnostic scoring (Kim et al. 2025, arXiv 2505.23416 §3.1-3.2)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .h2o import H2OPolicy


@dataclass
class KVzipPolicy(H2OPolicy):
    """Scores each context token by the largest attention it receives while the model *reconstructs* the context
    (a second pass over a "repeat the previous context" prompt followed by the context again; max over those
    queries and over the query heads of each KV group), so what is kept is what the model needs to restate the
    document, whatever the question; decode steps then accumulate attention as ``h2o``.

    The reconstruction costs about one extra prefill of twice the context (:func:`h2o_compress.ask.compress`
    runs it, with eager attention, before the context's own prefill). Without it (a plain ``generate``), the
    policy ranks as ``h2o``.

    Attributes:
        context_scores: fp32 ``[batch, kv_heads, context tokens]`` of this layer, handed to its next multi-token
            step (the context's prefill) and then dropped.
    """

    context_scores: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def chunk_scores(self, query, keys, mask, scaling, chunk_size: int) -> torch.Tensor:
        """The reconstruction scores of the context, if given for this step; else ``h2o``'s sums."""
        scores, self.context_scores = self.context_scores, None
        if scores is None or scores.shape[-1] != keys.shape[2]:
            return super().chunk_scores(query, keys, mask, scaling, chunk_size)
        return scores.to(device=keys.device, dtype=torch.float32)
