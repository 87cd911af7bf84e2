"""``kvzip``: KVzip-style question-agnostic scoring (Kim et al. 2025, arXiv 2505.23416 §3.1-3.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_compress.policies.context_scored import ContextScoredPolicy


@dataclass
class KVzipPolicy(ContextScoredPolicy):
    """Scores each context token by the largest attention it receives while the model *reconstructs* the context
    (a second pass over a "repeat the previous context" prompt followed by the context again; max over those
    queries and over the query heads of each KV group), so what is kept is what the model needs to restate the
    document, whatever the question; decode steps then accumulate attention as ``h2o``.

    The reconstruction (`h2o_compress.runtime.context_scores.reconstruction_scores`) costs about one extra prefill
    of twice the context, with eager attention, before the context's own prefill (in ``generate``, over the whole
    prompt). Where a prompt is read without that pass (streamed in chunks, a prompt continuing a loaded cache),
    the policy ranks as ``h2o``.
    """

    summary: ClassVar[str] = "scored by reconstructing the prompt or document first (KVzip)"
    scorer: ClassVar[str] = "reconstruction"
