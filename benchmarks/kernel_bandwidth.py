"""The decode attention op's memory bandwidth and what bounds it (issue 14, item 2: "the int4 path reads at >= 70% of
the card's measured copy bandwidth in a kernel microbenchmark ... register pressure checked").

    python benchmarks/kernel_bandwidth.py                     # ~3 min on 2 CPU cores: the resources part only
    python benchmarks/kernel_bandwidth.py --out benchmarks/results/kernel_bandwidth_cpu.json
    python benchmarks/kernel_bandwidth.py --device cuda       # H100/H200: resources + measured bandwidth, ~2 min

``h2o_compress::slot_decode_attention`` (``h2o_compress/attention/slot_attention.py``) over one layer's buffers at
two shapes: ``llama-7b`` (issue 14's 16k x batch 16 at budget 0.2: batch 16, 32 KV heads, head_dim 128, 3,277
slots + a ring of 3) and ``smollm2`` (batch 1, 3 KV heads x 3 query heads, head_dim 64, 1k at 0.2), for int4, int8
and 16-bit storage (group 32, H2O scores on, an fp16 or bf16 model: ``--dtype``), and for every launch option
``--blocks`` x ``--warps`` x ``--stages`` x ``--max-registers`` (tokens per loop iteration, warps per program,
load-pipeline depth, register cap per thread, 0 = none: :class:`LaunchOptions`).

**Resources** (any machine with Triton's NVIDIA backend; no GPU needed): the split pass is compiled for sm_90 by
Triton with its bundled ptxas, specialised as Triton's JIT would specialise it at that shape (16-byte aligned
pointers and strides divisible by 16), and ``cuobjdump --dump-resource-usage`` gives the registers per thread and
spill (stack) bytes; Triton's metadata the shared memory. From those: resident programs per SM (sm_90: 65,536
registers allocated per warp in 256s, 228 KiB shared of which 1 KiB per program is reserved, 64 warps), the bytes one
program reads per loop iteration, and the **bytes in flight per SM** (programs x bytes per iteration x (stages -
1)). The last is the proxy this benchmark reports for a memory-bound kernel: it explains the H100 figures of
``../shared/gpu-measurements.md`` (16-bit: 128 KiB in flight, 2.5 TB/s; int4: 40 KiB, 0.8 TB/s: both take the same
~330 us per layer, i.e. the same time per iteration, the int4 one carrying 3.2x fewer bytes). It is a proxy: only
``--device cuda`` measures.

**Bandwidth** (``--device cuda``): the op is timed per option (CUDA events over ``--repeats`` calls after a
warm-up, median of 5) and the bytes it must move (codes, scales and zeros, positions, ring, scores read + written,
logits written + read, split partials) per second are reported against the card's copy bandwidth measured in the
same run (read + write of 2 GiB, ``gpu_throughput.copy_bandwidth``); the best option per format and shape is
named, so the launch per format (``LAUNCH`` in ``h2o_compress/attention/launch.py``, chosen from the resources
alone so far) can follow the measurement.

Writes ``--out`` (JSON), the same name with ``.md`` (tables) and ``.png`` (bytes in flight per SM, and with a GPU the
share of copy bandwidth, per option).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, what the JIT compiles with; no warning
from h2o_compress.attention.launch import LaunchOptions, launch_for  # noqa: E402  (no Triton: attention/slot_attention is lazy)

SPILL_TOLERANCE = 16  # bytes of spills an option may have and still be picked from the resources alone (LAUNCH's rule)
SM90 = dict(registers=65536, shared=228 * 1024, reserved_shared=1024, warps=64, programs=32)


@dataclass(frozen=True)
class Shape:
    """One layer's decode: ``batch`` sequences, ``kv_heads`` x ``group`` query heads of ``head_dim``, ``slots``
    stored tokens + a ring of ``ring``."""

    name: str
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    slots: int
    ring: int = 3
    group_size: int = 32


SHAPES = {"llama-7b": Shape("llama-7b", 16, 32, 1, 128, 3277), "smollm2": Shape("smollm2", 1, 3, 3, 64, 205)}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda adds the measured bandwidth")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="the model's dtype (default fp16)")
    p.add_argument("--formats", type=ints, default=[4, 8, 16], help="storage bits (default 4,8,16)")
    p.add_argument("--blocks", type=ints, default=[32, 64, 128], help="tokens per iteration (default 32,64,128)")
    p.add_argument("--warps", type=ints, default=[4, 8], help="warps per program (default 4,8)")
    p.add_argument("--stages", type=ints, default=[2, 3, 4], help="pipeline depths (default 2,3,4)")
    p.add_argument("--max-registers", type=ints, default=[0], help="register caps, 0 = none (default 0)")
    p.add_argument("--repeats", type=int, default=50, help="op calls per timing (cuda)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: a temp dir)")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; allowed: {', '.join(SHAPES)}")
    bad = [f for f in args.formats if f not in (4, 8, 16)]
    if bad:
        p.error(f"--formats {bad} not allowed; allowed: 4, 8, 16")
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 is set: the kernels must compile for the GPU here; unset it")
    return args


def bytes_per_token(shape: Shape, bits: int) -> float:
    """Bytes of K + V one stored token costs (codes + fp16 scale and zero per group)."""
    d = shape.head_dim
    if bits == 16:
        return 2 * d * 2
    return 2 * (d * bits / 8 + 4 * d / shape.group_size)


def tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sm90(shape: Shape, bits: int, block: int, warps: int, stages: int, max_registers: int = 0,
                 dtype: str = "fp16"):
    """The split pass compiled for sm_90 at ``shape`` for a ``dtype`` model (scores on, no rotation), as the JIT
    specialises it (and as the op picks its dequantization dtype: fp16 for fp16, else fp32)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h2o_compress.attention import slot_attention as sa

    fn = sa._slot_partial_kernel
    strides = "q_b q_h k_b k_h k_n ksz_b ksz_h ksz_n v_b v_h v_n vsz_b vsz_h vsz_n r_b r_h r_n".split()
    scalars = "slots ring_size store_splits split_tokens ring_split_tokens num_slots total".split()
    act = f"*{dtype}"
    data = act if bits == 16 else "*u8"
    sig = dict({n: "i32" for n in strides + scalars}, q=act, scaling="fp32", k=data, v=data, ksz="*fp16",
               vsz="*fp16", pos="*i32", lk=act, lv=act, leave_slot="*i64", rk=act, rv=act,
               rpos="*i32", seen="*i64", part_m="*fp32", part_l="*fp32", part_acc="*fp32", logits="*fp32",
               qb="*fp32")
    # what the JIT sees at this shape: 16-byte aligned buffers, and which strides are multiples of 16
    stride_values = dict(q_b=shape.kv_heads * shape.group * shape.head_dim, q_h=shape.head_dim,
                         k_n=shape.head_dim * bits // 8 if bits < 16 else shape.head_dim,
                         ksz_n=2 * shape.head_dim // shape.group_size, r_n=shape.head_dim)
    stride_values |= dict(v_n=stride_values["k_n"], vsz_n=stride_values["ksz_n"])
    stride_values |= dict(k_h=shape.slots * stride_values["k_n"], ksz_h=shape.slots * stride_values["ksz_n"],
                          r_h=shape.ring * shape.head_dim)
    stride_values |= dict(k_b=shape.kv_heads * stride_values["k_h"], ksz_b=shape.kv_heads * stride_values["ksz_h"],
                          v_h=stride_values["k_h"], vsz_h=stride_values["ksz_h"], r_b=shape.kv_heads
                          * stride_values["r_h"])
    stride_values |= dict(v_b=stride_values["k_b"], vsz_b=stride_values["ksz_b"])
    aligned = {n for n, t in sig.items() if t.startswith("*")} | {n for n, v in stride_values.items() if v % 16 == 0}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    consts = dict(KV_HEADS=shape.kv_heads, G=shape.group, GP=max(16, triton.next_power_of_2(shape.group)),
                  D=shape.head_dim, GROUP=shape.group_size, K_FMT=bits, V_FMT=bits, BLOCK=block, WRITE_LOGITS=True,
                  DOT=tl.float16 if dtype == "fp16" else tl.bfloat16, PRECISION="tf32", ROTATE_Q=False,
                  DC=min(shape.head_dim, 32), DQ=tl.float16 if dtype == "fp16" else tl.float32)
    sig |= {c: "constexpr" for c in consts}
    return triton.compile(ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
                          | ({"maxnreg": max_registers} if max_registers else {}))


def resources(shape: Shape, bits: int, block: int, warps: int, stages: int, max_registers: int = 0,
              dtype: str = "fp16") -> dict:
    """Registers, spills, shared memory and the occupancy / bytes-in-flight proxy of one option on sm_90."""
    kernel = compile_sm90(shape, bits, block, warps, stages, max_registers, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(tools() / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools() / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spill = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = int(kernel.metadata.shared)
    per_warp = -(-registers * 32 // 256) * 256
    programs = min(SM90["registers"] // (per_warp * warps), SM90["shared"] // (shared + SM90["reserved_shared"]),
                   SM90["warps"] // warps, SM90["programs"])
    per_iteration = block * bytes_per_token(shape, bits)
    instructions = len(re.findall(r"/\*[0-9a-f]{4}\*/\s+\S", sass))
    return dict(registers=registers, spill_bytes=spill, shared_bytes=shared, programs_per_sm=programs,
                warps_per_sm=programs * warps, bytes_per_iteration=per_iteration,
                bytes_in_flight_per_sm=programs * per_iteration * max(stages - 1, 1), sass_instructions=instructions)


def make_inputs(shape: Shape, bits: int, device, plan, dtype: str = "fp16"):
    """Random buffers of one layer (every slot and ring token valid) and the op's keyword arguments."""
    import torch

    from h2o_compress.attention import slot_attention as sa

    act = torch.float16 if dtype == "fp16" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    b, h, d, n, r = shape.batch, shape.kv_heads, shape.head_dim, shape.slots, shape.ring

    def store():
        if bits == 16:
            return torch.randn(b, h, n, d, device=device, dtype=act, generator=g) * 0.5, None
        codes = torch.randint(0, 256, (b, h, n, d * bits // 8), device=device, dtype=torch.uint8, generator=g)
        sz = torch.rand(b, h, n, d // shape.group_size, 2, device=device, generator=g).half() * 0.1
        return codes, sz

    (kd, ksz), (vd, vsz) = store(), store()
    scratch = sa.DecodeScratch(plan, b, h * shape.group, d, n + r, True, device)
    return dict(
        query=torch.randn(b, h * shape.group, d, device=device, dtype=act, generator=g),
        k_data=kd, k_scale_zero=ksz, v_data=vd, v_scale_zero=vsz,
        positions=torch.arange(n, device=device, dtype=torch.int32).expand(b, h, n).contiguous(),
        leave_keys=torch.randn(b, h, d, device=device, dtype=act, generator=g),
        leave_values=torch.randn(b, h, d, device=device, dtype=act, generator=g),
        leave_slot=torch.zeros(b, h, device=device, dtype=torch.int64),
        ring_keys=torch.randn(b, h, r, d, device=device, dtype=act, generator=g),
        ring_values=torch.randn(b, h, r, d, device=device, dtype=act, generator=g),
        ring_positions=torch.arange(n, n + r, device=device, dtype=torch.int32).expand(b, r).contiguous(),
        seen=torch.tensor(n + r, device=device), scores=torch.zeros(b, h, n, device=device),
        ring_scores=torch.zeros(b, h, r, device=device), part_m=scratch.part_m, part_l=scratch.part_l,
        part_acc=scratch.part_acc, logits=scratch.logits, scaling=d**-0.5, key_bits=bits, value_bits=bits,
        group_size=shape.group_size, store_splits=plan.store_splits, split_tokens=plan.split_tokens,
        ring_splits=plan.ring_splits, ring_split_tokens=plan.ring_split_tokens, accumulate=True,
        block=plan.launch.block, num_warps=plan.launch.num_warps, num_stages=plan.launch.num_stages,
        max_registers=plan.launch.max_registers,
    ), scratch.nbytes()


def moved_bytes(kw: dict, scratch_bytes: int) -> int:
    """Bytes the op must move once: the store and ring read, positions read, scores read + written, logits and
    split partials written + read, the output written."""
    read = sum(kw[k].numel() * kw[k].element_size() for k in ("k_data", "v_data", "positions", "ring_keys",
                                                               "ring_values", "query")
               ) + sum(kw[k].numel() * kw[k].element_size() for k in ("k_scale_zero", "v_scale_zero")
                       if kw[k] is not None)
    scores = 2 * (kw["scores"].numel() + kw["ring_scores"].numel()) * 4
    return read + scores + 2 * scratch_bytes + kw["query"].numel() * 2


def measure(shape: Shape, bits: int, block: int, warps: int, stages: int, max_registers: int, repeats: int,
            dtype: str = "fp16") -> dict:
    """Median seconds per op call over 5 timings of ``repeats`` calls (CUDA events), and the bytes it moves."""
    import torch

    from h2o_compress.attention import slot_attention as sa

    device = torch.device("cuda")
    plan = sa.plan_splits(shape.batch, shape.kv_heads, shape.slots, shape.ring, device=device,
                          launch=LaunchOptions(block, warps, stages, max_registers))
    kw, scratch_bytes = make_inputs(shape, bits, device, plan, dtype)
    for _ in range(3):
        sa.slot_decode_attention(**kw)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            sa.slot_decode_attention(**kw)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeats)
    seconds = sorted(times)[2]
    moved = moved_bytes(kw, scratch_bytes)
    return dict(seconds=seconds, moved_bytes=moved, gb_per_s=moved / seconds / 1e9, store_splits=plan.store_splits)


def render(data: dict) -> str:
    """Markdown: environment, then per shape a table of every option, the best per format marked."""
    lines = ["# Decode attention op: resources on sm_90 and bandwidth", "",
             f"Command: `{data['command']}`. Device: {data['device']}. Model dtype {data['dtype']}. Triton "
             f"{data['triton']}, torch {data['torch']}."]
    if data.get("copy_gb_per_s"):
        lines.append(f"Copy bandwidth (read + write): **{data['copy_gb_per_s']:.0f} GB/s**.")
    launch = "; ".join(f"{bits}-bit block {o['block']}, {o['num_warps']} warps, {o['num_stages']} stages"
                       + (f", cap {o['max_registers']}" if o["max_registers"] else "")
                       for bits, o in data["defaults"].items())
    lines += ["", "Resources: compiled for sm_90 with Triton's ptxas (no GPU needed); programs/SM and bytes in flight "
              f"are derived (see the script's docstring). Defaults (`h2o_compress.attention.launch.LAUNCH`): {launch}.", ""]
    gpu = any("gb_per_s" in row for row in data["rows"])
    for shape in dict.fromkeys(row["shape"] for row in data["rows"]):
        lines += [f"## {shape}", "", "| bits | block | warps | stages | cap | registers | spill B | shared KiB | "
                  "programs/SM | KiB/iteration | KiB in flight/SM |" + (" GB/s | share of copy |" if gpu else ""),
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "")]
        for row in (r for r in data["rows"] if r["shape"] == shape):
            mark = " **(default)**" if row["default"] else ""
            cells = [row["bits"], row["block"], row["warps"], f"{row['stages']}{mark}", row["max_registers"] or "-",
                     row["registers"],
                     row["spill_bytes"], f"{row['shared_bytes'] / 1024:.0f}", row["programs_per_sm"],
                     f"{row['bytes_per_iteration'] / 1024:.1f}", f"{row['bytes_in_flight_per_sm'] / 1024:.0f}"]
            if gpu:
                cells += [f"{row.get('gb_per_s', 0):.0f}", f"{row.get('copy_share', 0):.0%}"]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
        for bits in dict.fromkeys(r["bits"] for r in data["rows"] if r["shape"] == shape):
            rows = [r for r in data["rows"] if r["shape"] == shape and r["bits"] == bits
                    and (gpu or r["spill_bytes"] <= SPILL_TOLERANCE)]  # measured: spills are in the time already
            if not rows:
                continue
            key = "gb_per_s" if gpu else "bytes_in_flight_per_sm"
            best = max(rows, key=lambda r: r[key])
            default = next((r for r in rows if r["default"]), None)
            what = (f"{best['gb_per_s']:.0f} GB/s ({best['copy_share']:.0%} of copy)" if gpu
                    else f"{best['bytes_in_flight_per_sm'] / 1024:.0f} KiB in flight per SM (proxy)")
            was = "" if default is None else (f"; default {default['gb_per_s']:.0f} GB/s" if gpu else
                                              f"; default {default['bytes_in_flight_per_sm'] / 1024:.0f} KiB")
            cap = f", cap {best['max_registers']}" if best["max_registers"] else ""
            rule = "" if gpu else f" (<= {SPILL_TOLERANCE} B spills)"
            lines.append(f"- {bits}-bit: best{rule} block {best['block']}, "
                         f"{best['warps']} warps, {best['stages']} stages{cap}: {what}{was}.")
        lines.append("")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Bytes in flight per SM (and measured share of copy bandwidth) per option, one panel per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in data["rows"]))
    gpu = any("gb_per_s" in r for r in data["rows"])
    most = max(sum(r["shape"] == shape for r in data["rows"]) for shape in shapes)
    fig, axes = plt.subplots(len(shapes), 1, figsize=(max(12, 0.12 * most), 4.2 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        rows = [r for r in data["rows"] if r["shape"] == shape]
        labels = [f"{r['bits']}b B{r['block']} w{r['warps']} s{r['stages']}"
                  + (f" r{r['max_registers']}" if r["max_registers"] else "") for r in rows]
        values = [r["copy_share"] * 100 if gpu else r["bytes_in_flight_per_sm"] / 1024 for r in rows]
        colors = ["tab:red" if r["spill_bytes"] else {4: "tab:blue", 8: "tab:orange", 16: "tab:green"}[r["bits"]]
                  for r in rows]
        ax.bar(range(len(rows)), values, color=colors, edgecolor=["black" if r["default"] else "none" for r in rows],
               linewidth=2)
        for i, r in enumerate(rows):
            if r["default"]:
                ax.annotate("default", (i, values[i]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
        ax.set_xlim(-1, len(rows))
        ax.set_ylabel("% of copy bandwidth" if gpu else "KiB in flight per SM")
        ax.set_title(f"{shape}: blue int4, orange int8, green 16-bit, red: spills registers; outlined: the format's "
                     "launch (LAUNCH)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import triton
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.progress import track

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
    options = list(itertools.product(args.shapes.split(","), args.formats, args.blocks, args.warps, args.stages,
                                     args.max_registers))
    data = dict(command="python " + " ".join([sys.argv[0]] + sys.argv[1:]), dtype=args.dtype, triton=triton.__version__,
                torch=torch.__version__, device=(torch.cuda.get_device_name() if args.device == "cuda"
                                                 else f"{platform.processor() or platform.machine()} CPU (resources "
                                                 "only)"),
                defaults={bits: asdict(launch_for(bits, bits)) for bits in args.formats}, rows=[])
    if args.device == "cuda":
        from gpu_throughput import copy_bandwidth  # this directory's GPU benchmark: read + write GB/s

        data["copy_gb_per_s"] = copy_bandwidth(torch.device("cuda"), 2 << 30)
    for name, bits, block, warps, stages, cap in track(options, description="compiling for sm_90"):
        shape = SHAPES[name]
        row = dict(shape=name, bits=bits, block=block, warps=warps, stages=stages, max_registers=cap,
                   default=LaunchOptions(block, warps, stages, cap) == launch_for(bits, bits))
        row |= resources(shape, bits, block, warps, stages, cap, args.dtype)
        if args.device == "cuda":
            row |= measure(shape, bits, block, warps, stages, cap, args.repeats, args.dtype)
            row["copy_share"] = row["gb_per_s"] / data["copy_gb_per_s"]
        data["rows"].append(row | dict(shape_fields=asdict(shape)))
    out = args.out or Path(tempfile.mkdtemp()) / "kernel_bandwidth.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    text = render(data)
    out.with_suffix(".md").write_text(text + "\n")
    plot(data, out.with_suffix(".png"))
    Console().print(Markdown(text))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
