"""Question-agnostic policies whose prefill ranks the context by scores from a separate pass over it."""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from h2o_compress.policies.base import policy_option
from h2o_compress.utils.checks import check_flag
from h2o_compress.policies.h2o import H2OPolicy


@dataclass
class ContextScoredPolicy(H2OPolicy):
    """Base of the compress-then-ask policies (``kvzip``, ``lookahead``): before the context's prefill,
    `h2o_compress.runtime.context_scores.score_context` runs the pass that `scorer` names and hands each
    layer its scores; the prefill keeps the top of them (split by ``heavy_ratio`` as ``h2o``), and decode steps
    then accumulate attention as ``h2o``. Without such scores (a prompt streamed in chunks), the policy ranks as
    ``h2o``.

    Attributes:
        evict_chat_header: the scoring pass gives the chat template's header at the start of the context (system
            prompt, user-turn opening) score 0, so that beyond the sinks it is evicted first (kvpress's
            ``KVzipPress`` scores only the context it reconstructs); ``False``: scored like the rest.
        context_scores: fp32 ``[batch, kv_heads, context tokens]`` of this layer, handed to its next multi-token
            step (the context's prefill) and then dropped.
    """

    evict_chat_header: bool = policy_option(False, help=(
        "score the chat template's header (system prompt, user-turn opening) 0, so that beyond the sinks it is "
        "evicted first (as kvpress's KVzipPress)."))
    context_scores: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Raises ConfigError: ``evict_chat_header`` that is not a bool."""
        check_flag("evict_chat_header", self.evict_chat_header)

    def handed_scores(self, keys: torch.Tensor) -> torch.Tensor | None:
        """The context scores handed for this step (fp32 ``[batch, kv_heads, keys]`` on ``keys``' device), taken
        once; ``None`` when none were handed or they do not cover ``keys`` ``[batch, kv_heads, keys, head_dim]``."""
        scores, self.context_scores = self.context_scores, None
        if scores is None or scores.shape[-1] != keys.shape[2]:
            return None
        return scores.to(device=keys.device, dtype=torch.float32)

    def chunk_scores(self, query, keys, mask, scaling, chunk_size: int, variant=None) -> torch.Tensor:
        """The context scores, if given for this step; else ``h2o``'s sums."""
        scores = self.handed_scores(keys)
        if scores is None:
            return super().chunk_scores(query, keys, mask, scaling, chunk_size, variant)
        return scores
