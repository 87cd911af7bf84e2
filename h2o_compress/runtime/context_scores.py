"""Question-agnostic context scores for compress-then-ask: a separate pass over the context, before its compressed
prefill, whose attention ranks the context's tokens (``kvzip``: the model reconstructs the context; ``lookahead``:
the model answers a fixed request about it). `score_context` runs the pass a policy names."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from h2o_compress.runtime.chat import apply_chat_template
from h2o_compress.config import fit_to_total
from h2o_compress.models import model_dims
from h2o_compress.utils.progress import report

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"  # KVzip's reconstruction prompt (arXiv 2505.23416 §3.1)
RECONSTRUCTION_STAGE = "scoring the context (kvzip)"
LOOKAHEAD_STAGE = "scoring the context (lookahead)"
ATTENTION_FLOATS = 2**25  # attention probabilities held at once by the reconstruction pass (128 MiB of fp32)


@contextmanager
def _attention(model, implementation: str):
    """The model runs transformers' ``implementation`` attention inside the block (``"eager"`` returns the
    probabilities; ``"sdpa"`` reads the context without materializing them); its own implementation is restored
    after it."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _full_cache():
    """An uncompressed ``DynamicCache`` whose every layer keeps every token (``DynamicLayer``), also where the model
    has sliding or chunked layers: the model masks each layer to its span itself, so outputs are those of
    ``DynamicCache(config=...)``, and the probabilities a pass returns cover every context token, one column per
    position (a sliding layer's ``DynamicSlidingWindowLayer`` would return only its window's, and cannot crop)."""
    from transformers import DynamicCache

    return DynamicCache()


