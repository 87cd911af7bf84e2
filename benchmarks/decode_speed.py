"""Decode speed of the compressed cache against transformers' caches, side by side in one run.

    python benchmarks/decode_speed.py --prompt-tokens 1000,7900 --new-tokens 64 --repeats 3 --threads 2

Baselines: ``DynamicCache``, ``StaticCache`` eager and ``StaticCache`` + ``torch.compile`` (Inductor, fullgraph:
what a user who wants speed runs). Ours: h2o 0.2 int4 (and 16-bit) eager and compiled
(:func:`h2o_compress.runtime.compiled.compiled_decode_step`). Every setting runs the package's own path: the prompt
through ``runtime.prefill.feed_prompt`` (ours in chunks of its ``prefill_chunk_size``, as ``generate`` prefills;
transformers' caches in one pass), then the same number of greedy tokens through the package's decode loop
(``runtime.decode_loop.fixed_steps``) with each setting's step; settings are interleaved round-robin
``repeats`` times and the median decode time is reported. Compilation happens in a warm-up run per setting and
length (a fresh compile per length), outside the timings (its seconds are reported). "ours eager" is what the CLI
runs by default on CPU: the decode step of each layer is one call of the CPU kernel (``attention/cpu_decode.c``). Writes ``--out`` (JSON) and the same path with ``.md``
(a markdown table), and prints the table; ratios are against the best of the three baselines at each length.
The prefill column "x prefill baseline" is the median over the repeats of each repeat's prefill seconds over the
``--prefill-baseline`` setting's in the same round (fair when another job loads the machine unevenly):

    python benchmarks/decode_speed.py --prompt-tokens 7900 --new-tokens 2 --repeats 3 --warmup 0 \
        --settings "StaticCache eager,ours h2o 0.2 int4 eager" --out benchmarks/results/prefill_7900_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import time
from pathlib import Path

import sys

import torch
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers.common import transformers_cache_bytes  # noqa: E402  (every tensor a transformers cache holds)

from h2o_compress import CompressedCache, CompressionConfig, load_model, make_cache  # noqa: E402
from h2o_compress.runtime.compiled import compiled_decode_step, decode_step  # noqa: E402
from h2o_compress.runtime.decode_loop import fixed_steps, greedy  # noqa: E402
from h2o_compress.runtime.prefill import feed_prompt  # noqa: E402

BASELINES = ("DynamicCache", "StaticCache eager", "StaticCache + compile")
SETTINGS = {  # name: (cache kind or CompressionConfig, compiled)
    "DynamicCache": ("dynamic", False),
    "StaticCache eager": ("static", False),
    "StaticCache + compile": ("static", True),
    "ours h2o 0.2 int4 eager": (CompressionConfig(budget=0.2, kv_bits=4), False),
    "ours h2o 0.2 int4 compiled": (CompressionConfig(budget=0.2, kv_bits=4), True),
    "ours h2o 0.2 int4 adaptive heads eager": (CompressionConfig(budget=0.2, kv_bits=4, head_budgets="adaptive"), False),
    "ours h2o 0.2 int4 adaptive heads torch form": (
        CompressionConfig(budget=0.2, kv_bits=4, head_budgets="adaptive", attention_kernel="torch"), False),
    "ours vatp 0.2 int4 eager": (CompressionConfig(policy="vatp", budget=0.2, kv_bits=4), False),
    # the calibration shipped for SmolLM2 (h2o_compress/data/calibration): issue 46's cost bound, <= 1.1x h2o's time
    "ours calibrated 0.2 int4 eager": (CompressionConfig(policy="calibrated", budget=0.2, kv_bits=4), False),
    "ours calibrated 0.2 int4 compiled": (CompressionConfig(policy="calibrated", budget=0.2, kv_bits=4), True),
}


def make(model, kind, length: int):
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=length)
    return make_cache(model, kind, max_length=length)


def kv_bytes(cache) -> int:
    """The cache's own byte count: ours ``cache.nbytes()``, a transformers cache every tensor it holds."""
    return cache.nbytes() if isinstance(cache, CompressedCache) else transformers_cache_bytes(cache)


def compiled_baseline_step():
    """StaticCache + compile: ``decode_step`` under ``torch.compile`` (Inductor, fullgraph), its growing 2D mask
    marked dynamic so one graph serves every length (what a transformers user compiles; ours compiles through
    ``compiled_decode_step``, which takes no mask)."""
    compiled = torch.compile(decode_step, fullgraph=True)

    def step(model, token, cache, positions, mask):
        torch._dynamo.mark_dynamic(mask, 1)
        return compiled(model, token, cache, positions, mask)

    return step


