"""Batch throughput at one memory limit: the uncompressed cache at its largest batch against ours at theirs.

    python benchmarks/throughput.py --prompt-tokens 2000 --new-tokens 128 --threads 2 \
        --out benchmarks/results/throughput_cpu.json

The H2O paper's claim (Zhang et al. 2023, arXiv 2306.14048 §5.3): with a fifth of the KV cache, larger batches fit
the same memory, so more tokens per second. Here, on the real SmolLM2-135M:

1. The memory limit is where the uncompressed cache (``policy="full"``, the model's dtype) fits a batch of exactly
   ``--full-batch`` (4) sequences of ``--prompt-tokens`` + ``--new-tokens`` tokens with the weights as loaded
   (:func:`h2o_compress.planner.fit_batch`, the accounting of ``h2o-compress batch --batch-size auto``).
2. Each setting runs at the largest batch the planner gives it under that limit (and, for the curve, at smaller
   batches): :func:`h2o_compress.generate_batch` over the same prompts (consecutive windows of the reporting
   corpus's prose, which chose no setting: the Python Language Reference, then *Persuasion*), greedy, no chat
   template, a row ending at its end-of-sequence token or its new tokens. Each run is a fresh worker process, so
   its peak RSS is its own.
3. A mixed-length run (prompts of 200 to ``--prompt-tokens`` tokens, ``max_new_tokens`` 16 to ``--new-tokens``)
   compares continuous batching with static batches at the same batch size: idle row share and tokens/s.

GPU (the runbook in benchmarks/README.md): ``--model llama-7b-random --device cuda --memory-limit 80GB`` runs the
same on a LLaMA-7B-shaped model with random fp16 weights (throughput does not depend on the weight values; the
prompts are SmolLM2's tokens of the same prose, the vocabulary sized to its tokenizer), every setting at the largest
batch that fits the limit; ``--model llama-tiny-random`` is the same code path at a toy size (a CPU smoke test).

Reported: decode tokens/s (decode steps only), end-to-end tokens/s (new tokens over prefill + decode seconds), the
prefill share of the time, batch, peak RSS, planned bytes, and the ratios to the uncompressed run. Writes ``--out``
(JSON), the same path with ``.md`` (tables) and ``.png`` (tokens/s against batch).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

#: ``--model``: the real SmolLM2 (``None``), or LLaMA shapes with random weights (``LlamaConfig`` fields).
MODELS = {
    "smollm2-135m": None,
    "llama-7b-random": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 32, "intermediate_size": 11008, "max_position_embeddings": 32768},
    "llama-tiny-random": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 256, "max_position_embeddings": 32768},
}

SETTINGS = {  # name: CompressionConfig keyword arguments ("ask" = h2o_compress.ASK_DEFAULTS)
    "uncompressed": {"policy": "full", "kv_bits": 16},
    "h2o 0.2 int4": {"policy": "h2o", "budget": 0.2, "kv_bits": 4},
    "ask defaults": "ask",
}


def prose() -> str:
    """Prose that chose no setting: the reporting corpus's technical prose (the Python Language Reference) then its
    fiction (Jane Austen's *Persuasion*), about 196k SmolLM2 tokens (``h2o_compress/data/README.md``)."""
    from h2o_compress.evaluation.corpus import reporting_text

    return reporting_text("python_reference") + "\n\n" + reporting_text("persuasion")


def make_config(name: str):
    from h2o_compress import ASK_DEFAULTS, CompressionConfig

    spec = SETTINGS[name]
    return ASK_DEFAULTS if spec == "ask" else CompressionConfig(**spec)


def prompts(tokenizer, count: int, tokens: int, lengths: list[int] | None = None) -> list[str]:
    """``count`` consecutive windows of :func:`prose` of ``tokens`` tokens (or ``lengths[i]`` tokens each); past the
    prose's end (about 196k tokens: GPU batches of long prompts) the windows start again from its beginning."""
    ids = tokenizer(prose()).input_ids
    sizes = lengths or [tokens] * count
    if max(sizes) > len(ids):
        raise SystemExit(f"the prose has {len(ids)} tokens, fewer than the {max(sizes)} of one prompt")
    out, start = [], 0
    for size in sizes:
        start = 0 if start + size > len(ids) else start
        out.append(tokenizer.decode(ids[start : start + size]))
        start += size
    return out


def load(args):
    """``(model, tokenizer)`` of ``--model`` on ``--device``: SmolLM2 as the library loads it, or a LLaMA shape with
    random weights (fp16 on CUDA, fp32 on CPU, built on the device) and SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from h2o_compress import load_model

    fields = MODELS[args.model]
    if fields is None:
        return load_model(device=args.device)
    _, tokenizer = load_model(device="cpu")
    config = LlamaConfig(**fields, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), tokenizer


def worker(args) -> None:
    """One run in this process: print its figures as one JSON line."""
    import torch

    from h2o_compress import generate_batch
    from h2o_compress.planner import fit_batch
    from h2o_compress.runtime.batch import row_config
    from h2o_compress.utils.memory import PeakMemory

    torch.set_num_threads(args.threads)
    peak = PeakMemory()
    model, tokenizer = load(args)
    peak.loaded()
    task = json.loads(args.worker)
    config = make_config(task["setting"])
    if task.get("mixed"):
        lengths = task["lengths"]
        texts = prompts(tokenizer, len(lengths), 0, lengths)
        requests = [{"id": str(i), "prompt": t, "max_new_tokens": n} for i, (t, n) in enumerate(zip(texts, task["new"]))]
    else:
        requests = prompts(tokenizer, task["batch"], args.prompt_tokens)
    started = time.perf_counter()
    run = generate_batch(model, tokenizer, requests, config, max_new_tokens=args.new_tokens,
                         batch_size=task["batch"], chat=False, refill=task.get("refill", True),
                         longest_first=task.get("refill", True))
    results = list(run)
    seconds = time.perf_counter() - started
    stats = run.stats
    measured, kind = peak.measure()
    longest = max(r.prompt_tokens + args.new_tokens for r in results)
    planned = fit_batch(model, row_config(config, longest), 2**50, max(r.prompt_tokens for r in results),
                        args.new_tokens, batch=stats.batch_size)
    print(json.dumps({
        **task, **stats.to_dict(), "seconds": seconds, "errors": sum(r.finish_reason == "error" for r in results),
        "end_to_end_tokens_per_s": stats.new_tokens / seconds, "prefill_share": stats.prefill_s / seconds,
        "peak_bytes": measured, "peak_kind": kind, "planned_bytes": planned.total_bytes,
        "planned_kv_bytes": planned.cache.total,
    }))


def run_worker(args, task: dict) -> dict:
    command = [sys.executable, __file__, "--worker", json.dumps(task), "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--device", args.device,
               "--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"worker {task} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {task['setting']:>14} batch {task['batch']:>3}{' mixed' if task.get('mixed') else ''}"
          f"{'' if task.get('refill', True) else ' static'}: decode {result['decode_tokens_per_s']:.1f} tok/s, "
          f"end to end {result['end_to_end_tokens_per_s']:.1f} tok/s, {result['seconds']:.0f} s", flush=True)
    return result


def plan_batches(args) -> tuple[int, dict[str, int]]:
    """The memory limit (bytes: ``--memory-limit``, or where the uncompressed cache fits ``--full-batch``) and each
    setting's largest batch under it."""
    from h2o_compress.planner import fit_batch
    from h2o_compress.planner.units import parse_memory
    from h2o_compress.runtime.batch import row_config

    model, tokenizer = load(args)
    prompt_len = max(len(tokenizer(p).input_ids) for p in prompts(tokenizer, 4, args.prompt_tokens))
    full = make_config("uncompressed")
    if args.memory_limit:
        limit = parse_memory(args.memory_limit)
    else:
        limit = fit_batch(model, full, 2**50, prompt_len, args.new_tokens, batch=args.full_batch).total_bytes
    batches = {}
    for name in args.settings.split(","):
        config = row_config(make_config(name), prompt_len + args.new_tokens)
        batches[name] = fit_batch(model, config, limit, prompt_len, args.new_tokens).max_batch
    return limit, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--full-batch", type=int, default=4, help="the uncompressed cache's batch at the limit")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU (peak memory is then the CUDA peak)")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m",
                        help="SmolLM2, or a LLaMA shape with random weights (GPU runbook: llama-7b-random)")
    parser.add_argument("--memory-limit", default=None,
                        help="the memory every setting fits (e.g. 80GB); default: where the uncompressed cache fits "
                             "--full-batch sequences")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"which of {', '.join(SETTINGS)} run (uncompressed always: the ratios' base)")
    parser.add_argument("--curve", default="1,4,16", help="smaller batches run for the plot (each setting)")
    parser.add_argument("--mixed", type=int, default=24, help="prompts of the mixed-length run (0: none)")
    parser.add_argument("--mixed-batch", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/throughput_cpu.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--settings {unknown}: allowed {list(SETTINGS)}")
    args.settings = ",".join(["uncompressed"] + [n for n in names if n != "uncompressed"])
    import torch
    import transformers

    limit, batches = plan_batches(args)
    print(f"memory limit {limit / 2**20:.1f} MiB (uncompressed fits {batches['uncompressed']}); batches {batches}")
    curve = [int(b) for b in args.curve.split(",") if b]
    runs = []
    for name, largest in batches.items():
        sizes = sorted({b for b in curve if b < largest} | {largest})
        if name == "ask defaults":
            sizes = [largest]
        for batch in sizes:
            runs.append({**run_worker(args, {"setting": name, "batch": batch}), "largest": batch == largest})
    mixed = []
    if args.mixed:
        lengths = [200 + (i * 7919) % max(args.prompt_tokens - 200, 1) for i in range(args.mixed)]
        new = [16 + (i * 104729) % max(args.new_tokens - 16, 1) for i in range(args.mixed)]
        for refill in (True, False):
            mixed.append(run_worker(args, {"setting": "h2o 0.2 int4", "batch": args.mixed_batch, "mixed": True,
                                           "lengths": lengths, "new": new, "refill": refill}))
    report = {
        "command": " ".join(["python", *sys.argv]), "memory_limit_bytes": limit, "batches": batches, "runs": runs,
        "mixed": mixed, "model": args.model, "device": args.device, "limit_given": bool(args.memory_limit),
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "threads": args.threads,
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "machine": platform.processor() or platform.machine(), "python": platform.python_version()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def markdown(report: dict) -> str:
    base = next(r for r in report["runs"] if r["setting"] == "uncompressed" and r["largest"])
    lines = [
        f"# Batch throughput at one memory limit ({report.get('model', 'smollm2-135m')}, "
        f"{report.get('device', 'cpu')}, {report['threads']} threads)", "",
        f"`{report['command']}`", "",
        f"Memory limit {report['memory_limit_bytes'] / 2**20:.1f} MiB"
        + (" (--memory-limit)" if report.get("limit_given") else ": where the uncompressed cache fits a batch of "
           f"{report['batches']['uncompressed']}") + f" ({report['prompt_tokens']} + {report['new_tokens']} tokens). Prompts: "
        "consecutive windows of the reporting corpus's Python Language Reference then *Persuasion* (prose that chose no "
        "setting). Each row is one worker process.", "",
        "| setting | batch | decode tok/s | x uncompressed | end-to-end tok/s | x uncompressed | prefill share | "
        "KV per sequence | planned | peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['setting']}{'' if r['largest'] else ' (curve)'} | {r['batch_size']} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f} | {r['end_to_end_tokens_per_s']:.1f} | "
            f"{r['end_to_end_tokens_per_s'] / base['end_to_end_tokens_per_s']:.2f} | {r['prefill_share']:.0%} | "
            f"{r['kv_bytes_per_sequence'] / 2**20:.2f} MiB | {r['planned_bytes'] / 2**20:.0f} MiB | "
            f"{r['peak_bytes'] / 2**20:.0f} MiB |")
    if report["mixed"]:
        lines += ["", "## Mixed lengths: continuous batching vs static batches (h2o 0.2 int4, same batch)", "",
                  "| mode | batch | idle row share | decode tok/s | end-to-end tok/s | seconds |", "|---|---:|---:|---:|---:|---:|"]
        for r in report["mixed"]:
            lines.append(f"| {'continuous' if r['refill'] else 'static'} | {r['batch']} | {r['idle_share']:.0%} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['end_to_end_tokens_per_s']:.1f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for name in SETTINGS:
        points = sorted((r["batch_size"], r["decode_tokens_per_s"]) for r in report["runs"] if r["setting"] == name)
        if points:
            axis.plot(*zip(*points), marker="o", label=name)
    axis.axvline(report["batches"]["uncompressed"], color="grey", linestyle=":", label="uncompressed limit")
    axis.set(xscale="log", xlabel="batch (sequences)", ylabel="decode tokens/s",
             title=f"Decode throughput, {report['prompt_tokens']}-token prompts, one memory limit")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