def _read_context(model, context_ids: torch.Tensor, cache=None):
    """``cache`` (default: a new `_full_cache`) after reading ``context_ids`` ``[batch, tokens]`` into it, with
    SDPA where the model has it (no probabilities materialized), else eager attention."""
    cache = _full_cache() if cache is None else cache
    with _attention(model, "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"):
        model(input_ids=context_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def _group_attention(attentions, batch: int, kv_heads: int, tokens: int, reduce: str) -> list[torch.Tensor]:
    """Per layer, fp32 ``[batch, kv_heads, tokens]``: the probabilities ``[batch, q_heads, queries, keys]`` the
    queries give the first ``tokens`` keys (0 for those beyond ``keys``: a query that came before them), reduced
    (``"max"`` or ``"sum"``) over the queries and the query heads of each KV group."""
    out = []
    for attention in attentions:
        attention = F.pad(attention[..., :tokens], (0, max(0, tokens - attention.shape[-1])))
        grouped = attention.float().view(batch, kv_heads, -1, attention.shape[2], tokens)
        out.append(grouped.amax(dim=(2, 3)) if reduce == "max" else grouped.sum(dim=(2, 3)))
    return out


@torch.inference_mode()
def reconstruction_scores(model, tokenizer, context_ids: torch.Tensor) -> list[torch.Tensor]:
    """KVzip's question-agnostic scores (Kim et al. 2025, arXiv 2505.23416 §3.1-3.2): per layer, fp32 ``[batch,
    kv_heads, context tokens]``, the largest attention each context token receives while the model reads
    "repeat the previous context" and the context again after it (max over those queries and over the query
    heads of each KV group).

    Costs one pass over about twice the context through an uncompressed ``DynamicCache``: the context read with
    SDPA (where the model has it), then the request and the repeated context with eager attention (which returns the probabilities), in
    chunks sized so that at most `ATTENTION_FLOATS` probabilities
    are held. The model's attention implementation is restored afterwards. Its progress (tokens read of the
    whole pass, once per chunk) goes to the callback of `report_progress` (`h2o_compress.utils.progress`), if one
    is installed, as `RECONSTRUCTION_STAGE`.

    Args:
        model: the LM (its attention must support transformers' ``eager`` implementation).
        tokenizer: its tokenizer.
        context_ids: int64 ``[batch, tokens]`` on the model's device.

    Raises:
        ValueError: from transformers, for a model without an ``eager`` attention implementation.
    """
    batch, tokens = context_ids.shape
    repeat, body = _reconstruction_prompt(tokenizer, context_ids)
    follow = torch.cat((repeat.to(context_ids.device).expand(batch, -1), body), dim=1)
    dims = model_dims(model.config)
    width = tokens + follow.shape[1]
    chunk = max(1, min(128, ATTENTION_FLOATS // (dims.num_layers * batch * dims.num_heads * width)))
    report(RECONSTRUCTION_STAGE, 0, width)
    cache = _read_context(model, context_ids)
    scores = None
    with _attention(model, "eager"):
        for start in range(0, follow.shape[1], chunk):
            report(RECONSTRUCTION_STAGE, tokens + start, width)  # once per chunk (at most 128 tokens)
            out = model(input_ids=follow[:, start : start + chunk], past_key_values=cache, use_cache=True,
                        output_attentions=True, logits_to_keep=1)
            parts = _group_attention(out.attentions, batch, dims.kv_heads, tokens, "max")
            scores = parts if scores is None else [torch.maximum(a, b) for a, b in zip(scores, parts)]
    report(RECONSTRUCTION_STAGE, width, width)
    return scores


def segment_ends(tokens: int, segment: int) -> list[int]:
    """Where `lookahead_scores` asks its request: after every ``segment`` tokens and at the end, a last
    piece shorter than half a segment joined to the one before (``tokens=4096, segment=1024``: ``[1024, 2048,
    3072, 4096]``; ``1500, 1024``: ``[1500]``)."""
    ends = list(range(segment, tokens, segment)) + [tokens]
    if len(ends) > 1 and tokens - ends[-2] < segment / 2:
        del ends[-2]
    return ends


@torch.inference_mode()
def _answer_votes(model, cache, step: torch.Tensor, new_tokens: int, kv_heads: int, end: int) -> list[torch.Tensor]:
    """Per layer, fp32 ``[batch, kv_heads, end]``: the attention the first ``end`` cached tokens receive from the
    queries of ``new_tokens`` greedy steps (eager attention) that start by feeding ``step`` ``[batch, n]``, summed
    over the steps and each KV group's query heads. The steps stay in ``cache`` (the caller crops them)."""
    votes = None
    with _attention(model, "eager"):
        for _ in range(new_tokens):
            out = model(input_ids=step, past_key_values=cache, use_cache=True, output_attentions=True,
                        logits_to_keep=1)
            parts = _group_attention(out.attentions, step.shape[0], kv_heads, end, "sum")
            votes = parts if votes is None else [a + b for a, b in zip(votes, parts)]
            step = out.logits[:, -1:].argmax(-1)
    return votes


def _keep_best(scores: list[torch.Tensor], votes: list[torch.Tensor], pool: int, end: int) -> None:
    """In place: each layer's ``scores`` ``[batch, kv_heads, tokens]`` keep, over their first ``end`` tokens, the
    larger of themselves and that layer's ``votes`` ``[batch, kv_heads, end]`` max-pooled over ``pool`` positions."""
    for layer_scores, layer_votes in zip(scores, votes):
        if pool > 1:
            layer_votes = F.max_pool1d(layer_votes.reshape(-1, 1, end), pool, stride=1, padding=pool // 2)
        layer_votes = layer_votes.view(*layer_scores.shape[:2], end)
        layer_scores[..., :end] = torch.maximum(layer_scores[..., :end], layer_votes)


def lookahead_scores(model, tokenizer, context_ids: torch.Tensor, request: str | None, new_tokens: int = 32,
                     pool: int = 7, segment: int = 1024) -> list[torch.Tensor]:
    """Pseudo lookahead queries (Lookahead Q-Cache, Wang et al. 2025, arXiv 2505.20334 §3): per layer, fp32
    ``[batch, kv_heads, context tokens]``, the attention each context token receives while the model reads
    ``request`` and answers it greedily for ``new_tokens`` tokens (summed over those queries and the query heads
    of each KV group, max-pooled over ``pool`` neighbouring positions as SnapKV does, arXiv 2404.14469 §4.2).

    The request is asked after every ``segment`` tokens of the context and at its end (`segment_ends`; the
    request and answer are then dropped from the cache and the reading goes on), and a token keeps the largest
    score any request gave it: a small model that overlooks a fact in a long document still names it right after
    reading it (KVzip likewise scores long contexts chunk by chunk, arXiv 2505.23416 §3.2). A context that opens
    with the chat template's user turn gets the request at the end of that turn and the answer as the assistant's,
    as `reconstruction_scores` asks for the reconstruction.

    Costs one prefill of the context (SDPA) plus ``new_tokens`` decode steps with eager attention per request,
    through an uncompressed ``DynamicCache``; the model's attention implementation is restored afterwards.
    Progress (context tokens read, once per request) goes to an installed `report_progress` callback as
    `LOOKAHEAD_STAGE`.

    Args:
        model: the LM (eager attention).
        tokenizer: its tokenizer.
        context_ids: int64 ``[batch, tokens]`` on the model's device.
        request: the text the model answers (e.g. `h2o_compress.policies.lookahead.LOOKAHEAD_REQUEST`);
            ``None``: ``context_ids`` is a whole prompt, question included, and the model answers it as it
            stands (its last token gives the first answer query), once, after the whole prompt.
        new_tokens: answer tokens whose queries vote (>= 1).
        pool: odd max-pool width (1: no pooling).
        segment: context tokens read between two requests (>= 1).

    Raises:
        ValueError: from transformers, for a model without an ``eager`` attention implementation.
    """
    batch, tokens = context_ids.shape
    dims = model_dims(model.config)
    if request is None:  # the prompt holds its question: its last token opens the answer, once, at the end
        ends, asked = [tokens], None
    else:
        ends = segment_ends(tokens, segment)
        asked, _ = _request_prompt(tokenizer, context_ids, "\n\n" + request + "\n")
        asked = asked.to(context_ids.device).expand(batch, -1)
    scores = [torch.zeros(batch, dims.kv_heads, tokens, device=context_ids.device) for _ in range(dims.num_layers)]
    cache, start = None, 0
    for end in ends:
        report(LOOKAHEAD_STAGE, start, tokens)  # once per request
        read_to = end if asked is not None else end - 1
        if read_to > start:
            cache = _read_context(model, context_ids[:, start:read_to], cache)
        elif cache is None:  # a one-token prompt
            cache = _full_cache()
        first = asked if asked is not None else context_ids[:, read_to:end]
        votes = _answer_votes(model, cache, first, new_tokens, dims.kv_heads, end)
        cache.crop(end - cache.get_seq_length())  # drop the request and the answer (a negative count)
        _keep_best(scores, votes, pool, end)
        start = end
    report(LOOKAHEAD_STAGE, tokens, tokens)
    return scores


READ_STAGE = "reading the prompt (snapkv)"


@dataclass
class ReadPrompt:
    """A prompt read whole by `read_prompt`.

    Attributes:
        cache: the uncompressed ``DynamicCache`` holding every token's keys and values (`_full_cache`).
        logits: ``[batch, vocab]`` (model dtype), the next-token logits after the prompt.
        scores: per layer, fp32 ``[batch, kv_heads, tokens]``: the observation window's votes.
    """

    cache: object
    logits: torch.Tensor
    scores: list[torch.Tensor]


@torch.inference_mode()
def read_prompt(model, context_ids: torch.Tensor, window: int = 32, pool: int = 5, chunk: int = 512,
                answer_tokens: int = 0) -> ReadPrompt:
    """A prompt ``context_ids`` ``[batch, tokens]`` read whole into an uncompressed ``DynamicCache`` and its tokens
    ranked by the attention of its end: its first ``tokens - window`` tokens with SDPA in chunks of ``chunk``
    tokens (the activations grow with the chunk, not the prompt), its last ``window`` tokens (SnapKV's observation
    window, Li et al. 2024, arXiv 2404.14469 §4.2: a question at the end of the prompt) with eager attention, whose
    probabilities vote for every prompt token, and then ``answer_tokens`` greedy steps of the model's own answer
    whose queries vote too (Lookahead Q-Cache's pseudo queries, Wang et al. 2025, arXiv 2505.20334 §3; the answer
    is dropped from the cache afterwards). Votes are summed over those queries and the query heads of each KV
    group, then max-pooled over ``pool`` neighbouring positions. The window is fed in pieces so that at most
    `ATTENTION_FLOATS` probabilities are held. The model's attention implementation is restored afterwards;
    progress (tokens read) goes to an installed `report_progress` callback as `READ_STAGE`.

    Costs one prefill of the prompt (its attention over the whole prompt) and ``answer_tokens`` decode steps, and
    holds the prompt's keys and values uncompressed until the caller has ranked them into the compressed cache.

    Raises:
        ValueError: from transformers, for a model without an ``eager`` attention implementation.
    """
    batch, tokens = context_ids.shape
    dims = model_dims(model.config)
    window = max(1, min(window, tokens))
    cache, chunk = _full_cache(), max(1, chunk)
    for start in range(0, tokens - window, chunk):
        report(READ_STAGE, start, tokens)
        _read_context(model, context_ids[:, start : min(start + chunk, tokens - window)], cache)
    piece = max(1, min(window, ATTENTION_FLOATS // (dims.num_layers * batch * dims.num_heads * tokens)))
    votes, logits = None, None
    with _attention(model, "eager"):
        for first in range(tokens - window, tokens, piece):
            report(READ_STAGE, first, tokens)
            out = model(input_ids=context_ids[:, first : min(first + piece, tokens)], past_key_values=cache,
                        use_cache=True, output_attentions=True, logits_to_keep=1)
            parts = _group_attention(out.attentions, batch, dims.kv_heads, tokens, "sum")
            votes = parts if votes is None else [a + b for a, b in zip(votes, parts)]
            logits = out.logits[:, -1]
        if answer_tokens:
            answer = _answer_votes(model, cache, logits[:, None].argmax(-1), answer_tokens, dims.kv_heads, tokens)
            votes = [a + b for a, b in zip(votes, answer)]
            cache.crop(tokens - cache.get_seq_length())  # a negative count: the answer's tokens
    if pool > 1:
        votes = [F.max_pool1d(v.reshape(-1, 1, tokens), pool, stride=1, padding=pool // 2).view_as(v) for v in votes]
    report(READ_STAGE, tokens, tokens)
    return ReadPrompt(cache, logits, votes)


#: The scoring passes by the name a policy gives as its ``scorer``: ``(model, tokenizer, context_ids, policy,
#: question_in_prompt) ->`` per layer ``[batch, kv_heads, tokens]``.
SCORERS = {
    "reconstruction": lambda model, tokenizer, ids, policy, question_in_prompt: reconstruction_scores(
        model, tokenizer, ids),
    "lookahead": lambda model, tokenizer, ids, policy, question_in_prompt: lookahead_scores(
        model, tokenizer, ids, policy.request_for(question_in_prompt), policy.new_tokens, policy.pool, policy.segment),
    "observation_window": lambda model, tokenizer, ids, policy, question_in_prompt: read_prompt(
        model, ids, policy.window, policy.pool).scores,
}


def score_context(model, tokenizer, context_ids: torch.Tensor, policy,
                  question_in_prompt: bool = False) -> list[torch.Tensor] | None:
    """The scores of ``policy``'s pass (its ``scorer``, a key of `SCORERS`), per layer ``[batch, kv_heads,
    tokens]``, or ``None`` for a policy that ranks without one; with ``policy.evict_chat_header``, 0 over the chat
    template's header (`chat_header_length`). ``question_in_prompt``: ``context_ids`` is a whole
    prompt, question included (``generate``), rather than a document whose questions come later (``ask``)."""
    scorer = SCORERS.get(getattr(policy, "scorer", ""))
    if scorer is None:
        return None
    return without_header(tokenizer, context_ids, scorer(model, tokenizer, context_ids, policy, question_in_prompt),
                          policy)


def without_header(tokenizer, context_ids: torch.Tensor, scores: list[torch.Tensor], policy) -> list[torch.Tensor]:
    """``scores`` (per layer ``[batch, kv_heads, tokens]``), with 0 over the chat template's header
    (`chat_header_length`) where ``policy.evict_chat_header`` says so: evicted first, beyond the sinks (which
    rank above every score)."""
    header = chat_header_length(tokenizer, context_ids) if getattr(policy, "evict_chat_header", False) else 0
    if header:
        index = torch.arange(header, device=context_ids.device)
        scores = [layer.index_fill(-1, index, 0.0) for layer in scores]
    return scores


def chat_header_length(tokenizer, context_ids: torch.Tensor) -> int:
    """Tokens of the chat template's header (system prompt, user-turn opening) that ``context_ids`` ``[batch,
    tokens]`` opens with, or 0 (no chat template, or a context that does not open with it)."""
    return _header_length(_chat_frame(tokenizer), context_ids)


def _header_length(frame: tuple[torch.Tensor, torch.Tensor] | None, context_ids: torch.Tensor) -> int:
    """How many tokens of ``context_ids`` ``[batch, tokens]`` are the header of ``frame`` (`_chat_frame`):
    its prefix, where every sequence opens with it and something follows; else 0."""
    if frame is None:
        return 0
    prefix = frame[0]
    head = context_ids[:, : prefix.numel()].cpu()
    if 0 < prefix.numel() < context_ids.shape[1] and bool((head == prefix).all()):
        return prefix.numel()
    return 0


def hand_context_scores(model, tokenizer, context_ids: torch.Tensor, cache, question_in_prompt: bool = False,
                        scores: list[torch.Tensor] | None = None) -> None:
    """Before ``context_ids`` ``[batch, tokens]`` is prefilled into the empty compressed ``cache``: run its policy's
    scoring pass (`score_context`, nothing for a policy without one; ``scores``: already run) and hand each
    layer its scores, which that prefill then ranks by."""
    layers = getattr(cache, "attention_layers", cache.layers)  # a hybrid's state layers have no scores
    if scores is None:
        policy = getattr(getattr(layers[0], "setting", None), "policy", None) if layers else None
        scores = score_context(model, tokenizer, context_ids, policy, question_in_prompt)
    for layer, layer_scores in zip(layers, scores or ()):
        layer.setting.policy.context_scores = layer_scores


def global_layer_capacities(scores: list[torch.Tensor], capacity: int, floor: int = 1,
                            ceiling: int | None = None, sinks: int = 0) -> list[int]:
    """Each layer's capacity (tokens per KV head) under one ranking over the whole model (KVzip's non-uniform
    allocation, Kim et al. 2025, arXiv 2505.23416 §3.3; kvpress's ``KVzipPress(layerwise=False)``): of every
    sequence's ``num_layers x kv_heads x capacity`` best-scored (layer, head, token) entries, layer ``l`` holds a
    share ``n_l``; its capacity is ``n_l / kv_heads`` averaged over the batch, rounded so that the capacities sum
    to exactly ``num_layers x capacity`` (the bytes of the uniform split) and stay within ``[floor, ceiling]``.

    Args:
        scores: per layer, ``[batch, kv_heads, tokens]`` (comparable across layers: attention probabilities).
        capacity: the uniform per-layer capacity whose total is spread (>= 1).
        floor: the smallest capacity a layer may get (one that leaves a recent window), clipped to ``capacity``.
        ceiling: the largest (default: ``tokens``).
        sinks: the first ``sinks`` tokens, which every layer keeps whatever their score (attention sinks), rank
            above all others (as kvpress's ``KVzipPress`` gives its ``n_sink`` tokens the highest score).

    Returns:
        ``num_layers`` ints summing to ``num_layers x capacity`` (when the bounds allow it).
    """
    stacked = torch.stack([layer.float() for layer in scores])  # [layers, batch, kv_heads, tokens]
    if sinks:
        stacked[..., :sinks] = float("inf")
    layers, batch, heads, tokens = stacked.shape
    floor, ceiling = min(floor, capacity), max(ceiling or tokens, capacity)
    per_sequence = stacked.permute(1, 0, 2, 3).reshape(batch, -1)
    top = per_sequence.topk(min(per_sequence.shape[1], layers * heads * capacity), dim=1).indices
    share = torch.bincount((top // (heads * tokens)).flatten(), minlength=layers).double() / (batch * heads)
    caps = share.floor().clamp(floor, ceiling).long().tolist()
    remainder = (share - share.floor()).tolist()
    gaining = layers * capacity > sum(caps)  # the largest remainders gain first, the smallest lose first
    order = sorted(range(layers), key=lambda layer: -remainder[layer] if gaining else remainder[layer])
    return fit_to_total(caps, layers * capacity, floor, ceiling, order)


def _chat_frame(tokenizer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Token ids ``[n]`` of what the tokenizer's chat template puts before one user message (system prompt, user
    header) and after it (end of the turn, assistant header), or ``None`` without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = apply_chat_template(
        tokenizer, [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False
    )
    before, suffix = text.split(separator)
    prefix = before.split(dummy)[0]
    encode = lambda part: tokenizer(part, add_special_tokens=False, return_tensors="pt").input_ids[0]  # noqa: E731
    return encode(prefix), encode(suffix)


def _request_prompt(tokenizer, context_ids: torch.Tensor, request: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(asked [1, r], body [batch, b])``: ``request`` as read after the context, and the context without the
    chat template's header. A context that opens with the template's user turn (as
    [`h2o_compress.runtime.ask.compress`][h2o_compress.runtime.ask.compress] encodes it) gets the request at the end of that turn, then the end of the
    turn and the assistant's header; otherwise the request follows as plain text and the body is the whole
    context."""
    frame = _chat_frame(tokenizer)
    encode = lambda part: tokenizer(part, add_special_tokens=False, return_tensors="pt").input_ids  # noqa: E731
    header = _header_length(frame, context_ids)
    if header:
        return torch.cat((encode(request.rstrip("\n")), frame[1].unsqueeze(0)), dim=1), context_ids[:, header:]
    return encode(request), context_ids


def _reconstruction_prompt(tokenizer, context_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(repeat [1, r], body [batch, b])``: the reconstruction pass reads ``repeat`` then ``body``: the context
    repeated as the assistant's answer when it opens with the chat template's user turn (KVzip's own prompt,
    arXiv 2505.23416 §3.1, as kvpress's ``KVzipPress`` builds it), else after the request as plain text."""
    return _request_prompt(tokenizer, context_ids, REPEAT_PROMPT)
