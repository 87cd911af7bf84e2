"""Compress-then-ask: a long context compressed once, before any question is known, then asked about any number of
times (the protocol of kvpress's benchmarks: the context is compressed at prefill, questions come after).

[`compress`][h2o_compress.runtime.ask.compress] prefills the context through a compressed cache (the budget applies to the context's tokens) and
returns a [`CompressedContext`][h2o_compress.runtime.ask.CompressedContext]. [`ask`][h2o_compress.runtime.ask.ask] answers one question from it: the question goes into a copy of the
compressed cache that keeps every token after the context (nothing more is evicted while answering, as in kvpress),
so every question starts from the same compressed context, which is never changed. A compressed context can be
saved and loaded ([`CompressedContext.save`][h2o_compress.runtime.ask.CompressedContext.save], [`CompressedContext.load`][h2o_compress.runtime.ask.CompressedContext.load]).

Defaults ([`ASK_DEFAULTS`][h2o_compress.runtime.ask.ASK_DEFAULTS]): KVzip's own setting. ``kvzip`` (before compressing, each context token is scored
by the attention it gets while the model reconstructs the context: [`KVzipPolicy`][h2o_compress.policies.KVzipPolicy])
with KVzip's allocation: ``layer_budgets="global"`` (each layer sized by its share of the best-scored tokens of the
whole model) and ``head_budgets="adaptive"`` (each layer's budget ranked over its KV heads together), budget 0.2 of
the context, all of it for those tokens (``heavy_ratio=1``: no recent window, which a context that never evicts again
does not need) and the 4 first tokens always kept (``sink_tokens=4``, counted first by the allocation), 4-bit keys
and values. Its passkey accuracy on this protocol (SmolLM2-135M, keep 0.2 + 4 bits, 3 depths x 3 seeds,
``benchmarks/ask_defaults.py``), against heavy ratio 0.9 and the uncompressed cache, is in
``benchmarks/results/ask_defaults.md``; beside kvpress (``benchmarks/compare_peers.py``,
``benchmarks/results/peers_compress_then_ask``) its answer NLL is close to kvpress KVzip's at keeps 0.5 / 0.25
and lower at 0.1, in a small share of its bytes. Its cost: one pass over about twice the context with eager
attention before the compressed prefill.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from h2o_compress.cache import CompressedCache
from h2o_compress.runtime.chat import check_text_fits
from h2o_compress.config import CompressionConfig, check_usable
from h2o_compress.utils.errors import CacheStateError, InputError, UnsupportedModelError, short
from h2o_compress.runtime.generation import (
    GenerationRequest, GenerationResult, _check_argument_kinds, check_config, check_generation_args, check_prompt,
    encode_prompt, make_scored_cache, run_generation,
)
from h2o_compress.utils.checks import check_callback, check_flag
from h2o_compress.persistence import save_cache, load_cache
from h2o_compress.runtime.context_scores import LOOKAHEAD_STAGE, RECONSTRUCTION_STAGE
from h2o_compress.runtime.prefill import check_context, context_window, extend_prompt, layer_progress
from h2o_compress.runtime.prompt_cache import shared_prefix_length
from h2o_compress.models import model_dims
from h2o_compress.models.weights import input_device
from h2o_compress.utils.progress import ProgressFn, report_progress

ASK_DEFAULTS = CompressionConfig(policy="kvzip", budget=0.2, heavy_ratio=1.0, sink_tokens=4, kv_bits=4,
                                 layer_budgets="global", head_budgets="adaptive")
SEPARATOR = "\n\n"  # between the context and a question, in one user turn
PREFILL_STAGE = "compressing the context"
SCORING_STAGES = (RECONSTRUCTION_STAGE, LOOKAHEAD_STAGE)  # the scoring passes' stages (kvzip, lookahead)


@dataclass
class CompressedContext:
    """A context prefilled once through a compressed cache, ready for [`ask`][h2o_compress.runtime.ask.ask].

    Attributes:
        cache: the compressed cache holding the context (never changed by [`ask`][h2o_compress.runtime.ask.ask]).
        text: the context text (a question is appended to it as ``text + "\\n\\n" + question``).
        chat: whether prompts go through the tokenizer's chat template.
        tokens: context tokens the cache has seen (with the chat template: up to the end of the user's text).
    """

    cache: CompressedCache
    text: str
    chat: bool = True

    @property
    def tokens(self) -> int:
        return self.cache.seen_tokens()

    def save(self, path, overwrite: bool = False):
        """Write the compressed context to ``path`` (see [`h2o_compress.persistence.save_cache`][h2o_compress.persistence.save_cache]; atomic)."""
        return save_cache(self.cache, path, overwrite=overwrite)

    @classmethod
    def load(cls, path, model, tokenizer, text: str, chat: bool = True, config=None) -> "CompressedContext":
        """A compressed context saved by [`save`][h2o_compress.runtime.ask.CompressedContext.save], for ``model`` and the same context ``text``.

        Raises:
            CacheFileError, CacheStateError: see [`h2o_compress.persistence.load_cache`][h2o_compress.persistence.load_cache].
            InputError: ``text`` is not the context the file holds.
        """
        cache = load_cache(path, model, config=config)
        ids = encode_prompt(tokenizer, check_prompt(text), chat, context_window(model))
        held = cache.seen_tokens()
        saved = cache.prompt_state.token_ids
        if ids.shape[1] < held or not torch.equal(ids[:, :held], saved.to(ids.device)):
            raise InputError(
                f"{path} holds a compressed context of {held} tokens that is not the start of the context text given "
                "(a different document, chat template or tokenizer); allowed: the context the file was saved from"
            )
        return cls(cache, text, chat)


@torch.inference_mode()
def compress(model, tokenizer, context: str, config: CompressionConfig | None = None, chat: bool = True,
             on_progress: ProgressFn | None = None) -> CompressedContext:
    """Prefill ``context`` once through a compressed cache; the budget fraction applies to the context's tokens.

    Args:
        model: a transformers causal LM (see [`h2o_compress.make_cache`][h2o_compress.make_cache]).
        tokenizer: its tokenizer.
        context: the document (one user turn with the chat template, up to the end of its text).
        config: the compression setting; default [`ASK_DEFAULTS`][h2o_compress.runtime.ask.ASK_DEFAULTS]. ``policy="kvzip"`` (the default) and
            ``policy="lookahead"`` first score the context by their pass
            (`score_context`: about one extra prefill of the context, twice it
            for kvzip).
        chat: apply the tokenizer's chat template.
        on_progress: receives ``(stage, done, total)`` during the scoring pass (`SCORING_STAGES`, once per chunk)
            and the compressed prefill (`PREFILL_STAGE`, once per decoder layer; once per chunk where the context
            is fed in chunks of ``prefill_chunk_size``); ``None``: the callback of an
            enclosing `report_progress` (`h2o_compress.utils.progress`), if any. Nothing is printed.

    Returns:
        A [`CompressedContext`][h2o_compress.runtime.ask.CompressedContext] (its cache holds ``capacity`` tokens per layer and KV head at most).

    Raises:
        InputError: empty context, or longer than the model's context window.
        ConfigError: a bad setting, or one that leaves no recent window at this capacity; ``model`` or
            ``tokenizer`` of the wrong kind, ``chat`` not a bool, ``on_progress`` not callable.
        UnsupportedModelError: a hybrid model (`check_attention_only`), before any pass runs.
    """
    _check_argument_kinds(model, tokenizer, None)
    config = ASK_DEFAULTS if config is None else check_config(config)
    check_prompt(context)
    check_flag("chat", chat)
    check_callback("on_progress", on_progress)
    check_attention_only(model)
    check_text_fits(tokenizer, context, context_window(model), "the context")
    device = input_device(model)
    ids = encode_prompt(tokenizer, context, chat)[:, : context_prefix_length(tokenizer, context, chat)].to(device)
    check_context(model, ids.shape[1], 0)
    check_usable(config, config.capacity(ids.shape[1]), frozen=True)  # the context never evicts again
    with nullcontext() if on_progress is None else report_progress(on_progress):
        cache = make_scored_cache(model, tokenizer, ids, config, ids.shape[1])  # kvzip, lookahead: scored first
        with layer_progress(model, PREFILL_STAGE):
            extend_prompt(model, ids, cache)  # made for this model just above
    cache.check()
    return CompressedContext(cache, context, chat)


def context_prefix_length(tokenizer, context: str, chat: bool = True) -> int:
    """Tokens of ``context`` (as `encode_prompt` gives them) that every question's prompt (``context + SEPARATOR +
    question``) starts with: `shared_prefix_length`, less the last tokens where they merge with the separator (a
    context ending in whitespace, e.g. a file's last newline: ``"\n"`` and ``"\n\n"`` read as one token), found
    as the common prefix with the ids of the context followed by the separator and a question (the held tokens
    must start every prompt, or the question's prefill is refused). At least 1. Tokenizes only."""
    ids = encode_prompt(tokenizer, context, chat)[0]
    shared = shared_prefix_length(tokenizer, context, chat)
    for question in ("Q", "\nQ", " Q"):
        other = encode_prompt(tokenizer, context + SEPARATOR + question, chat)[0]
        n = min(shared, other.shape[0])
        differs = (ids[:n] != other[:n]).nonzero()
        shared = int(differs[0, 0]) if differs.numel() else n
    return max(1, shared)


def check_attention_only(model) -> None:
    """Refuse a hybrid model (a linear-attention, SSM or convolution layer, or one holding such a state beside its
    keys) for compress-then-ask: its states move on with every token, so a compressed context cannot be shared
    between questions. Reads the config only.

    Raises:
        UnsupportedModelError: naming the model type, in one line.
    """
    if any(span.stateful or span.paired for span in model_dims(model.config).spans):
        raise UnsupportedModelError(
            f"compress-then-ask does not support model type {getattr(model.config, 'model_type', '?')!r}: its "
            "linear-attention/SSM/convolution states move on with every token, so one compressed context cannot be "
            "shared between questions; allowed: a model with attention layers only (or generate, with the context "
            "and the question in one prompt)"
        )


@torch.inference_mode()
def ask(
    model,
    tokenizer,
    context: CompressedContext,
    question: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    on_text: Callable[[str], None] | None = None,
    compile: bool | None = None,
) -> GenerationResult:
    """Answer ``question`` from a compressed context: the question and the answer go into a copy of its cache that
    evicts nothing more ([`CompressedCache.frozen_copy`][h2o_compress.cache.CompressedCache.frozen_copy]), so ``context`` is unchanged and can be asked again.

    Returns:
        A [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult] (``prompt_tokens`` = context + question;
        ``kv_bytes`` = the copy at the end of the answer).

    Raises:
        InputError: empty question, or context + question + new tokens beyond the model's window.
        ConfigError: bad ``max_new_tokens``/``temperature``/``seed`` (checked before anything runs), ``model`` or
            ``tokenizer`` of the wrong kind.
        CacheStateError: ``context`` is not a CompressedContext, or its ``cache`` is not a CompressedCache (e.g.
            ``None``) or holds no tokens.
    """
    _check_argument_kinds(model, tokenizer, on_text)
    check_prompt(question)
    check_generation_args(max_new_tokens, temperature, seed)
    _check_held(context)
    request = GenerationRequest(context.cache.config, max_new_tokens, context.chat, temperature, seed, compile)
    return ask_checked(model, tokenizer, context, question, request, on_text)


@torch.inference_mode()
def ask_checked(model, tokenizer, context: CompressedContext, question: str, request: GenerationRequest,
                on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """[`ask`][h2o_compress.runtime.ask.ask] for a validated ``request`` (its ``chat`` the context's; what
    [`AskJob`][h2o_compress.jobs.AskJob] builds when it is made): ``model``, ``tokenizer`` and ``on_text`` of the
    right kind, ``question`` a text (`check_prompt`), ``context`` a CompressedContext holding tokens. What needs
    the question's tokens (the window) is checked here, as ``ask`` checks it; the answer runs in a frozen copy of
    the context's cache.

    Raises:
        InputError: context + question + new tokens beyond the model's window.
    """
    prompt = context.text + SEPARATOR + question
    total = encode_prompt(tokenizer, prompt, context.chat, context_window(model)).shape[1]
    check_context(model, total, request.max_new_tokens)
    answering = context.cache.frozen_copy(total + request.max_new_tokens)
    return run_generation(model, tokenizer, prompt, request, on_text, answering)


def _check_held(context) -> None:
    """Refuse a ``context`` that is not a CompressedContext holding a compressed context.

    Raises:
        CacheStateError: naming what was given.
    """
    if not isinstance(context, CompressedContext):
        raise CacheStateError(f"ask() needs a CompressedContext from compress() (or CompressedContext.load()), not "
                              f"context={short(context)} (a {type(context).__name__})")
    if not isinstance(context.cache, CompressedCache) or context.cache.seen_tokens() == 0:
        raise CacheStateError(f"ask() needs a CompressedContext from compress() (or CompressedContext.load()): "
                              f"context.cache={short(context.cache)} holds no compressed context; allowed: a "
                              "CompressedCache holding at least one token")
