"""What a chunked prefill costs (issue 49): prefill time and peak RSS growth of a long prompt fed in one pass vs in
chunks of ``prefill_chunk_size`` tokens, on the real SmolLM2, through `h2o_compress.runtime.prefill.prefill`.

    python benchmarks/prefill_chunks.py --prompt-tokens 7900 --chunks 0,512,1024,2048,4096 --repeats 2 --threads 1

The prompt is the first ``--prompt-tokens`` tokens of the tuning text (``h2o_compress/data/sherlock_holmes.txt``).
Settings: h2o 0.2 int4 and uncompressed (budget 1.0, 16 bits), each with every chunk size (``0``: one pass). Every
(setting, chunk) runs once per round, rounds interleaved (``--repeats``), and the best time is reported with its
ratio to the same setting's one-pass best. The cache is built as ``generate`` builds it (``decode_speed.make``:
``max_length`` = prompt + 1). Peak RSS growth: ``VmHWM`` restarted before each prefill, less the resident set then
(`h2o_compress.utils.memory.PeakMemory`), after ``malloc_trim``; the largest of the runs (allocator reuse makes a
single reading low). The chosen default is the smallest chunk whose time is at most ``--within`` x the one-pass time
for every setting. Writes ``--out`` (JSON) and the same path with ``.md``, and prints the table.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from h2o_compress import CompressionConfig, load_model
from h2o_compress.evaluation import default_corpus
from h2o_compress.runtime.prefill import prefill
from h2o_compress.utils.memory import PeakMemory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import make  # noqa: E402

SETTINGS = {
    "h2o 0.2 int4": CompressionConfig(budget=0.2, kv_bits=4),
    "uncompressed": CompressionConfig(),
}


def trim() -> None:
    """Give freed heap pages back to the system (glibc), so that a run's RSS growth is its own."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@torch.inference_mode()
def run_once(model, prompt: torch.Tensor, config: CompressionConfig, chunk: int) -> dict:
    """One prefill of ``prompt`` ``[1, tokens]`` with ``prefill_chunk_size=chunk``: seconds and peak RSS growth."""
    cache = make(model, dataclasses.replace(config, prefill_chunk_size=chunk), prompt.shape[1] + 1)
    trim()
    window = PeakMemory()
    start = time.perf_counter()
    prefill(model, prompt, cache)
    seconds = time.perf_counter() - start
    peak, kind = window.measure()
    return {"seconds": seconds, "peak_rss_growth": peak, "peak_kind": kind}


def measure(model, prompt, names, chunks, repeats) -> list[dict]:
    """Every (setting, chunk) once per round, ``repeats`` rounds, after one untimed 64-token prefill per setting;
    one row per pair (best time, largest peak)."""
    runs = {(name, chunk): [] for name in names for chunk in chunks}
    for name in names:  # untimed: the native kernels' first load, the allocator's first arenas
        run_once(model, prompt[:, :64], SETTINGS[name], 0)
    for _ in range(repeats):
        for name in names:
            for chunk in chunks:
                run = run_once(model, prompt, SETTINGS[name], chunk)
                runs[name, chunk].append(run)
                print(f"{name}, chunk {chunk or 'one pass'}: {run['seconds']:.2f} s, peak RSS +"
                      f"{run['peak_rss_growth'] / 2**20:.0f} MiB", flush=True)
    rows = []
    for (name, chunk), done in runs.items():
        one_pass = min(r["seconds"] for r in runs[name, 0])
        best = min(r["seconds"] for r in done)
        rows.append({"setting": name, "chunk": chunk, "seconds": best, "vs_one_pass": best / one_pass,
                     "runs_s": [r["seconds"] for r in done],
                     "peak_rss_growth": max(r["peak_rss_growth"] for r in done), "peak_kind": done[0]["peak_kind"]})
    return rows


def choose(rows: list[dict], within: float) -> int | None:
    """The smallest chunk (not one pass) whose time is at most ``within`` x the one-pass time for every setting."""
    chunks = sorted({r["chunk"] for r in rows if r["chunk"]})
    return next((c for c in chunks if all(r["vs_one_pass"] <= within for r in rows if r["chunk"] == c)), None)


def render(rows: list[dict], title: str, command: str, chosen: int | None, within: float) -> str:
    """Print the table; return it as markdown."""
    columns = ("setting", "chunk", "prefill s (best)", "x one pass", "runs s", "peak RSS growth MiB")
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == "setting" else "right")
    lines = [f"# {title}", "", f"`{command}`", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [row["setting"], str(row["chunk"] or "one pass"), f"{row['seconds']:.2f}", f"{row['vs_one_pass']:.3f}",
                 ", ".join(f"{s:.2f}" for s in row["runs_s"]), f"{row['peak_rss_growth'] / 2**20:.0f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    verdict = (f"Chosen default: {chosen} tokens, the smallest chunk at most {within}x the one-pass time in every "
               "setting." if chosen else f"No chunk size was within {within}x of one pass in every setting.")
    print(verdict)
    return "\n".join(lines + ["", verdict]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=7900)
    parser.add_argument("--chunks", default="0,512,1024,2048,4096", help="comma-separated chunk sizes; 0: one pass")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {list(SETTINGS)}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--within", type=float, default=1.05, help="the chosen chunk's largest time over one pass")
    parser.add_argument("--out", default="benchmarks/results/prefill_chunks_cpu.json")
    args = parser.parse_args()
    command = "python benchmarks/prefill_chunks.py " + " ".join(
        f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items())
    torch.set_num_threads(args.threads)
    chunks = sorted({int(c) for c in args.chunks.split(",")} | {0})
    names = [n for n in args.settings.split(",") if n]
    if any(n not in SETTINGS for n in names):
        parser.error(f"unknown settings in {names}; allowed: {', '.join(SETTINGS)}")
    model, tokenizer = load_model(args.model, device="cpu")
    prompt = tokenizer(default_corpus(), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    rows = measure(model, prompt, names, chunks, args.repeats)
    chosen = choose(rows, args.within)
    title = f"Chunked prefill, {args.model}, {prompt.shape[1]} prompt tokens, {args.threads} thread(s) (CPU)"
    markdown = render(rows, title, command, chosen, args.within)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": command, "args": vars(args), "prompt_tokens": prompt.shape[1], "rows": rows, "chosen": chosen,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "processor": platform.processor(), "cpus": __import__("os").cpu_count(),
    }, indent=2))
    out.with_suffix(".md").write_text(markdown)
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
