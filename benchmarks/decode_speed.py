"""Decode speed of the compressed cache against the uncompressed DynamicCache, side by side in one run.

    python benchmarks/decode_speed.py --prompt-tokens 1000 --new-tokens 64 --repeats 3

Each setting prefills the same prompt and decodes the same number of greedy tokens (no early stop); settings
are interleaved round-robin ``repeats`` times and the median is reported, so machine noise hits all alike.
Writes ``benchmarks/results/decode_speed.json`` and prints a table; ratios are against DynamicCache.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import DynamicCache

from h2o_compress import CompressionConfig, load_model, make_cache

SETTINGS = {
    "DynamicCache (uncompressed)": None,
    "ours full 16-bit": CompressionConfig(policy="full"),
    "ours h2o 0.2 16-bit": CompressionConfig(budget=0.2),
    "ours full 4-bit": CompressionConfig(policy="full", kv_bits=4),
    "ours h2o 0.2 8-bit": CompressionConfig(budget=0.2, kv_bits=8),
    "ours h2o 0.2 4-bit": CompressionConfig(budget=0.2, kv_bits=4),
    "ours local 0.2 4-bit": CompressionConfig(policy="local", budget=0.2, kv_bits=4),
}


@torch.inference_mode()
def run_once(model, prompt: torch.Tensor, new_tokens: int, config: CompressionConfig | None) -> dict:
    """Prefill + ``new_tokens`` greedy decode steps; returns seconds and the cache's bytes."""
    length = prompt.shape[1] + new_tokens
    cache = DynamicCache(config=model.config) if config is None else make_cache(model, config, max_length=length)
    start = time.perf_counter()
    token = model(input_ids=prompt, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = model(input_ids=token, past_key_values=cache).logits[:, -1:].argmax(-1)
    decode_s = time.perf_counter() - start
    nbytes = cache.nbytes() if config is not None else sum(
        layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers
    )
    return {"prefill_s": prefill_s, "decode_s": decode_s, "kv_bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default="benchmarks/results/decode_speed.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device="cpu")
    prompt = torch.randint(100, tokenizer.vocab_size - 100, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    run_once(model, prompt[:, :64], 4, None)  # warm-up
    times: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, config in SETTINGS.items():
            times[name].append(run_once(model, prompt, args.new_tokens, config))
    base = statistics.median(r["decode_s"] for r in times["DynamicCache (uncompressed)"])
    rows = []
    for name, runs in times.items():
        decode_s = statistics.median(r["decode_s"] for r in runs)
        rows.append({
            "setting": name,
            "decode_tokens_per_s": args.new_tokens / decode_s,
            "speed_vs_dynamic": base / decode_s,
            "prefill_s": statistics.median(r["prefill_s"] for r in runs),
            "kv_bytes": runs[-1]["kv_bytes"],
        })
    table = Table(title=f"Decode speed, {args.model}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens")
    for column in ("setting", "decode tokens/s", "x DynamicCache", "prefill s", "KV MiB"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        table.add_row(row["setting"], f"{row['decode_tokens_per_s']:.1f}", f"{row['speed_vs_dynamic']:.2f}",
                      f"{row['prefill_s']:.2f}", f"{row['kv_bytes'] / 2**20:.2f}")
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": vars(args), "rows": rows, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "processor": platform.processor(),
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
