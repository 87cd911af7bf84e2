"""Reading a token stream through a compressed cache, chunk by chunk, and greedy continuation.

Shared by the perplexity, needle and profile measurements. Reading ``chunk_size`` tokens per forward pass:
``1`` is exact decode semantics (every token attends only to the kept, possibly quantized, cache); a larger
chunk is faster, but tokens of one chunk attend to each other in full precision and eviction runs only after
each chunk (the cache briefly holds ``capacity + chunk`` tokens), so quality comes out slightly optimistic.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

import torch

from h2o_compress.runtime.compiled import compiled_decode_step, decode_one, decode_step
from h2o_compress.runtime.decode_loop import decode, sampler, sync
from h2o_compress.runtime.prefill import prefill_step
from h2o_compress.utils.checks import check_count
from h2o_compress.models.weights import input_device

ProgressFn = Callable[[int, int], None]
"""``progress(done, total)``: called after each chunk with tokens read so far and tokens to read."""


def model_device(model) -> torch.device:
    """Where the model takes its inputs (its input embeddings' execution device; see
    `h2o_compress.models.weights.input_device`)."""
    return input_device(model)


def _accepts_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_chunk(model, cache, chunk: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    """One forward pass of ``chunk`` (``[batch, k]`` token ids) through ``cache``.

    Returns logits ``[batch, k, vocab]``, or ``[batch, 1, vocab]`` for the last position when ``last_only``
    (the vocabulary projection of the other positions is then skipped where the model allows it).
    """
    kwargs = {}
    if last_only and _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1
    logits = model(input_ids=chunk, past_key_values=cache, use_cache=True, **kwargs).logits
    return logits[:, -1:] if last_only else logits


def step_function(model, compile: bool):
    """The decode step to use: `compiled_decode_step` when ``compile`` (the cache must
    be compileable: `resolve_compile` checks), else the eager
    `decode_step`."""
    return compiled_decode_step(model) if compile else decode_step


def read_stream(
    model,
    cache,
    input_ids: torch.Tensor,
    chunk_size: int | None = None,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
    progress: ProgressFn | None = None,
    decoder=None,
) -> tuple[torch.Tensor, float]:
    """Feed ``input_ids`` (``[batch, tokens]``) through ``cache`` in chunks of ``chunk_size`` tokens.

    Args:
        chunk_size: tokens per forward pass; ``None`` reads it as a prefill does
            (`h2o_compress.runtime.prefill.prefill_step`: chunks of the cache's ``prefill_chunk_size``, one pass
            for a text no longer than that).
        on_logits: ``on_logits(start, logits)`` receives each chunk's logits ``[batch, k, vocab]`` (position
            ``start + i`` predicts token ``start + i + 1``); without it only the last position is projected.
        progress: see `ProgressFn`.
        decoder: a decode step function (`step_function`) for one-token chunks after the first; ``None``: a
            plain forward pass.

    Returns:
        ``(last_logits [batch, vocab], seconds)``: logits after the last token, and the wall-clock seconds of
        the forward passes (CUDA synchronised; ``on_logits`` time excluded).
    """
    total = input_ids.shape[1]
    step = prefill_step(cache, total) if chunk_size is None else check_count("chunk_size", chunk_size)
    device = input_ids.device
    held = int(cache.get_seq_length())  # tokens the cache saw before (a compressed context being asked)
    seconds = 0.0
    last = None
    for start in range(0, total, step):
        chunk = input_ids[:, start : start + step]
        sync(device)
        began = time.perf_counter()
        if decoder is not None and chunk.shape[1] == 1 and held + start > 0:
            logits = decode_one(decoder, model, cache, chunk, held + start)[:, None]
        else:
            logits = forward_chunk(model, cache, chunk, last_only=on_logits is None)
        sync(device)
        seconds += time.perf_counter() - began
        if on_logits is not None:
            on_logits(start, logits)
        last = logits[:, -1]
        if progress is not None:
            progress(min(start + step, total), total)
    return last, seconds


def greedy_decode(model, cache, logits: torch.Tensor, steps: int, stop_ids: set[int] = frozenset(), step=None,
                  untimed: int = 0):
    """Greedy tokens from ``logits`` (``[batch=1, vocab]``, after the prompt), ``steps`` tokens at most.

    The first token comes from ``logits``; each further one costs one forward pass through ``cache``. Stops
    after a token in ``stop_ids``. ``step``: the decode step function (`step_function`; default eager).
    ``untimed``: decode passes left out of the seconds, the first ones (a compiled step's warm-up,
    `h2o_compress.runtime.compiled.warmup_steps`).

    Returns:
        ``(token_ids, decode_seconds)``: the new ids and the seconds of the ``len(ids) - 1`` decode passes after
        the first ``untimed``.
    """
    step = decode_step if step is None else step
    pick = sampler(0.0, None, logits.device)
    ids, seconds, _ = decode(step, model, cache, pick(logits), int(cache.get_seq_length()), pick, stop_ids, steps,
                             untimed=untimed, device=logits.device)
    return ids, seconds
