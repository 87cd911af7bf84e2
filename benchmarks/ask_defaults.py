"""Which settings win on the compress-then-ask protocol (the defaults of ``h2o-compress ask``)?

    python benchmarks/ask_defaults.py --lengths 1024 --trials 3 --budget 0.2 --kv-bits 4

Passkey retrieval on the real SmolLM2 with the haystack compressed before the question is read
(:func:`h2o_compress.evaluation.needle.needle_eval` with ``protocol="compress-then-ask"``), the same prompts for
every setting (same seed), at one budget and bit width: policies h2o / h2o-mean / snapkv / tova / strided at heavy
ratio 0.5 and 0.9, kvzip and lookahead at 0.9, h2o 0.9 with pyramid layer budgets, and the uncompressed reference. Prints a table and writes
``--out`` (JSON) and the same path with ``.md``. ``--settings`` picks some of them, ``--head-budgets
uniform,adaptive`` runs each with both head budgets (Ada-KV), ``--no-reference`` skips the uncompressed run,
``--high-bits-fraction F`` keeps that share at 8 bits, ``--protocol question-in-prompt`` asks with the question
inside the prompt instead (the plain generate path; ``benchmarks/results/passkey_cpu.md``), ``--text-file`` takes
the haystack from other prose, ``--keys N`` plants N numbered passkeys in each haystack and asks for each in its own
question from the same compressed context (accuracy per key in the table). The JSON keeps every trial, and ``OUT.partial.json`` is rewritten after each setting.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from h2o_compress import CompressionConfig, load_model
from h2o_compress.evaluation.corpus import load_text
from h2o_compress.evaluation.needle import needle_eval

SETTINGS = {  # name: CompressionConfig fields besides budget and bits
    "h2o 0.5": {"policy": "h2o", "heavy_ratio": 0.5},
    "h2o 0.9": {"policy": "h2o", "heavy_ratio": 0.9},
    "h2o-mean 0.5": {"policy": "h2o-mean", "heavy_ratio": 0.5},
    "h2o-mean 0.9": {"policy": "h2o-mean", "heavy_ratio": 0.9},
    "snapkv 0.5": {"policy": "snapkv", "heavy_ratio": 0.5},
    "snapkv 0.9": {"policy": "snapkv", "heavy_ratio": 0.9},
    "tova 0.5": {"policy": "tova", "heavy_ratio": 0.5},
    "tova 0.9": {"policy": "tova", "heavy_ratio": 0.9},
    "strided 0.9": {"policy": "strided", "heavy_ratio": 0.9},
    "kvzip 0.9": {"policy": "kvzip", "heavy_ratio": 0.9},
    "lookahead 0.5": {"policy": "lookahead", "heavy_ratio": 0.5},
    "lookahead 0.9": {"policy": "lookahead", "heavy_ratio": 0.9},
    "calibrated 0.5": {"policy": "calibrated", "heavy_ratio": 0.5},
    "h2o 0.9 pyramid": {"policy": "h2o", "heavy_ratio": 0.9, "layer_budgets": "pyramid"},
    "kvzip 0.9 global": {"policy": "kvzip", "heavy_ratio": 0.9, "layer_budgets": "global"},
    "lookahead 0.9 global": {"policy": "lookahead", "heavy_ratio": 0.9, "layer_budgets": "global"},
    "kvzip 1 sinks4 global": {"policy": "kvzip", "heavy_ratio": 1.0, "sink_tokens": 4, "layer_budgets": "global"},
    "kvzip 0.99 sinks4 global": {"policy": "kvzip", "heavy_ratio": 0.99, "sink_tokens": 4, "layer_budgets": "global"},
    "kvzip 1 sinks4 global evict-header": {"policy": "kvzip", "heavy_ratio": 1.0, "sink_tokens": 4,
                                           "layer_budgets": "global", "evict_chat_header": True},
}
#: The default grid (the one results/ask_defaults.md was measured on); the other SETTINGS are picked by --settings.
DEFAULT_SETTINGS = ("h2o 0.5", "h2o 0.9", "h2o-mean 0.9", "snapkv 0.9", "tova 0.9", "strided 0.9", "kvzip 0.9",
                    "h2o 0.9 pyramid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--kv-bits", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help="Names of SETTINGS, comma-separated (default: DEFAULT_SETTINGS).")
    parser.add_argument("--head-budgets", default="uniform", help="uniform, adaptive or both, comma-separated.")
    parser.add_argument("--no-reference", action="store_true", help="Skip the uncompressed run.")
    parser.add_argument("--protocol", default="compress-then-ask", help="compress-then-ask or question-in-prompt.")
    parser.add_argument("--high-bits-fraction", type=float, default=0.0, help="Share of stored tokens at 8 bits.")
    parser.add_argument("--text-file", default=None, help="Prose for the haystack (default: the shipped corpus).")
    parser.add_argument("--keys", type=int, default=1, help="Passkeys per haystack, each asked for on its own.")
    parser.add_argument("--out", default="benchmarks/results/ask_defaults.json")
    args = parser.parse_args()
    unknown = [name for name in args.settings.split(",") if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; allowed: {', '.join(SETTINGS)}")
    grid = [(name + ("" if heads == "uniform" else f" {heads} heads"), {**SETTINGS[name], "head_budgets": heads})
            for name in args.settings.split(",") for heads in args.head_budgets.split(",")]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device="cpu")
    corpus = load_text(args.text_file)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    depths = tuple(float(x) for x in args.depths.split(","))
    rows, started = [], time.perf_counter()
    with Progress() as progress:
        task = progress.add_task("settings", total=len(grid))
        for index, (name, fields) in enumerate(grid):
            config = CompressionConfig(budget=args.budget, kv_bits=args.kv_bits,
                                       high_bits_fraction=args.high_bits_fraction, **fields)
            result = needle_eval(model, tokenizer, config, lengths, depths, args.trials, args.seed,
                                 reference=index == 0 and not args.no_reference, protocol=args.protocol,
                                 corpus=corpus, keys=args.keys)
            per_key = result.per_key if args.keys > 1 else {}
            rows.append({"setting": name, "config": config.to_dict(), "right": result.overall("compressed"),
                         "per_key": per_key.get("compressed"),
                         "kv_bytes": sum(t.kv_bytes for t in result.trials if t.setting == "compressed")
                         / max(1, sum(t.setting == "compressed" for t in result.trials)),
                         "trials": [t for t in result.to_dict()["trials"] if t["setting"] == "compressed"]})
            if index == 0 and not args.no_reference:
                rows.insert(0, {"setting": "uncompressed", "config": None, "right": result.overall("reference"),
                                "per_key": per_key.get("reference"), "kv_bytes": None})
            progress.advance(task)
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(rows, indent=2))  # survives a kill
    title = (f"{args.protocol} passkey accuracy, {args.model}, budget {args.budget:g} of the context, "
             f"{args.kv_bits}-bit, lengths {args.lengths}, {len(depths)} depths x {args.trials} trials")
    table = Table(title=title)
    key_columns = [f"key {k}" for k in range(1, args.keys + 1)] if args.keys > 1 else []
    columns = ("setting", "right", *key_columns, "KV MiB answering")
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for column in columns:
        table.add_column(column)
    for row in rows:
        keyed = [f"{row['per_key'][k]:.2f}" for k in range(1, args.keys + 1)] if key_columns else []
        cells = [row["setting"], f"{row['right']:.2f}", *keyed,
                 "-" if row["kv_bytes"] is None else f"{row['kv_bytes'] / 2**20:.2f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/ask_defaults.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
        for k, v in vars(args).items() if k != "out" and v is not False)
    out.write_text(json.dumps({"command": command, "rows": rows, "minutes": (time.perf_counter() - started) / 60},
                              indent=2))
    out.with_suffix(".md").write_text("\n".join(lines + ["", f"`{command}`"]) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
