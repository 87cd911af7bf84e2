"""Compress-then-ask: a long context compressed once, before any question is known, then asked about any number of
times (the protocol of kvpress's benchmarks: the context is compressed at prefill, questions come after).

:func:`compress` prefills the context through a compressed cache (the budget applies to the context's tokens) and
returns a :class:`CompressedContext`. :func:`ask` answers one question from it: the question goes into a copy of the
compressed cache that keeps every token after the context (nothing more is evicted while answering, as in kvpress),
so every question starts from the same compressed context, which is never changed. A compressed context can be
saved and loaded (:meth:`CompressedContext.save`, :meth:`CompressedContext.load`).

Defaults (:data:`ASK_DEFAULTS`): ``h2o-mean`` (heavy hitters ranked by the mean attention a token received, as
kvpress's ObservedAttention) at budget 0.2 of the context with 90% of it for heavy hitters, 4-bit keys and values:
on this protocol (passkey retrieval with the haystack compressed before the question, SmolLM2-135M, 1,024 tokens,
``benchmarks/ask_defaults.py``, two runs of 15 and 20 prompts) it was right 9 times of 35, against 8 for h2o at
heavy ratio 0.5 and for snapkv 0.9, 3 for h2o 0.9 and 33 for the uncompressed cache (budget 0.2 with 4 bits is
harsh for a single 25-token needle; see ``benchmarks/results/ask_defaults.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .cache import CompressedCache
from .config import CompressionConfig, check_usable
from .errors import CacheStateError, InputError
from .generation import GenerationResult, _check_config, check_prompt, encode_prompt, generate, make_cache
from .models import model_dims
from .prompt_cache import check_context, prefill, shared_prefix_length
from .weights import input_device

ASK_DEFAULTS = CompressionConfig(policy="h2o-mean", budget=0.2, heavy_ratio=0.9, kv_bits=4)
SEPARATOR = "\n\n"  # between the context and a question, in one user turn
REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n"  # KVzip's reconstruction prompt (arXiv 2505.23416 §3.1)
ATTENTION_FLOATS = 2**25  # attention probabilities held at once by the reconstruction pass (128 MiB of fp32)


@torch.inference_mode()
def reconstruction_scores(model, tokenizer, context_ids: torch.Tensor) -> list[torch.Tensor]:
    """KVzip's question-agnostic scores (Kim et al. 2025, arXiv 2505.23416 §3.1-3.2): per layer, fp32 ``[batch,
    kv_heads, context tokens]``, the largest attention each context token receives while the model reads
    "repeat the previous context" and the context again after it (max over those queries and over the query
    heads of each KV group).

    Costs one pass over about twice the context through an uncompressed ``DynamicCache`` with eager attention
    (which returns the probabilities), in chunks sized so that at most :data:`ATTENTION_FLOATS` probabilities
    are held. The model's attention implementation is restored afterwards.

    Args:
        model, tokenizer: the LM (its attention must support transformers' ``eager`` implementation) and its
            tokenizer.
        context_ids: int64 ``[batch, tokens]`` on the model's device.

    Raises:
        ValueError: from transformers, for a model without an ``eager`` attention implementation.
    """
    from transformers import DynamicCache

    batch, tokens = context_ids.shape
    device = context_ids.device
    repeat, body = _reconstruction_prompt(tokenizer, context_ids)
    follow = torch.cat((repeat.to(device).expand(batch, -1), body), dim=1)
    dims = model_dims(model.config)
    q_heads, kv_heads = dims.num_heads, dims.kv_heads
    width = tokens + follow.shape[1]
    chunk = max(1, min(128, ATTENTION_FLOATS // (dims.num_layers * batch * q_heads * width)))
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        cache = DynamicCache(config=model.config)
        model(input_ids=context_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        scores = None
        for start in range(0, follow.shape[1], chunk):
            out = model(input_ids=follow[:, start : start + chunk], past_key_values=cache, use_cache=True,
                        output_attentions=True, logits_to_keep=1)
            parts = [
                attention[..., :tokens].float().view(batch, kv_heads, q_heads // kv_heads, -1, tokens).amax(dim=(2, 3))
                for attention in out.attentions
            ]
            scores = parts if scores is None else [torch.maximum(a, b) for a, b in zip(scores, parts)]
    finally:
        model.set_attn_implementation(previous)
    return scores


def _chat_frame(tokenizer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Token ids ``[n]`` of what the tokenizer's chat template puts before one user message (system prompt, user
    header) and after it (end of the turn, assistant header), or ``None`` without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False
    )
    before, suffix = text.split(separator)
    prefix = before.split(dummy)[0]
    encode = lambda part: tokenizer(part, add_special_tokens=False, return_tensors="pt").input_ids[0]  # noqa: E731
    return encode(prefix), encode(suffix)


def _reconstruction_prompt(tokenizer, context_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(repeat [1, r], body [batch, b])``: the reconstruction pass reads ``repeat`` then ``body``. A context that
    opens with the chat template's user turn (as :func:`compress` encodes it) is repeated as the assistant's
    answer: the request closes the user turn and opens the assistant's, and the body is the context without
    the template's header (KVzip's own prompt, arXiv 2505.23416 §3.1, as kvpress's ``KVzipPress`` builds it).
    Otherwise the request and the whole context follow as plain text."""
    frame = _chat_frame(tokenizer)
    encode = lambda part: tokenizer(part, add_special_tokens=False, return_tensors="pt").input_ids  # noqa: E731
    if frame is not None:
        prefix, suffix = frame
        head = context_ids[:, : prefix.numel()].cpu()
        if 0 < prefix.numel() < context_ids.shape[1] and bool((head == prefix).all()):
            request = torch.cat((encode(REPEAT_PROMPT.rstrip("\n")), suffix.unsqueeze(0)), dim=1)
            return request, context_ids[:, prefix.numel() :]
    return encode(REPEAT_PROMPT), context_ids


def prefill_context(model, tokenizer, context_ids: torch.Tensor, cache: CompressedCache) -> torch.Tensor:
    """Prefill ``context_ids`` ``[batch, tokens]`` into a fresh ``cache``; for ``policy="kvzip"`` first score the
    context by reconstruction (:func:`reconstruction_scores`) and hand each layer its scores. Returns the
    next-token logits ``[batch, vocab]``."""
    if cache.config.policy == "kvzip":
        for layer, scores in zip(cache.layers, reconstruction_scores(model, tokenizer, context_ids)):
            layer.policy.context_scores = scores
    return prefill(model, context_ids, cache)


@dataclass
class CompressedContext:
    """A context prefilled once through a compressed cache, ready for :func:`ask`.

    Attributes:
        cache: the compressed cache holding the context (never changed by :func:`ask`).
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
        """Write the compressed context to ``path`` (see :meth:`CompressedCache.save`; atomic)."""
        return self.cache.save(path, overwrite=overwrite)

    @classmethod
    def load(cls, path, model, tokenizer, text: str, chat: bool = True, config=None) -> "CompressedContext":
        """A compressed context saved by :meth:`save`, for ``model`` and the same context ``text``.

        Raises:
            CacheFileError, CacheStateError: see :func:`h2o_compress.persistence.load_cache`.
            InputError: ``text`` is not the context the file holds.
        """
        cache = CompressedCache.load(path, model, config=config)
        ids = encode_prompt(tokenizer, check_prompt(text), chat)
        held = cache.seen_tokens()
        saved = cache.prompt_state.token_ids
        if ids.shape[1] < held or not torch.equal(ids[:, :held], saved.to(ids.device)):
            raise InputError(
                f"{path} holds a compressed context of {held} tokens that is not the start of the context text given "
                "(a different document, chat template or tokenizer); allowed: the context the file was saved from"
            )
        return cls(cache, text, chat)


@torch.inference_mode()
def compress(model, tokenizer, context: str, config: CompressionConfig | None = None, chat: bool = True) -> CompressedContext:
    """Prefill ``context`` once through a compressed cache; the budget fraction applies to the context's tokens.

    Args:
        model, tokenizer: a transformers causal LM (see :func:`h2o_compress.make_cache`) and its tokenizer.
        context: the document (one user turn with the chat template, up to the end of its text).
        config: the compression setting; default :data:`ASK_DEFAULTS`. ``policy="kvzip"`` first scores the context
            by reconstruction (:func:`reconstruction_scores`: about one extra prefill of twice the context).
        chat: apply the tokenizer's chat template.

    Returns:
        A :class:`CompressedContext` (its cache holds ``capacity`` tokens per layer and KV head at most).

    Raises:
        InputError: empty context, or longer than the model's context window.
        ConfigError: a bad setting, or one that leaves no recent window at this capacity.
    """
    config = ASK_DEFAULTS if config is None else _check_config(config)
    check_prompt(context)
    device = input_device(model)
    ids = encode_prompt(tokenizer, context, chat)[:, : shared_prefix_length(tokenizer, context, chat)].to(device)
    check_context(model, ids.shape[1], 0)
    check_usable(config, config.capacity(ids.shape[1]))
    cache = make_cache(model, config, max_length=ids.shape[1])
    prefill_context(model, tokenizer, ids, cache)
    cache.check()
    return CompressedContext(cache, context, chat)


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
    evicts nothing more (:meth:`CompressedCache.frozen_copy`), so ``context`` is unchanged and can be asked again.

    Returns:
        A :class:`~h2o_compress.generation.GenerationResult` (``prompt_tokens`` = context + question;
        ``kv_bytes`` = the copy at the end of the answer).

    Raises:
        InputError: empty question, or context + question + new tokens beyond the model's window.
        ConfigError: bad ``max_new_tokens``/``temperature``/``seed``.
        CacheStateError: ``context.cache`` holds no compressed context.
    """
    check_prompt(question)
    if not isinstance(context, CompressedContext) or context.cache.seen_tokens() == 0:
        raise CacheStateError("ask() needs a CompressedContext from compress() (or CompressedContext.load())")
    prompt = context.text + SEPARATOR + question
    total = encode_prompt(tokenizer, prompt, context.chat).shape[1]
    check_context(model, total, max_new_tokens)
    answering = context.cache.frozen_copy(total + max_new_tokens)
    return generate(
        model, tokenizer, prompt, max_new_tokens=max_new_tokens, chat=context.chat, temperature=temperature, seed=seed,
        on_text=on_text, cache=answering, compile=compile,
    )
