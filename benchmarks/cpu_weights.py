"""Packed 8- and 4-bit weights on CPU through torch's own kernels against fp32 weights (issue 50, Build item 1).

    python benchmarks/cpu_weights.py --bits 16,8,4 --threads 2 --prompt-tokens 1000 --new-tokens 32 --repeats 2

Loads SmolLM2 once per ``--bits`` on CPU: ``load_model(weights_bits=16)`` (fp32 weights), ``8`` (every Linear
layer and the output head packed to per-row int8, run by ``aten._weight_int8pack_mm``:
`h2o_compress.models.int8_linear`) and ``4`` (the decoder's Linear layers packed to group-32 asymmetric 4-bit, run
by ``aten._weight_int4pack_mm_for_cpu``, the head int8: `h2o_compress.models.int4_linear`); both compute in bf16
inside the layer only. Reports:

- quality: perplexity of the first ``--ppl-tokens`` tokens of the tuning text (the only one a default may be
  chosen on) and of each reporting text, uncompressed cache, one forward (``reference_perplexity``), and each
  setting's ratio to fp32 (the issue's bar for 8 bits: within 1.01x on every reporting text);
- speed: decode tokens/s after a ``--prompt-tokens`` prompt, ``--new-tokens`` greedy tokens, h2o 0.2 + int4 KV
  (the CPU default path: eager, the CPU attention kernel), the settings alternating ``--repeats`` times, medians,
  at each of ``--threads`` (comma-separated torch thread counts);
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
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, default_corpus, reporting_text, tokenize_text
from h2o_compress.evaluation.perplexity import reference_perplexity
from h2o_compress.models.weights import loaded_weight_bytes
from h2o_compress.planner import weight_bytes
from h2o_compress.planner.known_models import resolve_model
from h2o_compress.runtime.compiled import decode_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import run_once  # noqa: E402

CONFIG = CompressionConfig(budget=0.2, kv_bits=4)
NAMES = {16: "fp32 weights", 8: "int8 weights (per row, bf16 activations)",
         4: "4-bit weights (groups of 32, bf16 activations; head int8)"}
TUNING = "tuning: sherlock"


def decode_rate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of one run: eager prefill, then ``new_tokens`` greedy steps
    (`decode_speed.run_once`, the same loop as the decode-speed benchmark)."""
    run = run_once(model, prompt, new_tokens, CONFIG, decode_step)
    return run["prefill_s"], new_tokens / run["decode_s"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bits", default="16,8", help="comma-separated weight bits (16 first: the reference)")
    parser.add_argument("--threads", default="2", help="comma-separated torch thread counts (the first for quality)")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ppl-tokens", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/cpu_weights_int8.json")
    parser.add_argument("--note", default="", help="a line for the markdown (e.g. the machine's load)")
    args = parser.parse_args()
    args.bits = [int(b) for b in args.bits.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    if args.bits[0] != 16 or any(b not in NAMES for b in args.bits):
        parser.error(f"--bits {args.bits}: allowed: 16 first, then 8 and/or 4")
    return args


def quality(models: dict, tokenizer, tokens: int) -> dict:
    """{text: {bits: perplexity, ..., "ratio_<bits>": that / fp32's}} for the tuning text and each reporting text."""
    texts = {TUNING: default_corpus(), **{name: reporting_text(name) for name in REPORTING_TEXTS}}
    out = {}
    for name, text in texts.items():
        ids = tokenize_text(tokenizer, text, tokens)
        ppl = {bits: reference_perplexity(models[bits], ids) for bits in models}
        out[name] = {"tokens": ids.shape[1], **{str(b): ppl[b] for b in models},
                     **{f"ratio_{b}": ppl[b] / ppl[16] for b in models if b != 16}}
        print(f"{name}: " + ", ".join(f"{b} bits {ppl[b]:.3f}" for b in models), flush=True)
    return out


def speed(models: dict, prompt: torch.Tensor, args) -> dict:
    """{threads: {bits: decode tokens/s median, prefill s median, runs}}, the settings alternating."""
    out = {}
    for count in args.threads:
        torch.set_num_threads(count)
        for model in models.values():  # warm-up, untimed
            decode_rate(model, prompt, 2)
        runs = {bits: [] for bits in models}
        for _ in range(args.repeats):
            for bits, model in models.items():
                runs[bits].append(decode_rate(model, prompt, args.new_tokens))
                print(f"{count} threads, {NAMES[bits]}: decode {runs[bits][-1][1]:.2f} tokens/s", flush=True)
        out[count] = {bits: {"decode_tokens_per_s": statistics.median(r[1] for r in runs[bits]),
                             "prefill_s": statistics.median(r[0] for r in runs[bits]),
                             "runs_decode_tokens_per_s": [r[1] for r in runs[bits]]} for bits in models}
    return out


def render(result: dict, args) -> str:
    bits = args.bits
    lines = [f"# Packed CPU weights (torch's int8 / int4 kernels) vs fp32, {args.model}", "",
             f"`{result['command']}`", ""] + ([args.note, ""] if args.note else [])
    lines += [f"Perplexity, first {args.ppl_tokens} tokens, uncompressed cache, one forward (the tuning text "
              "chose; the reporting texts report):", "",
              "| text | " + " | ".join(NAMES[b].split(" (")[0] for b in bits) + " | "
              + " | ".join(f"{b} bits / fp32" for b in bits[1:]) + " |",
              "|---|" + "---:|" * (2 * len(bits) - 1)]
    for name, q in result["quality"].items():
        lines.append(f"| {name} | " + " | ".join(f"{q[str(b)]:.3f}" for b in bits) + " | "
                     + " | ".join(f"{q[f'ratio_{b}']:.4f}x" for b in bits[1:]) + " |")
    lines += ["", f"Decode, {result['prompt_tokens']}-token prompt, {args.new_tokens} new tokens, h2o 0.2 + int4 KV, "
              f"alternating {args.repeats}x, medians (torch {torch.__version__}); weight bytes as loaded (with the "
              "rotary buffer) / as the planner counts them from the config:", "",
              "| threads | weights | decode tokens/s | runs | prefill s | / fp32 decode | weight bytes |",
              "|---:|---|---:|---|---:|---:|---:|"]
    for c in args.threads:
        s16 = result["speed"][c][16]["decode_tokens_per_s"]
        for b in bits:
            s, w = result["speed"][c][b], result["weights"][b]
            lines.append(f"| {c} | {NAMES[b]} | {s['decode_tokens_per_s']:.2f} | "
                         f"{', '.join(f'{r:.2f}' for r in s['runs_decode_tokens_per_s'])} | {s['prefill_s']:.2f} | "
                         f"{s['decode_tokens_per_s'] / s16:.2f}x | {w['loaded_bytes']:,} / {w['planned_bytes']:,} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads[0])
    command = "python benchmarks/cpu_weights.py " + shlex.join(sys.argv[1:])
    loaded = {bits: load_model(args.model, device="cpu", weights_bits=bits) for bits in args.bits}
    models = {bits: pair[0] for bits, pair in loaded.items()}
    tokenizer = loaded[16][1]
    spec = resolve_model(args.model)
    weights = {bits: {"loaded_bytes": loaded_weight_bytes(models[bits]),
                      "planned_bytes": weight_bytes(spec, bits, torch.float32, backend="cpu")} for bits in models}
    text = " ".join(reporting_text(name) for name in REPORTING_TEXTS)
    prompt = tokenize_text(tokenizer, text, args.prompt_tokens)
    result = {"command": command, "note": args.note, "torch": torch.__version__, "machine": platform.processor()
              or platform.machine(), "threads": args.threads, "prompt_tokens": prompt.shape[1],
              "new_tokens": args.new_tokens, "repeats": args.repeats, "config": "h2o 0.2 + int4 KV",
              "quality": quality(models, tokenizer, args.ppl_tokens), "speed": speed(models, prompt, args),
              "weights": weights}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "speed": {f"{c} threads": {NAMES[b]: v for b, v in s.items()}
                                                   for c, s in result["speed"].items()},
                               "weights": {NAMES[b]: w for b, w in weights.items()}}, indent=2) + "\n")
    markdown = render(result, args)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
