"""8-bit weights on CPU through torch's packed int8 kernel against fp32 weights (issue 50, Build item 1).

    python benchmarks/cpu_weights.py --threads 2,1 --prompt-tokens 1000 --new-tokens 32 --repeats 2

Loads SmolLM2 twice on CPU: ``load_model(weights_bits=16)`` (fp32 weights) and ``weights_bits=8`` (since this
measurement the CPU default for the embedded model; every Linear layer and the output head packed to per-row int8,
run by ``aten._weight_int8pack_mm`` with bf16 activations inside the layer: `h2o_compress.models.int8_linear`).
Reports:

- quality: perplexity of the first ``--ppl-tokens`` tokens of each reporting text, uncompressed cache, one forward
  (``reference_perplexity``), and the int8 / fp32 ratio (the issue's bar: within 1.01x on every text);
- speed: decode tokens/s after a ``--prompt-tokens`` prompt, ``--new-tokens`` greedy tokens, h2o 0.2 + int4 KV
  (the CPU default path: eager, the CPU attention kernel), the two weight settings alternating ``--repeats``
  times, medians, at each of ``--threads`` (comma-separated torch thread counts);
- the weight bytes as loaded (``loaded_weight_bytes``) and as the planner counts them.

Writes ``--out`` (JSON) and the same path with ``.md``, with the command beside the figures.
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

from h2o_compress import CompressionConfig, load_model
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, reporting_text, tokenize_text
from h2o_compress.evaluation.perplexity import reference_perplexity
from h2o_compress.models.weights import loaded_weight_bytes
from h2o_compress.planner import weight_bytes
from h2o_compress.planner.known_models import resolve_model
from h2o_compress.runtime.compiled import decode_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import run_once  # noqa: E402

CONFIG = CompressionConfig(budget=0.2, kv_bits=4)


def decode_rate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of one run: eager prefill, then ``new_tokens`` greedy steps
    (`decode_speed.run_once`, the same loop as the decode-speed benchmark)."""
    run = run_once(model, prompt, new_tokens, CONFIG, decode_step)
    return run["prefill_s"], new_tokens / run["decode_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", default="2", help="comma-separated torch thread counts (the first for quality)")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/cpu_weights_int8.json")
    parser.add_argument("--note", default="", help="a line for the markdown (e.g. the machine's load)")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    command = "python benchmarks/cpu_weights.py " + shlex.join(sys.argv[1:])

    models = {bits: load_model(args.model, device="cpu", weights_bits=bits) for bits in (16, 8)}
    names = {16: "fp32 weights", 8: "int8 weights (packed, bf16 activations)"}
    tokenizer = models[16][1]
    spec = resolve_model(args.model)
    weights = {bits: {"loaded_bytes": loaded_weight_bytes(models[bits][0]),
                      "planned_bytes": weight_bytes(spec, bits, torch.float32, backend="cpu")}
               for bits in models}

    quality = {}
    for name in REPORTING_TEXTS:
        ids = tokenize_text(tokenizer, reporting_text(name), args.ppl_tokens)
        ppl = {bits: reference_perplexity(models[bits][0], ids) for bits in models}
        quality[name] = {"tokens": ids.shape[1], "fp32": ppl[16], "int8": ppl[8], "ratio": ppl[8] / ppl[16]}
        print(f"{name}: fp32 {ppl[16]:.3f} int8 {ppl[8]:.3f} ratio {ppl[8] / ppl[16]:.4f}", flush=True)

    text = " ".join(reporting_text(name) for name in REPORTING_TEXTS)
    prompt = tokenize_text(tokenizer, text, args.prompt_tokens)
    speed = {}
    for count in threads:
        torch.set_num_threads(count)
        for bits in models:  # warm-up, untimed
            decode_rate(models[bits][0], prompt, 2)
        runs = {bits: [] for bits in models}
        for _ in range(args.repeats):
            for bits in models:  # alternating
                runs[bits].append(decode_rate(models[bits][0], prompt, args.new_tokens))
                print(f"{count} threads, {names[bits]}: decode {runs[bits][-1][1]:.2f} tokens/s", flush=True)
        speed[count] = {bits: {"decode_tokens_per_s": statistics.median(r[1] for r in runs[bits]),
                               "prefill_s": statistics.median(r[0] for r in runs[bits]),
                               "runs_decode_tokens_per_s": [r[1] for r in runs[bits]]} for bits in models}

    result = {"command": command, "note": args.note, "torch": torch.__version__, "machine": platform.processor()
              or platform.machine(), "threads": threads, "prompt_tokens": prompt.shape[1],
              "new_tokens": args.new_tokens, "repeats": args.repeats, "config": "h2o 0.2 + int4 KV",
              "quality": quality,
              "speed": {f"{c} threads": {names[b]: speed[c][b] for b in models} for c in threads},
              "weights": {names[b]: weights[b] for b in models}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# 8-bit weights on CPU (torch `_weight_int8pack_mm`) vs fp32, {args.model}", "", f"`{command}`", ""]
    if args.note:
        lines += [args.note, ""]
    lines += [f"Perplexity, first {args.ppl_tokens} tokens, uncompressed cache, one forward:", "",
              "| text | fp32 | int8 | int8 / fp32 |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {q['fp32']:.3f} | {q['int8']:.3f} | {q['ratio']:.4f}x |" for n, q in quality.items()]
    lines += ["", f"Decode, {prompt.shape[1]}-token prompt, {args.new_tokens} new tokens, h2o 0.2 + int4 KV, "
              f"alternating {args.repeats}x, medians (torch {torch.__version__}); weight bytes as loaded (with the "
              "rotary buffer) / as the planner counts them from the config:", "",
              "| threads | weights | decode tokens/s | runs | prefill s | int8 / fp32 decode | weight bytes |",
              "|---:|---|---:|---|---:|---:|---:|"]
    for c in threads:
        ratio = speed[c][8]["decode_tokens_per_s"] / speed[c][16]["decode_tokens_per_s"]
        for b in models:
            s = speed[c][b]
            lines.append(f"| {c} | {names[b]} | {s['decode_tokens_per_s']:.2f} | "
                         f"{', '.join(f'{r:.2f}' for r in s['runs_decode_tokens_per_s'])} | {s['prefill_s']:.2f} | "
                         f"{f'{ratio:.2f}x' if b == 8 else ''} | "
                         f"{weights[b]['loaded_bytes']:,} / {weights[b]['planned_bytes']:,} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
