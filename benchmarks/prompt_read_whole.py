"""What reading a prompt whole costs (``lookahead``, the commands' default: the prompt read in chunks into an
uncompressed cache, then its last token and 31 answer tokens vote) against evicting it chunk by chunk (``h2o``, the
default before it): prefill seconds and peak memory of one ``generate`` call, each in a fresh
process, the settings alternating, on the real SmolLM2 (CPU default weights) at budget 0.2 + 4 bits.

    python benchmarks/prompt_read_whole.py --tokens 1536,7900 --repeats 2 --threads 2

The prompt is the start of a reporting text cut to ``--tokens`` with a question after it. Prints a table and
writes ``--out`` (JSON) and the same path with ``.md``; the CPU model and its vector features go beside the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

POLICIES = ("h2o", "lookahead")


def worker(policy: str, tokens: int, threads: int, text: str) -> dict:
    """One ``generate`` call in this process: its prefill seconds, the peak resident-set growth after the load
    and a warm-up call, and the KV bytes after the prompt."""
    import torch

    from h2o_compress import CompressionConfig, generate, load_model
    from h2o_compress.evaluation import reporting_text
    from h2o_compress.utils.memory import PeakMemory

    torch.set_num_threads(threads)
    model, tokenizer = load_model()
    ids = tokenizer(reporting_text(text), add_special_tokens=False).input_ids[:tokens]
    prompt = tokenizer.decode(ids) + "\n\nWhat is the text above about?"
    config = CompressionConfig(policy=policy, budget=0.2, kv_bits=4)
    generate(model, tokenizer, "Warm up.", config, max_new_tokens=2)
    peak = PeakMemory()
    result = generate(model, tokenizer, prompt, config, max_new_tokens=1)
    grown, kind = peak.measure()
    return {"policy": policy, "tokens": result.prompt_tokens, "prefill_s": result.prefill_s, "peak_bytes": grown,
            "peak_kind": kind, "kv_bytes": result.kv_bytes, "kv_bytes_full_fp16": result.kv_bytes_full_fp16}


def cpu_name() -> str:
    """The CPU model and its widest vector features (from /proc/cpuinfo)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    features = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model} ({', '.join(features) or 'no AVX2'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1536,7900")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", default="persuasion", help="A reporting text by name.")
    parser.add_argument("--worker", nargs=2, metavar=("POLICY", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/prompt_read_whole/prefill_cost.json")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.threads, args.text)))
        return
    runs = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for _ in range(args.repeats):
            for policy in POLICIES:
                done = subprocess.run([sys.executable, __file__, "--worker", policy, str(tokens), "--threads",
                                       str(args.threads), "--text", args.text], capture_output=True, text=True,
                                      check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(runs[-1], flush=True)
    rows = []
    for tokens in sorted({r["tokens"] for r in runs}):
        cell = {p: [r for r in runs if r["tokens"] == tokens and r["policy"] == p] for p in POLICIES}
        prefill = {p: statistics.median(r["prefill_s"] for r in cell[p]) for p in POLICIES}
        peak = {p: statistics.median(r["peak_bytes"] for r in cell[p]) for p in POLICIES}
        share = cell["lookahead"][0]["kv_bytes"] / cell["lookahead"][0]["kv_bytes_full_fp16"]
        rows.append({"tokens": tokens, "prefill_s": prefill, "peak_bytes": peak,
                     "prefill_ratio": prefill["lookahead"] / prefill["h2o"], "kv_share_of_fp16": share})
    command = "python benchmarks/prompt_read_whole.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k not in ("out", "worker"))
    lines = ["# Reading a prompt whole (lookahead) vs evicting it chunk by chunk (h2o), SmolLM2-135M, 0.2 + 4 bits",
             "", f"CPU: {cpu_name()}, {args.threads} threads; median of {args.repeats} fresh processes per cell.", "",
             "| prompt tokens | h2o prefill s | lookahead prefill s | lookahead / h2o | h2o peak MiB | lookahead peak MiB"
             " | KV after the prompt, % of fp16 |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['tokens']:,} | {row['prefill_s']['h2o']:.2f} | {row['prefill_s']['lookahead']:.2f} | "
                     f"{row['prefill_ratio']:.2f}x | {row['peak_bytes']['h2o'] / 2**20:.0f} | "
                     f"{row['peak_bytes']['lookahead'] / 2**20:.0f} | {100 * row['kv_share_of_fp16']:.1f}% |")
    lines += ["", "Peak: the resident set's growth during the call, above what the load and a warm-up call left.",
              "", f"`{command}`"]
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "cpu": cpu_name(), "rows": rows, "runs": runs}, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
