"""Prefill: bring a cache up to a prompt, feeding only the tokens it does not hold yet, and record the prompt
(token ids, next-token logits) on the cache so a saved cache continues exactly like the live one."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from h2o_compress.models import model_dims
from h2o_compress.models.identity import model_fingerprint, record_model
from h2o_compress.persistence import PromptState
from h2o_compress.utils.checks import check_count, is_integer
from h2o_compress.utils.errors import CacheStateError, InputError
from h2o_compress.utils.progress import report, reporting


def context_window(model) -> int | None:
    """The model's context window in tokens (``config.max_position_embeddings``), ``None`` when it declares none."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if is_integer(limit) and limit > 0 else None


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise InputError when ``prompt_tokens + max_new_tokens`` exceeds the model's ``max_position_embeddings``."""
    limit = context_window(model)
    if limit and prompt_tokens > limit:
        raise InputError(f"prompt of {prompt_tokens} tokens exceeds the model's context of {limit} tokens; allowed: a "
                         "shorter text")
    if limit and prompt_tokens + max_new_tokens > limit:
        raise InputError(
            f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the model's context of "
            f"{limit} tokens; allowed: max_new_tokens at most {limit - prompt_tokens}, or a shorter prompt"
        )


def check_cache_model(cache, model) -> None:
    """Refuse ``cache`` when it was filled by (or made for) another model than ``model``: its recorded
    ``model_fingerprint`` (`model_fingerprint`, set by ``make_cache``,
    ``load_cache`` and `prefill`) differs from the model's. Shapes alone do not tell two models of one
    architecture apart. Reads a few values per parameter: run once per generation, never per token. A cache with no
    fingerprint recorded passes.

    Raises:
        CacheStateError: naming both fingerprints.
    """
    recorded = getattr(cache, "model_fingerprint", None)
    if recorded is None:
        return
    current = model_fingerprint(model)
    if current != recorded:
        raise CacheStateError(
            f"this cache belongs to another model (fingerprint {str(recorded)[:12]}), not this one ({current[:12]}: "
            "same shapes, other weights, dtype or config); allowed: the model that made or filled it, or a new cache "
            "from make_cache(model, ...)"
        )


