"""Compiling the CPU decode step, three ways, side by side in one run (issue 50, Build item 4).

    python benchmarks/cpu_compile_modes.py --prompt-tokens 1000 --steps 40 --threads 1,2

SmolLM2-135M with the CPU defaults (int8 weights, h2o 0.2 + int4 KV, the native attention kernel). Modes:

- ``eager``: what the CLI runs on CPU by default.
- ``regional``: each decoder layer's call ``torch.compile``d (Inductor, the package's options) and reused by every
  layer (weights as graph inputs, the layer index a symbolic integer: ``allow_unspec_int_on_nn_module``), with the
  cache's ``update`` and the attention function wrapped in ``torch.compiler.disable`` (a graph break each), so the
  native kernel keeps its one call per layer and no per-layer state enters a graph. Compiles in seconds.
- ``whole step``: ``torch.compile(decode_step, fullgraph=True)``, what ``--compile`` runs on CPU.

Each mode and thread count runs in a fresh process (its own Dynamo state), the same prompt, prefill eager; the
median step of ``--steps`` greedy steps (the first three left out) and the first step's seconds (the compile). For
the eager mode the step is also split by where its time goes: the int8 linear layers' calls (casts included), the
native attention kernel's one call per layer, and the rest (wall time inside each, timed by wrappers). Writes ``--out`` (JSON) and the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("eager", "regional", "whole step")
#: Inductor options over the package's own, per whole-step variant (``cpp_wrapper``: the graph's kernels called from
#: generated C++, no Python between them; ``freezing``: weights folded as constants, so oneDNN may prepack them).
WHOLE_STEP_VARIANTS = {
    "whole step": {},
    "whole step cpp": {"cpp_wrapper": True},
    "whole step frozen": {"freezing": True},
    "whole step cpp frozen": {"cpp_wrapper": True, "freezing": True},
    "whole step autotune": {"max_autotune": True, "freezing": True},
}


def regional_step(model):
    """The regional mode's step (see the module docstring): the decoder layers compiled, cache update and attention
    eager between them."""
    import torch
    from transformers import AttentionInterface

    from h2o_compress.attention import interface
    from h2o_compress.cache import CompressedCache
    from h2o_compress.runtime.compiled import INDUCTOR_OPTIONS, decode_step

    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    CompressedCache.update = torch.compiler.disable(CompressedCache.update)
    AttentionInterface.register(interface.ATTENTION_NAME, torch.compiler.disable(interface.h2o_attention_forward))
    for layer in model.model.layers:
        layer.compile(options=dict(INDUCTOR_OPTIONS))
    return decode_step


def step_split(feed, steps: int) -> dict:
    """Where ``steps`` eager steps spend their wall time (fractions): the int8 linear layers' calls (their casts
    included), the native attention kernel's calls, and the rest. Each call is timed by a wrapper (two clock
    reads: well under a microsecond), not by a profiler, whose own overhead would swell the rest."""
    from h2o_compress.attention import cpu
    from h2o_compress.models.int8_linear import Int8Linear

    spent = {"weights": 0.0, "attention": 0.0}
    originals = {"weights": (Int8Linear, "forward"), "attention": (cpu, "_decode")}
    saved = {part: getattr(owner, name) for part, (owner, name) in originals.items()}

    def timer(part):
        function = saved[part]

        def timed(*args):
            start = time.perf_counter()
            out = function(*args)
            spent[part] += time.perf_counter() - start
            return out
        return timed

    for part, (owner, name) in originals.items():
        setattr(owner, name, timer(part))
    start = time.perf_counter()
    try:
        feed(steps)
    finally:
        for part, (owner, name) in originals.items():
            setattr(owner, name, saved[part])
    total = time.perf_counter() - start
    return {"weights": spent["weights"] / total, "attention": spent["attention"] / total,
            "rest": 1 - (spent["weights"] + spent["attention"]) / total}


def measure(mode: str, threads: int, prompt_tokens: int, steps: int) -> dict:
    """One mode in this process: the first step's seconds, the median step's, and (eager) the step's split."""
    import torch

    from h2o_compress import CompressionConfig, load_model, make_cache
    from h2o_compress.evaluation.corpus import default_corpus
    from h2o_compress.runtime.compiled import INDUCTOR_OPTIONS, decode_step

    torch.set_num_threads(threads)
    model, tokenizer = load_model("smollm2-135m")
    ids = tokenizer(default_corpus(), return_tensors="pt").input_ids[:, :prompt_tokens]
    if mode in WHOLE_STEP_VARIANTS:
        step = torch.compile(decode_step, fullgraph=True, options={**INDUCTOR_OPTIONS, **WHOLE_STEP_VARIANTS[mode]})
    else:
        step = {"eager": lambda: decode_step, "regional": lambda: regional_step(model)}[mode]()
    with torch.inference_mode():
        cache = make_cache(model, CompressionConfig(budget=0.2, kv_bits=4), max_length=prompt_tokens + 2 * steps + 8)
        state = {"logits": model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1],
                 "seen": ids.shape[1]}
        times = []

        def feed(count: int) -> None:
            for _ in range(count):
                token = state["logits"].argmax(-1, keepdim=True)
                start = time.perf_counter()
                state["logits"] = step(model, token, cache, torch.full((1, 1), state["seen"], dtype=torch.long))
                times.append(time.perf_counter() - start)
                state["seen"] += 1

        feed(steps)
        result = {"mode": mode, "threads": threads, "first_step_s": times[0],
                  "step_ms": statistics.median(times[3:]) * 1000}
        if mode == "eager":
            result["split"] = step_split(feed, steps // 2)
    return result


def table(results: list[dict], command: str, note: str) -> str:
    eager = {r["threads"]: r["step_ms"] for r in results if r["mode"] == "eager"}
    lines = ["# The CPU decode step compiled three ways (issue 50)", "", f"`{command}`", "", note, "",
             "| mode | threads | first step s (compile) | ms / step | tokens/s | x eager |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = eager[r["threads"]] / r["step_ms"] if r["threads"] in eager else float("nan")
        lines.append(f"| {r['mode']} | {r['threads']} | {r['first_step_s']:.1f} | {r['step_ms']:.1f} | "
                     f"{1000 / r['step_ms']:.1f} | {ratio:.2f} |")
    for r in results:
        if "split" in r:
            s = r["split"]
            lines.append(f"\nEager step at {r['threads']} thread(s): int8 linear layers (their casts included) {s['weights']:.0%}, attention "
                         f"kernel {s['attention']:.0%}, the rest (norms, rotary, casts, Python) {s['rest']:.0%}.")
    return "\n".join(lines) + "\n"


def run_rounds(args) -> list[dict]:
    """``args.repeats`` rounds over every mode and thread count, each run a fresh process, the order rotated
    between rounds; per mode and thread count the median step, the median first step and the eager split."""
    runs: dict[tuple[str, int], list[dict]] = {}
    order = [(mode, int(t)) for t in args.threads.split(",") for mode in args.modes.split(",")]
    for round_ in range(args.repeats):
        for mode, threads in order[round_ % len(order):] + order[:round_ % len(order)]:
            command = [sys.executable, __file__, "--one", f"{mode}:{threads}", "--prompt-tokens",
                       str(args.prompt_tokens), "--steps", str(args.steps)]
            env = dict(os.environ, OMP_WAIT_POLICY="passive")
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
            runs.setdefault((mode, threads), []).append(json.loads(out.strip().splitlines()[-1]))
            print(runs[(mode, threads)][-1], flush=True)
    results = []
    for key in order:
        done = runs[key]
        result = dict(done[0], step_ms=statistics.median(r["step_ms"] for r in done),
                      first_step_s=statistics.median(r["first_step_s"] for r in done), runs=len(done),
                      each_step_ms=[r["step_ms"] for r in done])
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="benchmarks/results/cpu_compile_modes.json")
    parser.add_argument("--note", default="")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the modes, medians reported")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one "mode:threads" and print its JSON
    args = parser.parse_args()
    if args.one:
        mode, threads = args.one.rsplit(":", 1)
        print(json.dumps(measure(mode, int(threads), args.prompt_tokens, args.steps)))
        return
    results = run_rounds(args)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    Path(args.out).write_text(json.dumps({"command": command, "note": args.note, "results": results}, indent=1))
    markdown = table(results, command, args.note)
    Path(args.out).with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