@torch.inference_mode()
def run_once(model, prompt: torch.Tensor, new_tokens: int, kind, step) -> dict:
    """The package's prefill (``feed_prompt``) + ``new_tokens`` greedy steps of its decode loop
    (``fixed_steps``) through ``step``; seconds and the cache's bytes."""
    length = prompt.shape[1] + new_tokens + 1
    cache = make(model, kind, length)
    start = time.perf_counter()
    token = greedy(feed_prompt(model, prompt, cache))
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in fixed_steps(step, model, cache, token, prompt.shape[1], new_tokens):
        pass
    decode_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_s": decode_s, "kv_bytes": kv_bytes(cache)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", default="1000,7900", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of the settings")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs per setting and length before the timed ones (compiled settings need 1)")
    parser.add_argument("--prefill-baseline", default="StaticCache eager",
                        help="the setting each prefill is compared with, repeat by repeat")
    parser.add_argument("--out", default="benchmarks/results/decode_speed_cpu.json")
    parser.add_argument("--note", default="", help="a line for the markdown (e.g. the machine's load during the run)")
    args = parser.parse_args()
    command = "python benchmarks/decode_speed.py " + " ".join(
        f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items() if k != "note")
    torch.set_num_threads(args.threads)
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; allowed: {', '.join(SETTINGS)}")
    model, tokenizer = load_model(args.model, device="cpu")
    vocab = tokenizer.vocab_size
    rows = []
    for tokens in [int(t) for t in args.prompt_tokens.split(",")]:
        # One compiled function per setting and length, compiled afresh: reusing one across lengths would
        # recompile it with dynamic buffer sizes (Dynamo's automatic dynamic shapes), a slower graph.
        torch._dynamo.reset()
        steps = {}
        for name in names:
            ours, compiled = isinstance(SETTINGS[name][0], CompressionConfig), SETTINGS[name][1]
            steps[name] = (decode_step if not compiled else compiled_decode_step(model, "cpu") if ours
                           else compiled_baseline_step())
        prompt = torch.randint(100, vocab - 100, (1, tokens), generator=torch.Generator().manual_seed(0))
        warm = {}
        for name in names:  # warm-up (and compile) on this length, outside the timings
            # the timed runs' own length: a budget fraction of another length gives another capacity, so other
            # buffer sizes, which would recompile the step inside the first timed run (with dynamic sizes)
            start = time.perf_counter()
            for _ in range(args.warmup):
                run_once(model, prompt, args.new_tokens, SETTINGS[name][0], steps[name])
            warm[name] = time.perf_counter() - start
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(run_once(model, prompt, args.new_tokens, SETTINGS[name][0], steps[name]))
                print(f"{tokens} tokens, {name}: prefill {runs[name][-1]['prefill_s']:.2f} s", flush=True)
        speed = {n: args.new_tokens / statistics.median(r["decode_s"] for r in runs[n]) for n in names}
        best = max((speed[n] for n in BASELINES if n in speed), default=None)
        base = runs.get(args.prefill_baseline)
        for name in names:
            ratios = None if base is None else [r["prefill_s"] / b["prefill_s"] for r, b in zip(runs[name], base)]
            rows.append({
                "prompt_tokens": tokens, "setting": name, "decode_tokens_per_s": speed[name],
                "vs_best_baseline": None if best is None else speed[name] / best,
                "prefill_s": statistics.median(r["prefill_s"] for r in runs[name]),
                "prefill_vs_baseline": None if ratios is None else statistics.median(ratios),
                "prefill_runs_s": [r["prefill_s"] for r in runs[name]], "prefill_ratios": ratios,
                "warmup_s": warm[name], "kv_bytes": runs[name][-1]["kv_bytes"],
            })
    title = f"Decode speed, {args.model}, {args.new_tokens} new tokens, {args.threads} threads (CPU)"
    table = Table(title=title)
    columns = ("prompt", "setting", "decode tok/s", "x best baseline", "prefill s", "x prefill baseline",
               "warm-up s", "KV MiB")
    for column in columns:
        table.add_column(column, justify="left" if column == "setting" else "right")
    lines = [f"# {title}", "", f"`{command}`", ""] + ([args.note, ""] if args.note else [])
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [str(row["prompt_tokens"]), row["setting"], f"{row['decode_tokens_per_s']:.1f}",
                 "-" if row["vs_best_baseline"] is None else f"{row['vs_best_baseline']:.2f}",
                 f"{row['prefill_s']:.2f}",
                 "-" if row["prefill_vs_baseline"] is None else f"{row['prefill_vs_baseline']:.2f}",
                 f"{row['warmup_s']:.1f}", f"{row['kv_bytes'] / 2**20:.2f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": command,
        "args": vars(args), "rows": rows, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "processor": platform.processor(), "cpus": __import__("os").cpu_count(),
    }, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
