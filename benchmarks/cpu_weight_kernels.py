"""Which CPU kernel multiplies SmolLM2's weights fastest, per Linear shape and number of rows (prefill vs decode).

    python benchmarks/cpu_weight_kernels.py --rows 1,16,128,512 --threads 1,2 --repeats 7

For each Linear shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536, head 49152x576;
random weights, as only the time is measured), times one product ``[rows, in] -> [rows, out]`` per candidate (the
median of ``--repeats`` calls after two warm-up calls, fp32 input and output), with torch on each of ``--threads``:

- ``fp32``: ``F.linear`` on the fp32 weight (what ``--weights-bits 16`` runs);
- ``int8 packed``: ``aten._weight_int8pack_mm`` with bf16 activations (``Int8Linear``'s kernel);
- ``int4 packed``: ``aten._weight_int4pack_mm_for_cpu`` with bf16 activations (``Int4Linear``'s kernel);
- ``int8->fp32``, ``int4->fp32``: the weight dequantized to fp32 on each call, then an fp32 GEMM;
- ``int8->bf16``: the int8 codes cast to bf16 on each call, a bf16 GEMM, the per-row scales on the output columns
  (``Int8Linear``'s many-row path); ``int4->bf16``: ``Int4Linear.dense_weight`` on each call, a bf16 GEMM;
- ``bf16 cached``: a bf16 GEMM on a dequantized copy kept per layer (an upper bound: it costs 2 bytes a weight);
- ``onednn dyn int8`` / ``x86 dyn int8``: ``torch.ao.nn.quantized.dynamic.Linear`` (per-channel int8 weights,
  activations quantized per call) under that quantized engine.

A candidate that fails is skipped with its reason recorded. Writes ``--out`` (JSON) and the same path with ``.md``:
the CPU model and flags, torch version, load average before and after, and the command. The machine is shared:
compare candidates within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from h2o_compress.models.int4_linear import GROUP_SIZE, Int4Linear
from h2o_compress.models.int8_linear import Int8Linear

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536), "head": (49152, 576)}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
BF16 = torch.bfloat16


def cpu_facts() -> dict:
    """The CPU model name and which of `FLAGS` ``/proc/cpuinfo`` lists (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "flags": []}
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"model": model, "flags": [flag for flag in FLAGS if flag in flags], "cores": os.cpu_count()}


def dynamic_int8(linear: torch.nn.Linear, engine: str):
    """``linear`` as ``torch.ao.nn.quantized.dynamic.Linear`` under quantized ``engine`` (per-channel int8)."""
    torch.backends.quantized.engine = engine
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear: qconfig})
    return lambda x, engine=engine: (setattr(torch.backends.quantized, "engine", engine), model(x))[1]


