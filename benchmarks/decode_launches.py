"""How many ops and kernels one compressed layer's decode step dispatches (issue 14, item 1: "the whole compressed
decode of a layer: at most 4 GPU kernels besides the model's own projections").

    python benchmarks/decode_launches.py --out benchmarks/results/decode_launches_cpu.json   # ~2 min, 2 CPU cores

A tiny LLaMA-shaped model with random weights (head_dim 128, GQA 8 query / 2 KV heads, 2 layers, fp32 on CPU) gets
an h2o 0.2 int4 cache (group 32, Hadamard rotation, residual 3: the defaults) and an eager prefill; then each
layer's part of a decode step alone is run and counted: ``CompressedCache.update`` (flags, bases, ring, quantize +
insert) and the ``h2o_compress`` attention function (query basis, attention + scores, eviction, output basis), with
fixed random q/k/v: what the cache adds to a step besides the model's projections, rotary and MLP. Modes:

``torch eager``     ``attention_kernel='torch'``: the torch form, op by op.
``fused eager``     ``attention_kernel='triton'``: the op ``h2o_compress::slot_decode_attention`` (two Triton launches;
                    on CPU under ``TRITON_INTERPRET=1``, set by this script) plus the torch ops around it.
``fused compiled``  the same under ``torch.compile(fullgraph=True)`` (Inductor; the project's
                    :data:`~h2o_compress.runtime.compiled.INDUCTOR_OPTIONS`); the custom op stays one extern call.
``torch compiled``  the torch form compiled likewise (what a CUDA user without Triton would get).

Counted per layer per step (over ``--steps`` profiled steps after warm-up): **aten ops** dispatched at top level
(``torch.profiler`` events named ``aten::*`` with no ``aten::*`` parent), **compute ops** (the same without view /
metadata / allocation ops, which launch nothing on a GPU), **Inductor kernels** (calls of ``cpp_fused_*`` /
``triton_*`` kernels in the generated code's ``call()``), **extern calls** (``extern_kernels.*`` and aten/custom op
fallbacks in that code, e.g. the 128x128 matmuls of the Hadamard bases), **custom op calls** and **Triton launches**
(the op's kernels, counted at launch).

Inductor's CPU fusion (C++/OpenMP kernels) is a proxy for its CUDA fusion (Triton kernels), not the same thing: the
two backends share the scheduler and its fusion rules, but the CUDA backend may split or merge differently
(reductions, scatter, templates). A GPU run (``--device cuda``, or ``benchmarks/gpu_throughput.py --preset
issue14``, which counts CUDA kernels with the profiler) must confirm the kernel counts on the card.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("torch eager", "fused eager", "fused compiled", "torch compiled")
# top-level aten ops that launch no kernel on a GPU (views, metadata, allocation)
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "transpose", "t", "permute", "select",
    "slice", "unbind", "unflatten", "flatten", "as_strided", "alias", "detach", "split", "chunk", "narrow",
    "empty", "empty_strided", "empty_like", "lift_fresh", "_reshape_alias", "resolve_conj", "resolve_neg",
    "view_as", "expand_as", "contiguous", "to", "numpy_T", "_to_copy_noop",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the layer runs (default cpu)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--steps", type=int, default=3, help="profiled decode steps per mode (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps before profiling (default 2)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default: print only)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"--modes: {', '.join(bad)} not allowed; allowed: {', '.join(MODES)}")
    if args.prompt < 16 or args.steps < 1 or args.warmup < 1 or args.layers < 1:
        parser.error("--prompt >= 16, --steps >= 1, --warmup >= 1 and --layers >= 1 are required")
    if args.out is not None and args.out.exists() and args.out.is_dir():
        parser.error(f"--out {args.out} is a directory; allowed: a file path")
    args.modes = modes
    return args


def build(args, kernel: str):
    """The tiny model, its prefilled cache (h2o 0.2 int4) and fixed per-layer decode inputs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from h2o_compress import CompressionConfig, make_cache

    torch.manual_seed(0)
    heads, kv_heads, head_dim = 8, 2, 128
    config = LlamaConfig(
        vocab_size=256, hidden_size=heads * head_dim, intermediate_size=256, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model = LlamaForCausalLM(config).eval().to(args.device, dtype)
    length = args.prompt + args.warmup + args.steps + 1
    cache = make_cache(model, CompressionConfig(policy="h2o", budget=0.2, kv_bits=4, attention_kernel=kernel),
                       max_length=length)
    ids = torch.randint(0, 256, (1, args.prompt), device=args.device)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)
    modules = [layer.self_attn for layer in model.model.layers]
    gen = torch.Generator().manual_seed(1)
    inputs = [
        tuple(torch.randn(1, n, 1, head_dim, generator=gen).to(args.device, dtype) for n in (heads, kv_heads, kv_heads))
        for _ in modules
    ]
    return model, cache, modules, inputs


