"""Where a CPU decode step's time goes (issue 50, Build item 4): the share spent in the weights' matrix products, in
the attention kernel, and outside both (the per-layer Python, norms, rotary embedding, casts and small ops).

    python benchmarks/cpu_step_profile.py --prompt-tokens 1000 --steps 300 --threads 1

Runs ``--steps`` greedy decode steps of SmolLM2 (CPU defaults: int8 weights, h2o 0.2 + int4 KV, eager, the native
attention kernel) after a ``--prompt-tokens`` prompt of the tuning text, under ``py-spy record --native`` (a
sampling profiler, ``pip install py-spy``; a benchmark dependency, not the package's), in a child process. Of the
samples inside the decode step, a sample counts as:

- *weights*: its native stack is in torch's packed int8 product (``_weight_int8pack_mm``) or another matrix product
  (BLAS ``gemm``, ``addmm``);
- *attention*: in the native decode kernel (``cpu_decode.c``: attention, scores, eviction in one call);
- *outside*: anything else (Python between kernels, RMSNorm, rotary, dtype casts, dispatch).

Also lists the Python lines that hold the most *outside* samples. Writes ``--out`` (JSON) and the same path with
``.md``, the command beside the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, time, torch
sys.path.insert(0, {bench!r})
from decode_speed import make
from h2o_compress import CompressionConfig, load_model
from h2o_compress.evaluation import default_corpus
from h2o_compress.runtime.compiled import decode_step
torch.set_num_threads({threads})
model, tok = load_model(device="cpu")
ids = tok(default_corpus(), add_special_tokens=False, return_tensors="pt").input_ids[:, :{prompt}]
with torch.inference_mode():
    cache = make(model, CompressionConfig(budget=0.2, kv_bits=4), ids.shape[1] + {steps} + 1)
    logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1]
    seen, start = ids.shape[1], time.perf_counter()
    for _ in range({steps}):
        logits = decode_step(model, logits.argmax(-1, keepdim=True), cache, torch.full((1, 1), seen), None)
        seen += 1
    print("TOKENS_PER_S", {steps} / (time.perf_counter() - start))
"""


def category(stack: str) -> str:
    """The share a sample's stack (``;``-joined frames, leaf last) counts in."""
    if "int8pack" in stack or re.search(r"gemm|addmm|mkl_blas|at::native::.*mm_", stack):
        return "weights"
    if "h2o_cpu" in stack or "cpu_decode" in stack:
        return "attention"
    return "outside"


def shares(raw: Path) -> tuple[dict, list, int]:
    """Shares of the decode step's samples and the top *outside* Python lines, from py-spy's raw output."""
    counts, lines, total = collections.Counter(), collections.Counter(), 0
    for row in raw.read_text().splitlines():
        stack, _, n = row.rpartition(" ")
        if "decode_step" not in stack:
            continue
        total += int(n)
        kind = category(stack)
        counts[kind] += int(n)
        if kind == "outside":
            python = [f for f in stack.split(";") if ".py:" in f]
            lines[python[-1] if python else stack.split(";")[-1]] += int(n)
    return ({k: counts[k] / total for k in ("weights", "attention", "outside")},
            [(k, v / total) for k, v in lines.most_common(10)], total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--out", default="benchmarks/results/cpu_step_profile.json")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("py-spy is not installed; allowed: pip install py-spy (a benchmark dependency)")
    with tempfile.TemporaryDirectory() as folder:
        script, raw = Path(folder) / "child.py", Path(folder) / "raw.txt"
        script.write_text(CHILD.format(bench=str(Path(__file__).resolve().parent), threads=args.threads,
                                       prompt=args.prompt_tokens, steps=args.steps))
        done = subprocess.run(["py-spy", "record", "--native", "-r", str(args.rate), "--format", "raw", "-o",
                               str(raw), "--", sys.executable, str(script)], capture_output=True, text=True)
        if done.returncode or not raw.exists():
            sys.exit(f"py-spy failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        share, top, samples = shares(raw)
    speed = float(re.search(r"TOKENS_PER_S ([0-9.]+)", done.stdout).group(1))
    write(args, share, top, samples, speed)


def write(args, share: dict, top: list, samples: int, speed: float) -> None:
    """The JSON and the markdown, with the command."""
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    lines = ["# Where a CPU decode step's time goes (issue 50)\n", f"`{command}`\n",
             f"SmolLM2-135M, CPU defaults (int8 weights, h2o 0.2 + int4 KV, eager), {args.prompt_tokens}-token prompt, "
             f"{args.threads} thread(s): {speed:.1f} tokens/s under the profiler; {samples} samples in the step.\n",
             "| share of the decode step | |", "|---|---:|",
             *(f"| {k} | {v:.1%} |" for k, v in share.items()), "",
             "Python lines holding the most *outside* samples:", "",
             *(f"- {v:.1%} `{k}`" for k, v in top)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "tokens_per_s": speed, "samples": samples, "shares": share,
                               "outside_lines": top}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
