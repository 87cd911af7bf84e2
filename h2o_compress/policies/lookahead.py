"""``lookahead``: the context ranked by the attention of the model's own answer to a fixed request about it
(pseudo lookahead queries, Lookahead Q-Cache, Wang et al. 2025, arXiv 2505.20334 §3; SnapKV's pooling, arXiv
2404.14469 §4.2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.policies.base import policy_option
from h2o_compress.policies.context_scored import ContextScoredPolicy

#: The request the model answers before the question is known: generic, asked of every context.
LOOKAHEAD_REQUEST = "List the important facts and numbers in the text above."


@dataclass
class LookaheadPolicy(ContextScoredPolicy):
    """Question-agnostic: before the context is compressed, the model is asked `request` about it and
    answers greedily for `new_tokens` tokens; each context token is scored by the attention it receives
    from those queries (the request's and the answer's, summed over the query heads of each KV group), max-pooled
    over `pool` neighbouring positions so that a kept token comes with its sentence. In a long context the
    request is asked after every `segment` tokens read, and a token keeps its largest score. What the model
    itself names as the document's facts (a pass key, a name, a date) is what stays, whatever the later question;
    decode steps then accumulate attention as ``h2o``.

    Lookahead Q-Cache (arXiv 2505.20334) generates such pseudo queries from the prompt with the question; here
    the request stands in for the question that is not known yet. Costs one prefill of the context plus
    ``new_tokens`` decode steps per request, with eager attention (`h2o_compress.runtime.context_scores.lookahead_scores`).

    In ``generate``, ``batch`` and the lm-eval model the prompt holds its question, and ``lookahead`` is their
    default (`h2o_compress.config.COMMAND_POLICY`): a prompt longer than the capacity is read whole once (in
    prefill chunks, `h2o_compress.runtime.context_scores.read_prompt`), the model answers it for ``new_tokens``
    tokens (its last token's query and the answer's vote: Lookahead Q-Cache's own setting), and the prompt's keys
    and values are ranked into the cache and evicted once; the answer then starts again from the compressed cache,
    its first token the uncompressed model's. Where a prompt is read without that pass (streamed in chunks, a
    prompt continuing a loaded cache, a ``--memory-limit`` too small for the whole prompt, a hybrid model's
    constant states or a model's own cache class), the policy ranks as ``h2o``.

    Args:
        request: what the model is asked about the context; ``None`` (default): `LOOKAHEAD_REQUEST` in
            compress-then-ask, the prompt itself in ``generate`` ([`request_for`][h2o_compress.policies.LookaheadPolicy.request_for]).
        new_tokens: tokens of the model's answer whose queries vote.
        pool: max-pool width over positions, odd.
        segment: context tokens read between two requests (a last piece under half a segment joins the one
            before it, so a 1.5k-token context gets one request, a 4k one four).
    """

    summary: ClassVar[str] = ("scored by the model's own answer first: to a fixed request about a document in ask, to "
                              "the prompt itself in generate (the commands' default)")
    scorer: ClassVar[str] = "lookahead"
    request: str | None = policy_option(None, config_name="lookahead_request", help=(
        f"what the model is asked about a document before it is compressed (default: \"{LOOKAHEAD_REQUEST}\")."))
    new_tokens: int = 32
    pool: int = 7
    segment: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.request is not None and (not isinstance(self.request, str)
                                         or not 1 <= len(self.request.strip()) <= 1000):
            raise ConfigError(f"lookahead_request={short(self.request)} is invalid; allowed: a text of 1 to 1000 "
                              "characters, or None for the default request")
        if self.request is not None:
            try:  # a lone surrogate (invalid UTF-8 on a command line arrives as one) breaks the tokenizer
                self.request.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ConfigError(f"lookahead_request holds a character that is not valid Unicode ({exc.object[exc.start]!r} "
                                  f"at position {exc.start}); allowed: UTF-8 text of 1 to 1000 characters") from None

    def request_for(self, question_in_prompt: bool) -> str | None:
        """The request the scoring pass asks: `request` if given; else ``None`` (the prompt answers itself)
        when the question is in the prompt, `LOOKAHEAD_REQUEST` when it comes after compression."""
        if self.request is not None:
            return self.request
        return None if question_in_prompt else LOOKAHEAD_REQUEST