def layer_steps(cache, modules, inputs):
    """Every layer's part of one decode step, in order: the cache update, then the ``h2o_compress`` attention
    function with what it returned. Returns the attention outputs.

    Layer ``i + 1``'s key and value are its fixed inputs plus layer ``i``'s attention output (one add, which stands
    in for the model's projections and rotary): as in a model, a layer's cache work cannot start before the previous
    layer's attention, so Inductor cannot merge the layers' cache kernels into one (independent inputs would let it
    run every layer's ring write in one kernel and every eviction in another, which no model allows). The query
    stays independent: it goes to the op as it is (its add would be a kernel of its own, the model's work)."""
    from h2o_compress.attention import h2o_attention_forward

    outs = []
    for i, (query, key, value) in enumerate(inputs):
        if outs:
            previous = outs[-1].transpose(1, 2)  # [batch, q_heads, 1, head_dim]
            kv_heads = key.shape[1]
            key, value = key + previous[:, :kv_heads], value + previous[:, -kv_heads:]
        keys, values = cache.update(key, value, i)
        out, _ = h2o_attention_forward(modules[i], query, keys, values, None, scaling=modules[i].scaling)
        outs.append(out)
    return outs


class LaunchCounter:
    """Counts launches of the Triton kernels of :mod:`h2o_compress.attention.slot_attention` (patches their
    ``run``; works for compiled kernels and under ``TRITON_INTERPRET=1``)."""

    def __init__(self):
        from h2o_compress.attention import slot_attention

        self.kernels = [slot_attention._slot_partial_kernel, slot_attention._slot_combine_kernel]
        self.count = 0

    def __enter__(self):
        for kernel in self.kernels:
            original = kernel.run

            def run(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            kernel.run = run
        return self

    def __exit__(self, *exc):
        for kernel in self.kernels:
            del kernel.run  # back to the class's method


def count_code(codes: list[str]) -> dict:
    """Kernel and extern calls in the ``call()`` bodies of Inductor's generated code."""
    kernels, externs = [], []
    for code in codes:
        body = code.split("def call(", 1)[-1].split("\ndef ", 1)[0]
        for line in body.splitlines():
            line = line.strip()
            match = re.match(r"(?:\w+ = )?(cpp_fused_\w+|triton_\w+)(?:\.run)?\(", line)
            if match:
                kernels.append(match.group(1))
                continue
            match = re.search(r"(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\(", line)
            if match and not line.startswith(("del ", "assert_")):
                externs.append(match.group(1))
    return {"kernels": kernels, "externs": externs}


def profile_steps(step, args) -> dict:
    """Profile ``args.steps`` calls of ``step``; top-level aten ops, compute ops, custom op calls, Inductor kernel
    events, Triton launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with LaunchCounter() as launches, profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        if args.device == "cuda":
            torch.cuda.synchronize()
    top, compute, custom, fused = [], [], 0, 0
    gpu_kernels = 0
    for event in prof.events():
        name = event.name
        if name.startswith("h2o_compress::"):
            custom += 1
        if re.match(r"(graph_\d+_)?(cpp_fused|triton_)", name) and event.device_type.name == "CPU":
            fused += 1
        if event.device_type.name == "CUDA":
            gpu_kernels += 1
        if not name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", "h2o_compress::")):
            parent = parent.cpu_parent
        if parent is None:
            top.append(name[6:])
            if name[6:] not in NO_KERNEL:
                compute.append(name[6:])
    return {"top": top, "compute": compute, "custom": custom, "fused_events": fused, "triton": launches.count,
            "gpu_kernels": gpu_kernels}


def measure(mode: str, args) -> dict:
    """One mode's counts per layer per step (see the module docstring)."""
    import torch
    import torch._dynamo
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from h2o_compress.runtime.compiled import INDUCTOR_OPTIONS

    kernel = "torch" if mode.startswith("torch") else "triton"
    compiled = mode.endswith("compiled")
    model, cache, modules, inputs = build(args, kernel)
    if kernel == "triton" and not all((layer.backend.name == "triton") for layer in cache.layers):
        raise SystemExit(f"error: mode {mode!r}: the layers did not take the Triton op")
    fn = layer_steps
    codes: list[str] = []
    compile_s = 0.0
    torch._dynamo.reset()
    with torch.inference_mode(), inductor_config.patch({"cpp.enable_kernel_profile": True}):
        if compiled:
            fn = torch.compile(layer_steps, fullgraph=True, options=dict(INDUCTOR_OPTIONS))
            start = time.perf_counter()
            _, codes = run_and_get_code(fn, cache, modules, inputs)
            compile_s = time.perf_counter() - start
        for _ in range(args.warmup - (1 if compiled else 0)):
            fn(cache, modules, inputs)
        counts = profile_steps(lambda: fn(cache, modules, inputs), args)
    per = args.steps * len(modules)
    code = count_code(codes)
    row = {
        "mode": mode,
        "aten_ops": len(counts["top"]) / per,
        "compute_ops": len(counts["compute"]) / per,
        "inductor_kernels": len(code["kernels"]) / len(modules) if compiled else None,
        "extern_calls": len(code["externs"]) / len(modules) if compiled else None,
        "inductor_kernel_events": counts["fused_events"] / per if compiled else None,
        "custom_op_calls": counts["custom"] / per,
        "triton_launches": counts["triton"] / per,
        "gpu_kernels": counts["gpu_kernels"] / per if args.device == "cuda" else None,
        "compile_s": round(compile_s, 1),
        "compute_op_names": sorted(set(counts["compute"])),
        "generated_kernels": code["kernels"],
        "generated_externs": code["externs"],
    }
    # what a GPU would launch per layer and step: generated kernels + extern calls (compiled: custom op calls count
    # as their Triton launches), else the compute ops (custom op calls as their Triton launches)
    if compiled:
        externs = [e for e in code["externs"] if "slot_decode_attention" not in e]
        row["launch_estimate"] = (len(code["kernels"]) + len(externs)) / len(modules) + row["triton_launches"]
    else:
        row["launch_estimate"] = row["compute_ops"] + row["triton_launches"]
    return row


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":  # before triton is first imported (transformers imports it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch.cuda.is_available() is False; allowed: --device cpu")
    rows = []
    with Progress() as progress:
        task = progress.add_task("modes", total=len(args.modes))
        for mode in args.modes:
            progress.update(task, description=mode)
            rows.append(measure(mode, args))
            progress.advance(task)
    device = device_name(args.device)
    table = Table(title=f"Ops and kernels per layer per decode step, h2o 0.2 int4, head_dim 128, GQA 8/2, {device}")
    columns = ("mode", "aten_ops", "compute_ops", "inductor_kernels", "inductor_kernel_events", "extern_calls",
               "custom_op_calls",
               "triton_launches", "launch_estimate") + (("gpu_kernels",) if args.device == "cuda" else ())
    for column in columns:
        table.add_column(column.replace("_", " "))
    for row in rows:
        table.add_row(*(fmt(row[c]) for c in columns))
    console = Console(width=200)
    console.print(table)
    for row in rows:
        if row["generated_kernels"] or row["generated_externs"]:
            console.print(f"{row['mode']}: kernels {row['generated_kernels']}, externs {row['generated_externs']}")
    if args.out is not None:
        result = {"device": device, "torch": torch.__version__, "command": " ".join(["python"] + sys.argv),
                  "prompt": args.prompt, "steps": args.steps, "layers": args.layers, "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
