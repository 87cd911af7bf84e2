"""Does compression cost a short prompt its answer? The floor of a fractional budget (``--min-capacity``).

    python benchmarks/short_prompts.py --phase choose    # the tuning prompts: which floor becomes the default
    python benchmarks/short_prompts.py --phase report    # 50 short instructions that chose nothing

Greedy answers of the real SmolLM2 at ``h2o`` 0.2 + 4 bits (the README's main job; every other option at
``generate``'s defaults, 128 new tokens) against the uncompressed cache with the same quantization
(``policy="full"`` + 4 bits). ``choose`` runs the 8 tuning prompts (``h2o_compress/data/prompts.json``) through
``generate`` at each floor of ``--floors``; ``report`` runs the 50 instructions of
``benchmarks/data/short_instructions.json`` (written for this benchmark, never used to choose a setting) through
``generate`` one at a time and through ``generate_batch`` (``batch``'s defaults: groups of 8) at the default floor.
Per row: prompts whose first 16 new tokens equal the reference's, the mean length of the common prefix, the
answers equal in full, and the KV bytes. Prints a table and writes ``--out`` (JSON) and the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from h2o_compress import CompressionConfig, generate, generate_batch, load_model
from h2o_compress.config import DEFAULT_MIN_CAPACITY

ROOT = Path(__file__).resolve().parent.parent
TUNING = ROOT / "h2o_compress" / "data" / "prompts.json"
REPORTING = ROOT / "benchmarks" / "data" / "short_instructions.json"
COMPRESSED = CompressionConfig(policy="h2o", budget=0.2, kv_bits=4)
REFERENCE = CompressionConfig(policy="full", kv_bits=4)
FIRST = 16  # new tokens compared for the "first 16 equal" count


def answers_one_by_one(model, tokenizer, prompts, config, max_new_tokens, progress, task) -> list[dict]:
    """Each prompt through ``generate`` alone: its new token ids and KV bytes."""
    rows = []
    for prompt in prompts:
        result = generate(model, tokenizer, prompt, config, max_new_tokens=max_new_tokens)
        rows.append({"token_ids": list(result.token_ids), "kv_bytes": result.kv_bytes, "capacity": result.capacity})
        progress.advance(task)
    return rows


def answers_in_batch(model, tokenizer, prompts, config, max_new_tokens, progress, task) -> list[dict]:
    """All prompts through ``generate_batch`` (groups of 8, ``batch``'s default): new token ids in input order."""
    run = generate_batch(model, tokenizer, prompts, config, max_new_tokens=max_new_tokens, batch_size=8, in_order=True)
    rows = []
    for result in run:
        rows.append({"token_ids": list(result.token_ids), "kv_bytes": run.stats.kv_bytes_per_sequence})
        progress.advance(task)
    return rows


def agreement(rows: list[dict], reference: list[dict]) -> dict:
    """How far each row's answer follows the reference's: first-16 matches, mean common prefix, whole answers."""
    prefixes, first, whole = [], 0, 0
    for row, ref in zip(rows, reference):
        a, b = row["token_ids"], ref["token_ids"]
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(common)
        first += common >= min(FIRST, len(b))
        whole += a == b
    return {"first16_equal": first, "prompts": len(rows), "mean_common_prefix": sum(prefixes) / len(rows),
            "whole_equal": whole, "kv_bytes_mean": sum(r["kv_bytes"] for r in rows) / len(rows)}


def run_rows(model, tokenizer, prompts, settings: dict, max_new_tokens: int) -> dict:
    """Every setting of ``settings`` (name: (runner, config)) on ``prompts``; the reference of each runner first."""
    out, references = {}, {}
    with Progress(console=Console(stderr=True)) as progress:
        for name, (runner, config) in settings.items():
            task = progress.add_task(name, total=len(prompts))
            start = time.perf_counter()
            rows = runner(model, tokenizer, prompts, config, max_new_tokens, progress, task)
            seconds = time.perf_counter() - start
            if runner not in references:
                references[runner] = rows
            out[name] = {**agreement(rows, references[runner]), "seconds": seconds, "config": config.to_dict(),
                         "answers": [r["token_ids"] for r in rows]}
    return out


def settings_for(phase: str, floors: list[int]) -> dict:
    """The rows of a phase: name -> (runner, config); each runner's first row is its reference."""
    if phase == "choose":
        rows = {"reference: full + 4 bits": (answers_one_by_one, REFERENCE)}
        rows.update({f"h2o 0.2 + 4 bits, floor {f}": (answers_one_by_one, replace(COMPRESSED, min_capacity=f))
                     for f in floors})
        return rows
    return {
        "generate: full + 4 bits (reference)": (answers_one_by_one, REFERENCE),
        f"generate: h2o 0.2 + 4 bits (floor {DEFAULT_MIN_CAPACITY})": (answers_one_by_one, COMPRESSED),
        "generate: h2o 0.2 + 4 bits, floor 0 (before)": (answers_one_by_one, replace(COMPRESSED, min_capacity=0)),
        "batch: full + 4 bits (reference)": (answers_in_batch, REFERENCE),
        f"batch: h2o 0.2 + 4 bits (floor {DEFAULT_MIN_CAPACITY})": (answers_in_batch, COMPRESSED),
        "batch: h2o 0.2 + 4 bits, floor 0 (before)": (answers_in_batch, replace(COMPRESSED, min_capacity=0)),
    }


def write_table(results: dict, args, out: Path) -> None:
    """The table on the console and as ``out`` with ``.md``; the JSON at ``out``."""
    table = Table(title=f"{args.phase}: greedy answers against the uncompressed cache with the same quantization")
    for column in ("setting", f"first {FIRST} equal", "mean common prefix", "whole answer equal", "KV bytes",
                   "seconds"):
        table.add_column(column)
    lines = [f"# short prompts, phase `{args.phase}`", "", f"Command: `python benchmarks/short_prompts.py "
             f"--phase {args.phase}{' --floors ' + args.floors if args.phase == 'choose' else ''}` "
             f"({args.max_new_tokens} new tokens, greedy, SmolLM2-135M, CPU)", "",
             f"| setting | first {FIRST} equal | mean common prefix (tokens) | whole answer equal | KV bytes | s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        cells = (name, f"{r['first16_equal']}/{r['prompts']}", f"{r['mean_common_prefix']:.1f}",
                 f"{r['whole_equal']}/{r['prompts']}", f"{r['kv_bytes_mean']:,.0f}", f"{r['seconds']:.0f}")
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("choose", "report"), required=True)
    parser.add_argument("--floors", default="0,32,64,96,128,192,256", help="choose: the floors tried (tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = json.loads((TUNING if args.phase == "choose" else REPORTING).read_text())
    floors = [int(f) for f in args.floors.split(",")]
    model, tokenizer = load_model()
    results = run_rows(model, tokenizer, prompts, settings_for(args.phase, floors), args.max_new_tokens)
    write_table(results, args, args.out or ROOT / "benchmarks" / "results" / f"short_prompts_{args.phase}.json")


if __name__ == "__main__":
    main()
