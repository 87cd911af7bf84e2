"""The weights' products of one CPU decode step alone, per weight setting (issue 50: a ceiling on decode speed).

    python benchmarks/cpu_weight_products.py --bits 8,4,16 --threads 2 --rounds 2

For each ``--bits`` (alternating, ``--rounds`` times, each load fresh), loads SmolLM2 on CPU with
``load_model(weights_bits=bits)`` and calls every linear layer of the model (``Int8Linear``, ``Int4Linear`` or an
fp ``nn.Linear``; the output head included) in model order on one row of its input width, as one decode step
calls them, nothing else: the median of ``--passes`` passes after one warm-up, and the head alone the same way.
``1 / seconds`` bounds the decode tokens/s of any step built on those kernels; compare it with a peer's whole step
measured on the same machine (``cpu_peers.py``).

Writes ``--out`` (JSON) and the same path with ``.md``, the command beside the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch

from h2o_compress import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from cpu_worker import product_layers, weight_products_seconds  # noqa: E402  (the cpu_peers.py worker's own timing)


def measure(model_name: str, bits: int, passes: int) -> dict:
    model, _ = load_model(model_name, device="cpu", weights_bits=bits)
    layers = product_layers(model)
    return {"bits": bits, "layers": len(layers), "kinds": sorted({type(m).__name__ for m in layers}),
            "products_s": weight_products_seconds(layers, passes),
            "head_s": weight_products_seconds(layers[-1:], passes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bits", default="8,4,16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/cpu_weight_products.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bits = [int(b) for b in args.bits.split(",")]
    runs = [measure(args.model, b, args.passes) for _ in range(args.rounds) for b in bits]
    for run in runs:
        print(f"{run['bits']} bits: products {run['products_s'] * 1e3:.1f} ms per token (head {run['head_s'] * 1e3:.1f})",
              flush=True)
    rows = [{"bits": b, "products_ms": statistics.median(r["products_s"] for r in runs if r["bits"] == b) * 1e3,
             "head_ms": statistics.median(r["head_s"] for r in runs if r["bits"] == b) * 1e3,
             "kinds": next(r["kinds"] for r in runs if r["bits"] == b)} for b in bits]
    command = "python benchmarks/cpu_weight_products.py " + shlex.join(sys.argv[1:])
    result = {"command": command, "note": args.note, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "threads": args.threads, "runs": runs, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# One decode step's weight products alone, {args.model}, {args.threads} threads", "", f"`{command}`", "",
             *([args.note, ""] if args.note else []),
             "| weights | layers | products ms/token | head ms | ceiling tokens/s |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['bits']} bits | {', '.join(r['kinds'])} | {r['products_ms']:.1f} | {r['head_ms']:.1f} | "
              f"{1e3 / r['products_ms']:.1f} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
