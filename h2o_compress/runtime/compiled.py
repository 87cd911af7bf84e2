"""The decode step as one function, and its ``torch.compile`` form (DESIGN.md §5).

A decode step feeds one token per sequence through the model with the compressed cache. Every cache layer's
part of it is static-shape code over fixed buffers ([`h2o_compress.cache`][h2o_compress.cache]), so
``torch.compile(fullgraph=True)`` captures the whole step with no graph break. A compressed cache's decode step
takes no attention mask (which tokens are held comes from the cache's slots), so every step has the same input
shapes and no size enters the graph as a number: one graph serves every step, and on CUDA one CUDA graph is recorded
and replayed. (Inductor's CUDA-graph trees record a new graph for each value of a symbolic size: a growing 2D mask
marked dynamic would cost a recording per token.)

The compiled step is built with two Inductor options that make its arithmetic round as eager PyTorch does
(``emulate_precision_casts``, ``eager_numerics.division_rounding``): quantization rounds to integers, so a
compiled step that fused a cast or a division differently would flip a few codes and drift from eager by
``1e-3``; with them the compiled and eager steps agree to float reassociation (``~1e-6``).
"""

from __future__ import annotations

import torch

from h2o_compress.cache import CompressedCache
from h2o_compress.formats import eager_only_formats
from h2o_compress.utils.checks import check_flag
from h2o_compress.utils.errors import ConfigError, InputError
from h2o_compress.models.weights import eager_only_reason

INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True}


def decode_step(model, input_ids, cache, position_ids, attention_mask=None) -> torch.Tensor:
    """One decode step: ``input_ids`` int64 ``[batch, 1]`` at ``position_ids`` ``[batch, 1]`` (and, for a cache
    other than the compressed one, the 2D ``attention_mask`` ``[batch, tokens so far + 1]``); returns the
    next-token logits ``[batch, vocab]``."""
    out = model(
        input_ids=input_ids, past_key_values=cache, position_ids=position_ids, attention_mask=attention_mask,
        use_cache=True, logits_to_keep=1,
    )
    return out.logits[:, -1]


def decode_one(step, model, cache, token: torch.Tensor, seen: int) -> torch.Tensor:
    """One token ``[batch, 1]`` at position ``seen`` (tokens the cache has seen) through ``step``
    (`decode_step` or `compiled_decode_step`'s); returns logits ``[batch, vocab]``.

    A [`CompressedCache`][h2o_compress.cache.CompressedCache] gets no attention mask (its decode attention reads its slots'
    validity, and padding never entered them), so the step's inputs have the same shapes at every ``seen``; any
    other cache gets the all-ones mask ``[batch, seen + 1]``.
    """
    return step(model, token, cache, *step_inputs(cache, token, seen))


def step_inputs(cache, token: torch.Tensor, seen: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(positions, attention_mask)`` of a step feeding ``token`` ``[rows, 1]`` at position ``seen`` (tokens
    the cache has seen; see `decode_one`): ``positions`` ``[rows, 1]``, no mask for a compressed cache, the
    all-ones ``[rows, seen + 1]`` for any other."""
    device, rows = token.device, token.shape[0]
    positions = torch.full((rows, 1), seen, dtype=torch.long, device=device)
    mask = None if isinstance(cache, CompressedCache) else torch.ones(rows, seen + 1, dtype=torch.long, device=device)
    return positions, mask


def compiled_decode_step(model, device: torch.device | str | None = None):
    """The compiled `decode_step` for ``model``, built once per model and device type and reused.

    ``torch.compile(fullgraph=True)`` with Inductor; on CUDA ``mode="reduce-overhead"`` (CUDA graphs replay the
    step: the cache's buffers are marked static). The step takes no attention mask (`decode_one` passes
    none for a compressed cache), so every step has the same shapes: one graph, one CUDA graph replayed.
    Compilation happens at the first call (its time: ``benchmarks/results/cpu_compile_modes.md``).

    Raises (from the returned step):
        InputError: an ``attention_mask`` is given (its length grows every step: a recompile, or a CUDA-graph
            recording, per token).
    """
    kind = torch.device(device).type if device is not None else next(model.parameters()).device.type
    steps = model.__dict__.setdefault("_h2o_compiled_steps", {})
    if kind not in steps:
        mode = "reduce-overhead" if kind == "cuda" else None
        options = None if mode else dict(INDUCTOR_OPTIONS)
        compiled = torch.compile(decode_step, fullgraph=True, mode=mode, options=options)

        def step(model, input_ids, cache, position_ids, attention_mask=None):
            if attention_mask is not None:
                raise InputError(
                    f"the compiled decode step got an attention mask of shape {tuple(attention_mask.shape)}; it "
                    "takes none (a compressed cache's slots say which tokens are held, and a mask growing by one "
                    "token per step would cost a recompile or a CUDA-graph recording per step): pass "
                    "attention_mask=None, as decode_one does"
                )
            return compiled(model, input_ids, cache, position_ids)

        steps[kind] = step
    return steps[kind]


def warmup_steps(device: torch.device | str) -> int:
    """Calls of a compiled decode step, with a new cache, before it runs at speed (decode speeds leave them out):
    1 on CPU (the first call compiles); 2 on CUDA, where Inductor's CUDA-graph trees run the first call of a new
    function eagerly (warm-up) and record the CUDA graph at the next one (a new cache's buffers are new static
    addresses: its first call records a graph again)."""
    return 2 if torch.device(device).type == "cuda" else 1


def check_compile(compile: bool | None, config) -> None:
    """Refuse, before anything is loaded, ``compile=True`` with a format that runs eagerly only (the bitsandbytes
    formats), and a ``compile`` that is not a bool or ``None``.

    Raises:
        ConfigError: naming the value and what is allowed.
    """
    if compile is not None:
        check_flag("compile", compile, "True, False or None (auto)")
    if compile and not config.compilable:
        raise ConfigError(
            f"compile=True with quant={config.quant!r}: the bitsandbytes formats ({eager_only_formats()}) run "
            "eagerly only; allowed: quant='int' with compile, or --no-compile"
        )


def compiles_by_default(device: torch.device | str, model=None) -> bool:
    """Whether ``compile=None`` compiles on ``device`` (for a cache that can compile): on CUDA, unless ``model`` has
    bitsandbytes weights or is dispatched by accelerate over several devices or with offload
    (`h2o_compress.models.weights.eager_only_reason`); never on CPU."""
    return torch.device(device).type == "cuda" and (model is None or eager_only_reason(model) is None)


def resolve_compile(compile: bool | None, cache, device: torch.device, model=None) -> bool:
    """Whether a run compiles its decode step: ``compile`` if given, else on by default on CUDA and off on CPU
    (where eager decoding measured faster: ``benchmarks/results/decode_speed_cpu.md``), and off by default for a
    ``model`` with bitsandbytes weights or dispatched by accelerate over several devices or with offload (as
    transformers' own auto-compile does; `h2o_compress.models.weights.eager_only_reason`).

    ``compile`` was validated with the request (``True``, ``False`` or ``None``, and `check_compile` against the
    setting asked for, where it enters); what is checked here is the cache the run ended up with (a loaded
    cache's setting, a cache without ``max_length``), which ``compile=True`` must be able to trace.

    Raises:
        ConfigError: compiling asked for a cache that cannot compile (``cache.compile_blocker`` says why).
    """
    if compile is None:
        return cache.compile_blocker is None and compiles_by_default(device, model)
    if compile and cache.compile_blocker is not None:
        raise ConfigError(f"compile=True cannot compile this cache: {cache.compile_blocker}; allowed: compile=False")
    return compile
