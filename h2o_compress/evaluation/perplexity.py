"""Streaming perplexity: a text is read through the compressed cache chunk by chunk, so eviction and
quantization act while it is read (H2O, Zhang et al. 2023, arXiv 2306.14048 §5.3 streaming evaluation;
StreamingLLM, Xiao et al. 2024, arXiv 2309.17453 §4.1).

Perplexity is ``exp(mean NLL)`` over the ``tokens - 1`` predicted tokens of the stream: the logits at
position ``t`` are scored against token ``t + 1``. The budget fraction is relative to the stream length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from h2o_compress.config import CompressionConfig
from h2o_compress.utils.errors import InputError
from h2o_compress.runtime.generation import make_cache
from h2o_compress.evaluation.corpus import load_text, tokenize_text
from h2o_compress.runtime.compiled import resolve_compile
from h2o_compress.evaluation.stream import ProgressFn, model_device, read_stream, step_function
from h2o_compress.utils.checks import check_count
from h2o_compress.runtime.prefill import context_window


@dataclass
class PerplexityResult:
    """Figures of one streaming-perplexity run.

    Attributes:
        perplexity: ``exp(nll)``.
        nll: mean negative log-likelihood of the predicted tokens (nats per token).
        tokens: tokens read; ``tokens - 1`` are predicted.
        chunk_size: tokens per forward pass (1 = exact decode semantics).
        capacity: tokens kept per layer and KV head (``None``: unbounded).
        kept_tokens: tokens held by layer 0 at the end.
        kv_bytes: ``cache.nbytes()`` at the end of the stream (bytes).
        kv_bytes_full_fp16: bytes of the uncompressed fp16 cache for the same tokens.
        seconds: wall-clock seconds of the forward passes.
        tokens_per_s: ``tokens / seconds``.
        reference_perplexity: perplexity of the same tokens with the uncompressed cache (``None`` if not run).
        perplexity_ratio: ``perplexity / reference_perplexity`` (``None`` if not run).
        config: the compression setting (``CompressionConfig.to_dict()``).
        kv_bytes_held: bytes of the keys and values held at the end, in the slots holding a token
            (`CompressedCache.held_nbytes`).
        kv_bytes_full: bytes of the uncompressed cache in the model's own dtype for the same tokens
            (`CompressedCache.full_nbytes`): ``kv_bytes_held / kv_bytes_full`` counts like with like.
    """

    perplexity: float
    nll: float
    tokens: int
    chunk_size: int
    capacity: int | None
    kept_tokens: int
    kv_bytes: int
    kv_bytes_full_fp16: int
    seconds: float
    tokens_per_s: float
    config: dict
    reference_perplexity: float | None = None
    perplexity_ratio: float | None = None
    kv_bytes_held: int = 0
    kv_bytes_full: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class NLLAccumulator:
    """Sums the negative log-likelihood of each next token, chunk by chunk, in float64.

    Args:
        input_ids: ``[batch, tokens]`` the whole stream (targets are read from it).
    """

    def __init__(self, input_ids: torch.Tensor):
        self.input_ids = input_ids
        self.total = 0.0
        self.count = 0

    def __call__(self, start: int, logits: torch.Tensor) -> None:
        """Score ``logits`` (``[batch, k, vocab]``, positions ``start .. start + k - 1``) against the next tokens."""
        targets = self.input_ids[:, start + 1 : start + 1 + logits.shape[1]]
        logits = logits[:, : targets.shape[1]]
        if targets.numel() == 0:
            return
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1).to(logits.device), reduction="sum"
        )
        self.total += nll.item()
        self.count += targets.numel()

    @property
    def mean(self) -> float:
        """Mean NLL (nats per predicted token); ``nan`` before any token was scored."""
        return self.total / self.count if self.count else float("nan")


def stream_nll(step: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, chunk_size: int) -> float:
    """Mean next-token NLL (nats) of ``input_ids`` (``[batch, tokens]``) read ``chunk_size`` tokens at a time
    through ``step(chunk [batch, k]) -> logits [batch, k, vocab]`` (any stateful model step)."""
    check_count("chunk_size", chunk_size)
    scorer = NLLAccumulator(input_ids)
    for start in range(0, input_ids.shape[1], chunk_size):
        scorer(start, step(input_ids[:, start : start + chunk_size]))
    return scorer.mean


@torch.inference_mode()
def streaming_perplexity(
    model,
    input_ids: torch.Tensor,
    config: CompressionConfig | None = None,
    chunk_size: int = 1,
    reference: bool = False,
    progress: ProgressFn | None = None,
    compile: bool | None = None,
) -> PerplexityResult:
    """Perplexity of ``input_ids`` (``[1, tokens]``) read through a compressed cache, ``chunk_size`` tokens per pass.

    The cache is built with ``max_length = tokens`` (a budget fraction is relative to the stream). With
    ``reference``, the same tokens are also scored with the uncompressed cache, in one forward pass (exact
    for an uncompressed causal model, whatever the chunking), and the ratio is reported. ``compile`` runs the
    one-token chunks (``chunk_size=1``) through the compiled decode step (``None``: on with CUDA).

    Raises:
        ConfigError: bad ``chunk_size`` or compression setting.
        InputError: fewer than 2 tokens, or more than the model's context.
    """
    config = config or CompressionConfig()
    check_count("chunk_size", chunk_size)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InputError(f"input_ids of shape {tuple(input_ids.shape)}; allowed: [1, tokens]")
    tokens = input_ids.shape[1]
    if tokens < 2:
        raise InputError(f"a stream of {tokens} token(s); allowed: at least 2 tokens")
    limit = context_window(model)
    if limit and tokens > limit:
        raise InputError(f"a stream of {tokens} tokens exceeds the model's context of {limit} tokens; allowed: at "
                         f"most {limit} tokens")
    input_ids = input_ids.to(model_device(model))
    cache = make_cache(model, config, max_length=tokens)
    step = step_function(model, resolve_compile(compile, cache, input_ids.device, model))
    scorer = NLLAccumulator(input_ids)
    _, seconds = read_stream(model, cache, input_ids, chunk_size, on_logits=scorer, progress=progress, decoder=step)
    result = PerplexityResult(
        perplexity=math.exp(scorer.mean),
        nll=scorer.mean,
        tokens=tokens,
        chunk_size=chunk_size,
        capacity=cache.capacity,
        kept_tokens=cache.kept_length(),
        kv_bytes=cache.nbytes(),
        kv_bytes_full_fp16=cache.full_fp16_nbytes(),
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        config=config.to_dict(),
        kv_bytes_held=cache.held_nbytes(),
        kv_bytes_full=cache.full_nbytes(),
    )
    if reference:
        result.reference_perplexity = reference_perplexity(model, input_ids)
        result.perplexity_ratio = result.perplexity / result.reference_perplexity
    return result


@torch.inference_mode()
def reference_perplexity(model, input_ids: torch.Tensor) -> float:
    """Perplexity of ``input_ids`` (``[1, tokens]``) with the uncompressed cache, read in one forward pass."""
    input_ids = input_ids.to(model_device(model))
    cache = make_cache(model, CompressionConfig(policy="full"), max_length=input_ids.shape[1])
    scorer = NLLAccumulator(input_ids)
    read_stream(model, cache, input_ids, None, on_logits=scorer)
    return math.exp(scorer.mean)


def text_perplexity(model, tokenizer, text_file: str | None = None, max_tokens: int = 512,
                    config: CompressionConfig | None = None, chunk_size: int = 1, reference: bool = True,
                    progress: ProgressFn | None = None, compile: bool | None = None) -> PerplexityResult:
    """[`streaming_perplexity`][h2o_compress.evaluation.streaming_perplexity] of the first ``max_tokens`` tokens of ``text_file`` (default: the shipped
    corpus). A shorter text is read whole (``result.tokens`` says how many tokens were read).

    Raises:
        ConfigError: bad ``max_tokens``/``chunk_size`` or compression setting.
        InputError: unreadable or too short text, or a stream longer than the model's context.
    """
    check_count("max_tokens", max_tokens, minimum=2)
    input_ids = tokenize_text(tokenizer, load_text(text_file), max_tokens)
    limit = context_window(model)
    if limit and input_ids.shape[1] > limit:
        raise InputError(f"max_tokens={max_tokens} reads {input_ids.shape[1]} tokens of the text, more than the model's "
                         f"context of {limit} tokens; allowed: max_tokens at most {limit}")
    return streaming_perplexity(
        model, input_ids, config, chunk_size, reference=reference, progress=progress, compile=compile
    )
