"""Planned against measured peak memory of ``h2o-compress batch --batch-size auto --memory-limit`` on a CPU.

    python benchmarks/memory_limit.py --threads 1 --out benchmarks/results/memory_limit_cpu.json

Issue 49's check: on a CPU a memory limit bounds the whole process. Each row runs the real command in a fresh
process, SmolLM2-135M, prompts of 2,000 and 8,000 tokens (consecutive windows of the reporting corpus's prose, as
``benchmarks/throughput.py`` takes them), greedy, ``--max-new-tokens`` new tokens, with the settings
``uncompressed`` (``--policy full``) and ``h2o 0.2 int4`` (given as a ``--config`` file; the ``ask`` defaults keep no
recent window, which ``batch`` refuses as ``generate`` does), then ``generate --memory-limit`` on the first prompt
(the planner picks budget and bits for the default policy, and reports planned against measured). The batch job measures its whole resident set once the model is loaded, plans the largest batch that fits the limit
(`h2o_compress.planner.fit_batch`, the prefill in chunks of ``prefill_chunk_size`` tokens), runs it, and prints
its planned total for that batch (``planned_peak_bytes``) beside its peak resident set (``peak_bytes``, kind
``cpu_peak_rss``). Reported per row: the limit, the batch, planned, measured, measured / planned, and whether the
peak stayed under the limit. Writes ``--out`` (JSON) and the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import SETTINGS, make_config, prompts  # noqa: E402  (the same prose and settings)

#: prompt tokens -> the memory limit of that row (about where the uncompressed cache fits 3-4 sequences); other
#: lengths (a smoke run): 2 GiB
LIMITS = {2000: "1.5GiB", 8000: "2.5GiB"}


def limit_for(prompt_tokens: int) -> str:
    return LIMITS.get(prompt_tokens, "2GiB")


def run_row(args, setting: str, prompt_tokens: int, texts: list[str], workdir: Path) -> dict:
    """One ``h2o-compress batch`` run in a fresh process; its ``--json`` summary with the row's inputs."""
    from h2o_compress import CompressionConfig

    source = workdir / f"in-{prompt_tokens}.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(texts)))
    config = workdir / "config.json"
    defaults = CompressionConfig().to_dict()  # the file sets what differs from the defaults, as a user writes it
    config.write_text(json.dumps({k: v for k, v in make_config(setting).to_dict().items() if v != defaults.get(k)}))
    output = workdir / f"out-{setting.replace(' ', '_')}-{prompt_tokens}.jsonl"
    command = [sys.executable, "-m", "h2o_compress", "batch", str(source), "-o", str(output), "--config", str(config),
               "--batch-size", "auto", "--memory-limit", limit_for(prompt_tokens), "--max-new-tokens",
               str(args.new_tokens), "--no-chat", "--threads", str(args.threads), "--device", "cpu", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{setting} at {prompt_tokens} tokens failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    row = {"setting": setting, "prompt_tokens": prompt_tokens, "limit": limit_for(prompt_tokens),
           "prompts": len(texts), **{k: summary[k] for k in ("batch_size", "batch_reason", "peak_bytes", "peak_kind",
                                                             "planned_peak_bytes", "seconds")}}
    print(f"  {setting:>14} {prompt_tokens:>5} tokens: batch {row['batch_size']}, planned "
          f"{row['planned_peak_bytes'] / 2**20:.0f} MiB, peak {row['peak_bytes'] / 2**20:.0f} MiB, "
          f"{row['seconds']:.0f} s", flush=True)
    return row


def run_generate(args, prompt_tokens: int, text: str) -> dict:
    """One ``h2o-compress generate --memory-limit`` run in a fresh process (the planner picks budget and bits for
    the default policy); its planned and measured peak."""
    command = [sys.executable, "-m", "h2o_compress", "generate", text, "--memory-limit", limit_for(prompt_tokens),
               "--max-new-tokens", str(args.new_tokens), "--no-chat", "--threads", str(args.threads), "--device",
               "cpu", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"generate at {prompt_tokens} tokens failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    picked = figures["config"]
    stored = f"int{picked['kv_bits']}" if picked["kv_bits"] < 16 else figures["kv_dtype"]
    row = {"setting": f"generate (picked {picked['policy']} {picked['budget']:g} {stored})", "prompt_tokens": prompt_tokens,
           "limit": limit_for(prompt_tokens), "prompts": 1, "batch_size": 1, "peak_bytes": figures["measured_peak_bytes"],
           "peak_kind": figures["measured_peak_kind"], "planned_peak_bytes": figures["planned_peak_bytes"],
           "seconds": figures.get("total_s", 0.0)}
    print(f"  generate {prompt_tokens:>5} tokens: {row['setting']}, planned {row['planned_peak_bytes'] / 2**20:.0f} "
          f"MiB, peak {row['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    return row


def markdown(report: dict) -> str:
    from h2o_compress.planner.units import parse_memory

    lines = [
        "# Planned vs measured peak memory of `batch --batch-size auto --memory-limit` (SmolLM2-135M, CPU)", "",
        f"`{report['command']}`", "",
        "The whole process's peak resident set (`VmHWM`, the kind `cpu_peak_rss`) against the planner's total for the "
        "batch the job picked (what the process held once the model was loaded + KV cache + workspace, the prefill "
        f"in chunks). {report['new_tokens']} new tokens per prompt, {report['threads']} thread(s).", "",
        "| setting | prompt tokens | limit | prompts | batch | planned | measured peak | measured / planned | "
        "under the limit |", "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['setting']} | {r['prompt_tokens']:,} | {r['limit']} | {r['prompts']} | {r['batch_size']} | "
            f"{r['planned_peak_bytes'] / 2**20:,.0f} MiB | {r['peak_bytes'] / 2**20:,.0f} MiB | "
            f"{r['peak_bytes'] / r['planned_peak_bytes']:.2f} | "
            f"{'yes' if r['peak_bytes'] <= parse_memory(r['limit']) else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", default="2000:8,8000:4", help="prompt tokens:how many, comma-separated")
    parser.add_argument("--settings", default="uncompressed,h2o 0.2 int4",
                        help=f"which of {', '.join(SETTINGS)} the batch rows run (the ask defaults keep no recent "
                             "window: the batch command refuses them, as generate does)")
    parser.add_argument("--out", default="benchmarks/results/memory_limit_cpu.json")
    args = parser.parse_args()
    import torch
    import transformers

    from h2o_compress import load_model

    _, tokenizer = load_model(device="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.prompts.split(","):
            tokens, count = (int(x) for x in item.split(":"))
            texts = prompts(tokenizer, count, tokens)
            for setting in args.settings.split(","):
                rows.append(run_row(args, setting.strip(), tokens, texts, Path(tmp)))
            rows.append(run_generate(args, tokens, texts[0]))
    report = {"command": " ".join(["python", *sys.argv]), "rows": rows, "new_tokens": args.new_tokens,
              "threads": args.threads,
              "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                              "machine": platform.processor() or platform.machine(),
                              "python": platform.python_version()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