def candidates(out: int, width: int) -> dict:
    """Name -> a function ``[rows, width]`` fp32 -> ``[rows, out]``, or -> the reason building it failed."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(width, out, bias=False)
    weight = linear.weight.detach()
    int8 = Int8Linear.from_linear(linear)
    int4 = Int4Linear.from_linear(linear)
    q8, s8 = int8.weight_int8, int8.scales
    cached = int8.dequantized().to(BF16)
    built = {
        "fp32": lambda x: F.linear(x, weight),
        "int8 packed": lambda x: torch.ops.aten._weight_int8pack_mm(x.to(BF16), q8, s8).float(),
        "int4 packed": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(BF16), int4.weight_int4, GROUP_SIZE, int4.scales_and_zeros).float(),
        "int8->fp32": lambda x: F.linear(x, q8.float() * s8.float()[:, None]),
        "int4->fp32": lambda x: F.linear(x, int4.dense_weight().float()),
        "int8->bf16": lambda x: F.linear(x.to(BF16), q8.to(BF16)).float() * s8.float(),
        "int4->bf16": lambda x: F.linear(x.to(BF16), int4.dense_weight()).float(),
        "bf16 cached": lambda x: F.linear(x.to(BF16), cached).float(),
    }
    for engine in ("onednn", "x86"):
        try:
            built[f"{engine} dyn int8"] = dynamic_int8(torch.nn.Linear(width, out, bias=False), engine)
        except (RuntimeError, AssertionError, ValueError) as error:
            built[f"{engine} dyn int8"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return built


def median_ms(product, x: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of ``product(x)`` over ``repeats`` calls after two warm-up calls."""
    with torch.inference_mode():
        product(x), product(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            product(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(rows_list: list[int], threads_list: list[int], repeats: int) -> tuple[list[dict], dict]:
    """One record per (threads, shape, rows, candidate) that ran, and candidate -> reason for those skipped."""
    records, skipped = [], {}
    for name, (out, width) in SHAPES.items():
        built = candidates(out, width)
        for candidate, product in built.items():
            if isinstance(product, str):
                skipped[candidate] = product
                continue
            for threads in threads_list:
                torch.set_num_threads(threads)
                for rows in rows_list:
                    x = torch.randn(rows, width)
                    try:
                        ms = median_ms(product, x, repeats)
                    except RuntimeError as error:
                        skipped[candidate] = f"RuntimeError: {str(error).splitlines()[0][:120]}"
                        break
                    records.append({"shape": name, "out": out, "in": width, "rows": rows, "threads": threads,
                                    "candidate": candidate, "ms": ms})
            print(f"{name} {candidate}: done", flush=True)
    return records, skipped


def markdown(result: dict) -> str:
    """The results as a markdown page: one table per thread count, ms per product, best per row in bold."""
    lines = [f"# CPU weight kernels per SmolLM2-135M Linear shape and rows ({result['cpu']['model']})", "",
             f"`{result['command']}`", "",
             f"CPU: {result['cpu']['model']}, {result['cpu'].get('cores')} cores, flags "
             f"{', '.join(result['cpu']['flags']) or 'none of ' + ', '.join(FLAGS)}; torch {result['torch']}; "
             f"load average before {result['load_before']}, after {result['load_after']}. {result['note']}", ""]
    names = list(dict.fromkeys(r["candidate"] for r in result["records"]))
    for threads in result["threads"]:
        lines += [f"## {threads} thread(s): ms per product (median)", "",
                  "| shape | rows | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
        for shape in SHAPES:
            for rows in result["rows"]:
                cells = {r["candidate"]: r["ms"] for r in result["records"]
                         if r["shape"] == shape and r["rows"] == rows and r["threads"] == threads}
                best = min(cells.values(), default=None)
                lines.append(f"| {shape} | {rows} | " + " | ".join(
                    "-" if n not in cells else (f"**{cells[n]:.3f}**" if cells[n] == best else f"{cells[n]:.3f}")
                    for n in names) + " |")
        lines.append("")
    lines += ["Skipped: " + ("; ".join(f"{k}: {v}" for k, v in result["skipped"].items()) or "none"), ""]
    return "\n".join(lines)


def show(result: dict) -> None:
    """Print the int8 decision per shape and rows with rich: packed kernel vs the dense bf16 path."""
    table = Table(title="int8 packed vs int8->bf16 (ms; speed-up)")
    for column in ("threads", "shape", "rows", "int8 packed", "int8->bf16", "int4 packed", "int4->bf16"):
        table.add_column(column, justify="right")
    for threads in result["threads"]:
        for shape in SHAPES:
            for rows in result["rows"]:
                cells = {r["candidate"]: r["ms"] for r in result["records"]
                         if r["shape"] == shape and r["rows"] == rows and r["threads"] == threads}
                table.add_row(str(threads), shape, str(rows), *(
                    f"{cells.get(n, float('nan')):.3f}" for n in ("int8 packed", "int8->bf16", "int4 packed",
                                                                   "int4->bf16")))
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,128,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/cpu_weight_kernels.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    load_before = os.getloadavg()
    records, skipped = measure(rows_list, threads_list, args.repeats)
    result = {"command": "python benchmarks/cpu_weight_kernels.py " + shlex.join(sys.argv[1:]), "note": args.note,
              "cpu": cpu_facts(), "torch": torch.__version__, "mkldnn": torch.backends.mkldnn.is_available(),
              "threads": threads_list,
              "rows": rows_list, "repeats": args.repeats,
              "load_before": [round(v, 2) for v in load_before],
              "load_after": [round(v, 2) for v in os.getloadavg()], "skipped": skipped, "records": records}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    show(result)


if __name__ == "__main__":
    main()
