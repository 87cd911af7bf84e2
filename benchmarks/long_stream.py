"""Unbounded streams: cache bytes and process memory over a long stream with a fixed capacity.

    python benchmarks/long_stream.py --tokens 100000 --mode read --chunk 64         # tiny random LLaMA
    python benchmarks/long_stream.py --tokens 100000 --mode generate                # one token per step
    python benchmarks/long_stream.py --model smollm2-135m --tokens 8000 --mode read # the real model

``read`` feeds the stream in chunks of ``--chunk`` tokens (reading a long document); ``generate`` feeds back the
greedy token, one per forward pass (a long generation). Both run the package's own path: ``read`` the chunked
prefill of ``runtime.prefill.prompt_chunks``, ``generate`` the decode loop of ``runtime.decode_loop.fixed_steps``
with ``runtime.compiled.decode_step`` (what ``generate`` runs eagerly). The default model is a tiny randomly initialised LLaMA
(4 layers, 8 query heads, 2 KV heads, head_dim 64; unlimited positions), so 100,000 tokens fit in a CPU run;
memory behaviour does not depend on the weights. Every ``--every`` tokens it records ``cache.nbytes()`` (and its
min and max over every forward pass since the last sample), the bytes of the storages behind the cache's
tensors, the process RSS (psutil) and the throughput.
Writes ``benchmarks/results/long_stream_<label>.json`` and ``.png`` (cache bytes and RSS against tokens) and
prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path
from typing import Iterator

import psutil
import torch
from rich.console import Console
from rich.table import Table

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.runtime.decode_loop import fixed_steps
from h2o_compress.runtime.prefill import prompt_chunks

RESULTS = Path(__file__).parent / "results"
MIB = 2**20


def tiny_model(max_positions: int):
    """A tiny random LLaMA with ``max_positions`` positions (rotary: any position works)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=max_positions, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def stream_ids(model_name: str, tokens: int, vocab: int) -> torch.Tensor:
    """``[1, tokens]`` ids: a real text repeated for a real model, random ids for the tiny one."""
    if model_name == "tiny":
        return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    from h2o_compress import load_model

    _, tokenizer = load_model(model_name, device="cpu")
    text_path = Path(__file__).parents[1] / "h2o_compress" / "data" / "sherlock_holmes.txt"
    text = text_path.read_text() if text_path.exists() else "The quick brown fox jumps over the lazy dog. " * 200
    ids = tokenizer(text, return_tensors="pt").input_ids
    return ids.repeat(1, tokens // ids.shape[1] + 1)[:, :tokens]


def passes(model, ids: torch.Tensor, cache, mode: str, chunk: int) -> Iterator[int]:
    """The tokens each forward pass of the stream feeds, one per ``next()`` (the pass has run): ``read`` through
    the package's chunked prefill (``prompt_chunks``, ``chunk`` tokens a pass), ``generate`` through its decode
    loop (``fixed_steps``: the first id of ``ids``, then each greedy token, one pass per token)."""
    if mode == "read":
        return (tokens for tokens, _ in prompt_chunks(model, ids, cache, chunk))
    return (1 for _ in fixed_steps(decode_step, model, cache, ids[:, :1], 0, ids.shape[1]))


@torch.inference_mode()
def run(model, ids: torch.Tensor, config: CompressionConfig, mode: str, chunk: int, every: int, log) -> list[dict]:
    """Stream ``ids`` through ``model`` with a compressed cache; returns one sample per ``every`` tokens."""
    process = psutil.Process()
    cache = make_cache(model, config)
    samples, fed, next_sample = [], 0, every
    low, high = float("inf"), 0  # cache bytes after every forward pass since the last sample
    total = ids.shape[1]
    start = time.perf_counter()
    for tokens in passes(model, ids, cache, mode, chunk):
        fed += tokens
        nbytes = cache.nbytes()
        low, high = min(low, nbytes), max(high, nbytes)
        if fed >= next_sample or fed >= total:
            next_sample += every
            elapsed = time.perf_counter() - start
            sample = {
                "tokens": fed, "kept": cache.kept_length(), "cache_bytes": nbytes,
                "cache_bytes_min_since_last": low, "cache_bytes_max_since_last": high,
                "storage_bytes": cache.storage_nbytes(), "fp16_full_bytes": cache.full_fp16_nbytes(),
                "rss_bytes": process.memory_info().rss, "elapsed_s": elapsed, "tokens_per_s": fed / elapsed,
            }
            samples.append(sample)
            log(sample)
            low, high = float("inf"), 0
    gc.collect()
    return samples


def summarise(samples: list[dict], capacity: int) -> dict:
    """Cache bytes once full, and RSS drift after a warm-up of the first 10% of the stream."""
    full = [s for s in samples if s["kept"] >= capacity][1:]  # intervals that start with the cache full
    warm = [s for s in samples if s["tokens"] >= samples[-1]["tokens"] * 0.1] or samples
    return {
        "tokens": samples[-1]["tokens"],
        "cache_bytes_at_samples_once_full": sorted({s["cache_bytes"] for s in full}),
        "cache_bytes_min_max_every_step_once_full": [
            min(s["cache_bytes_min_since_last"] for s in full), max(s["cache_bytes_max_since_last"] for s in full)
        ] if full else None,
        "storage_equals_cache_bytes": all(s["storage_bytes"] == s["cache_bytes"] for s in samples),
        "fp16_full_bytes_at_end": samples[-1]["fp16_full_bytes"],
        "rss_after_warmup_bytes": warm[0]["rss_bytes"],
        "rss_end_bytes": samples[-1]["rss_bytes"],
        "rss_max_after_warmup_bytes": max(s["rss_bytes"] for s in warm),
        "rss_drift_after_warmup_bytes": samples[-1]["rss_bytes"] - warm[0]["rss_bytes"],
        "tokens_per_s": samples[-1]["tokens_per_s"],
        "elapsed_s": samples[-1]["elapsed_s"],
    }


def plot(samples: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [s["tokens"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(tokens, [s["cache_bytes"] / MIB for s in samples], label="compressed cache (nbytes)")
    top.fill_between(tokens, [s["cache_bytes_min_since_last"] / MIB for s in samples],
                     [s["cache_bytes_max_since_last"] / MIB for s in samples], alpha=0.3, label="min-max per step")
    top.plot(tokens, [s["fp16_full_bytes"] / MIB for s in samples], "--", label="uncompressed fp16 cache")
    top.set_yscale("log")
    top.set_ylabel("KV cache (MiB, log)")
    top.legend()
    top.set_title(title, fontsize=9)
    bottom.plot(tokens, [s["rss_bytes"] / MIB for s in samples], color="tab:red")
    bottom.set_ylabel("process RSS (MiB)")
    bottom.set_xlabel("tokens streamed")
    bottom.set_ylim(0, max(s["rss_bytes"] for s in samples) / MIB * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (random tiny LLaMA) or a model for load_model")
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--mode", choices=["read", "generate"], default="read")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per forward pass in read mode")
    parser.add_argument("--capacity", type=int, default=256, help="tokens kept per layer and KV head")
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--kv-bits", type=int, default=4)
    parser.add_argument("--every", type=int, default=0, help="sample interval in tokens (default: tokens / 100)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    every = args.every or max(1, args.tokens // 100)
    config = CompressionConfig(policy=args.policy, budget=args.capacity, kv_bits=args.kv_bits)
    if args.model == "tiny":
        model, description = tiny_model(args.tokens + 1), "tiny random LLaMA (4 layers, 2 KV heads, head_dim 64)"
    else:
        from h2o_compress import load_model

        model, _ = load_model(args.model, device="cpu")
        description = args.model
    ids = stream_ids(args.model, args.tokens, model.config.vocab_size)
    label = f"{args.model}-{args.mode}-{args.tokens}"
    console = Console()
    console.print(f"[bold]{label}[/]: {description}, {config}")
    samples = run(
        model, ids, config, args.mode, args.chunk, every,
        lambda s: console.print(
            f"{s['tokens']:>8} tokens  cache {s['cache_bytes'] / 1024:8.1f} KiB  RSS {s['rss_bytes'] / MIB:7.1f} MiB  "
            f"{s['tokens_per_s']:7.1f} tok/s"
        ),
    )
    summary = summarise(samples, args.capacity)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "label": label, "model": description, "mode": args.mode, "chunk": args.chunk if args.mode == "read" else 1,
        "config": config.to_dict(), "capacity": args.capacity, "torch": torch.__version__,
        "machine": f"{platform.machine()} {psutil.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "summary": summary, "samples": samples,
    }
    (RESULTS / f"long_stream_{label}.json").write_text(json.dumps(record, indent=1))
    plot(samples, f"{label}: {description}, capacity {args.capacity}, {args.policy} {args.kv_bits}-bit",
         RESULTS / f"long_stream_{label}.png")
    table = Table(title=f"long stream: {label}")
    table.add_column("tokens", justify="right")
    table.add_column("cache KiB", justify="right")
    table.add_column("fp16 full MiB", justify="right")
    table.add_column("RSS MiB", justify="right")
    table.add_column("tok/s", justify="right")
    rows = samples[:: max(1, len(samples) // 10)]
    for s in rows + ([samples[-1]] if rows[-1] is not samples[-1] else []):
        table.add_row(str(s["tokens"]), f"{s['cache_bytes'] / 1024:.1f}", f"{s['fp16_full_bytes'] / MIB:.1f}",
                      f"{s['rss_bytes'] / MIB:.1f}", f"{s['tokens_per_s']:.1f}")
    console.print(table)
    console.print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