def prefill(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """Feed the tokens of ``input_ids`` that ``cache`` does not hold yet; return the next-token logits.

    The cache must belong to ``model`` (`check_cache_model`). The tokens are fed by `feed_prompt`: in chunks of
    the cache's ``prefill_chunk_size`` tokens (its config's; one pass for a prompt no longer than that, for ``0``,
    and where a scoring pass handed the layers their scores), the cache scoring and evicting after each chunk;
    ``logits_to_keep=1``. A cache that already holds ``n`` tokens (loaded, or from an earlier prefill) must hold
    the first ``n`` tokens of ``input_ids``; only ``input_ids[:, n:]`` is fed. When it holds the whole prompt, the
    recorded next-token logits are returned without running the model.

    Args:
        model: the causal LM the cache belongs to.
        input_ids: int64 ``[batch, tokens]`` on the model's device.
        cache: a [`CompressedCache`][h2o_compress.cache.CompressedCache] (batch must match).

    Returns:
        Logits ``[batch, vocab]`` (model dtype) of the token after the prompt. Sets ``cache.prompt_state``.

    Raises:
        InputError: the prompt does not start with the tokens the cache holds.
        CacheStateError: the cache belongs to another model, holds tokens whose ids were not recorded, or holds
            the whole prompt without its next-token logits.
    """
    check_cache_model(cache, model)
    return extend_prompt(model, input_ids, cache)


@torch.no_grad()
def extend_prompt(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """`prefill` for a cache trusted to belong to ``model`` (made for it just before, or checked by `prefill`):
    the same arguments, result and errors, less the other-model refusal."""
    held = int(cache.get_seq_length())
    state = getattr(cache, "prompt_state", None)
    if held:
        if not isinstance(state, PromptState) or state.token_ids.shape[1] != held:
            raise CacheStateError(
                f"the cache holds {held} tokens but not their ids, so the prompt cannot be checked against it; "
                "allowed: a fresh cache or one saved after prefill()"
            )
        cached = state.token_ids.to(input_ids.device)
        if input_ids.shape[0] != cached.shape[0] or input_ids.shape[1] < held or not torch.equal(
            input_ids[:, :held], cached
        ):
            raise InputError(
                f"the prompt ({input_ids.shape[1]} tokens) does not start with the {held} tokens the cache holds; "
                "allowed: a prompt that extends the cached one"
            )
    if input_ids.shape[1] > held:
        logits = feed_prompt(model, input_ids[:, held:], cache)
    elif state.next_logits is not None:
        logits = state.next_logits
    else:
        raise CacheStateError(
            "the cache holds the whole prompt but not its next-token logits; allowed: a prompt with more tokens"
        )
    cache.prompt_state = PromptState(input_ids.detach().to("cpu", copy=True), logits.detach().clone())
    if getattr(cache, "model_fingerprint", None) is None:
        record_model(cache, model)
    return logits


#: The fewest tokens per forward pass of a chunked prefill into a cache holding linear-attention, SSM or convolution
#: states (a hybrid model's): the chunk transformers' Mamba-2 scan pads every pass to, so a smaller chunk costs as much
#: as this one per pass, and every state kernel runs a fixed cost per pass.
MIN_STATE_CHUNK = 256


def prefill_step(cache, tokens: int) -> int:
    """Tokens per forward pass when ``tokens`` new tokens are prefilled into ``cache``: its config's
    ``prefill_chunk_size`` (at least `MIN_STATE_CHUNK` where the cache holds a hybrid model's states), or ``tokens``
    (one pass) where that is ``0`` or at least ``tokens``, where the cache has no such config (not a
    [`CompressedCache`][h2o_compress.cache.CompressedCache]), and where a layer holds scores handed for the whole
    prompt by a scoring pass (``kvzip``, ``lookahead``: `pending_context_scores`)."""
    size = getattr(getattr(cache, "config", None), "prefill_chunk_size", 0)
    if size and getattr(cache, "state_layers", None):
        size = max(size, MIN_STATE_CHUNK)
    if not size or size >= tokens or pending_context_scores(cache):
        return max(1, tokens)
    return size


def pending_context_scores(cache) -> bool:
    """Whether a layer of ``cache`` holds context scores (`h2o_compress.runtime.context_scores.hand_context_scores`)
    not yet used: they rank the whole prompt in one multi-token step."""
    return any(getattr(layer.setting.policy, "context_scores", None) is not None
               for layer in getattr(cache, "attention_layers", ()))


@torch.no_grad()
def feed_prompt(model, inputs: torch.Tensor, cache) -> torch.Tensor:
    """Feed ``inputs`` (int64 ``[batch, tokens]``, the tokens after those ``cache`` holds) in chunks of
    `prefill_step` tokens, one forward pass each (``logits_to_keep=1``; `prompt_chunks`): between chunks the cache
    scores and evicts as in streaming, so it holds at most ``capacity + chunk`` tokens per layer and KV head while a
    chunk runs, and the activations grow with the chunk, not the prompt. Inside `layer_progress`, a prompt of
    several chunks is reported as chunks done of all (the stage's name kept), one of one chunk as layers done.

    Returns:
        Logits ``[batch, vocab]`` (model dtype) of the token after ``inputs``.
    """
    tokens = inputs.shape[1]
    chunks = -(-tokens // prefill_step(cache, tokens))
    progress = _PREFILL_PROGRESS.get() if chunks > 1 else None
    if progress is not None:
        progress.chunked = True
        report(progress.stage, 0, chunks)
    logits = None
    for index, (_, logits) in enumerate(prompt_chunks(model, inputs, cache)):
        if progress is not None:
            report(progress.stage, index + 1, chunks)
    return logits


def prompt_chunks(model, inputs: torch.Tensor, cache, chunk: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """The chunks of `feed_prompt`, one forward pass per ``next()``: a caller can run other work between them (the
    batch job decodes its running rows while a new prompt is prefilled: `h2o_compress.runtime.batch`).

    Args:
        model: the causal LM.
        inputs: int64 ``[batch, tokens]``, the tokens after those ``cache`` holds.
        cache: the cache the chunks go into (chunk size: `prefill_step`).
        chunk: tokens per forward pass instead of `prefill_step`'s (a benchmark feeding every cache, a
            transformers one too, in chunks of one size); ``None``: `prefill_step`'s.

    Yields:
        ``(tokens, logits)``: the chunk's token count and the logits ``[batch, vocab]`` (model dtype) of the token
        after it; the last chunk's are the prompt's next-token logits.
    """
    tokens = inputs.shape[1]
    step = chunk or prefill_step(cache, tokens)
    for start in range(0, tokens, step):
        chunk = inputs[:, start : start + step]
        with torch.no_grad():
            logits = model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        yield chunk.shape[1], logits


@torch.no_grad()
def prefill_replicated(model, input_ids: torch.Tensor, cache, batch: int, chunk: int | None = None) -> torch.Tensor:
    """Prefill one prompt and replicate the filled cache to ``batch`` rows: the prompt runs once (in chunks, as
    `prompt_chunks`), then every layer's rows are copied from row 0 (``cache.reorder_cache``), so a batch decode
    starts from ``batch`` identical sequences at the cost of one prefill (a throughput benchmark's batch).

    Args:
        model: the causal LM.
        input_ids: int64 ``[1, tokens]``, the prompt (the cache holds nothing yet).
        cache: an empty cache with ``reorder_cache`` (ours or a transformers ``DynamicCache``/``StaticCache``; not
            a ``QuantizedCache``, whose quantized part is not reordered).
        batch: rows after the replication (>= 1; 1 replicates nothing).
        chunk: tokens per forward pass (``None``: `prefill_step`'s).

    Returns:
        The prompt's next-token logits, ``[batch, vocab]`` (model dtype), the same in every row.

    Raises:
        InputError: ``input_ids`` is not one row.
        ConfigError: ``batch`` is not an integer >= 1.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InputError(f"prefill_replicated takes one prompt, ids of shape [1, tokens], not "
                         f"{tuple(input_ids.shape)}; allowed: one row, replicated to batch rows")
    check_count("batch", batch, unit="rows after the replication", maximum=None)
    logits = None
    for _, logits in prompt_chunks(model, input_ids, cache, chunk):
        pass
    if batch > 1:
        cache.reorder_cache(torch.zeros(batch, dtype=torch.long, device=input_ids.device))
    return logits.expand(batch, -1)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers in order: its first ``ModuleList`` with one entry per hidden layer (LLaMA's
    ``model.layers``, OPT's ``model.decoder.layers``, GPT-NeoX's ``gpt_neox.layers``); empty if none is found."""
    count = model_dims(model.config).num_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    return []


@dataclass
class _PrefillProgress:
    """The stage `layer_progress` reports; ``chunked``: `feed_prompt` reports chunks instead of layers."""

    stage: str
    chunked: bool = False


_PREFILL_PROGRESS: ContextVar[_PrefillProgress | None] = ContextVar("h2o_compress_prefill_progress", default=None)


@contextmanager
def layer_progress(model, stage: str):
    """Report ``stage`` while the prefill inside the block runs, for a progress callback installed with
    `report_progress` (`h2o_compress.utils.progress`); without one nothing is hooked. A prompt fed in one forward
    pass is reported as decoder layers done (of all); one fed in chunks (`feed_prompt`) as chunks done (of all).
    Meant for a prefill, not for decode steps.

    Args:
        model: the causal LM whose forward pass runs inside the block.
        stage: the name the callback receives.
    """
    layers = decoder_layers(model) if reporting() else []
    total = len(layers) or None
    progress = _PrefillProgress(stage)

    def reached(done: int) -> None:  # a forward hook: returns nothing (a value would replace the layer's output)
        if not progress.chunked:
            report(stage, done, total)

    hooks = [layer.register_forward_hook(lambda *_, done=i + 1: reached(done)) for i, layer in enumerate(layers)]
    report(stage, 0, total)
    token = _PREFILL_PROGRESS.set(progress)
    try:
        yield
    finally:
        _PREFILL_PROGRESS.reset(token)
        for hook in hooks:
            hook.remove()
    if total is None and not progress.chunked:  # else the last layer (or chunk) reported the end
        report(stage, 1, 1)
