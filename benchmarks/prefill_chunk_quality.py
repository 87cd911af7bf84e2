"""What chunked prefill costs in quality: perplexity of a continuation after a long prompt, one pass vs chunks.

    python benchmarks/prefill_chunk_quality.py --chunks 0,512,1024,2048 --out benchmarks/results/prefill_chunk_quality.json

On the tuning text by default (``h2o_compress/data/sherlock_holmes.txt``: it chooses the default
``prefill_chunk_size``), or with ``--text`` a reporting text (which reports and chooses nothing): for each window start, a ``--prompt-tokens`` prompt is prefilled into an h2o 0.2 int4
cache (``prefill``, in chunks of each size; 0 = one pass), then the next ``--continuation`` tokens are fed one at a
time and scored (teacher forcing), against the uncompressed cache. A chunked prefill scores and evicts before the
whole prompt is read, so its cache can differ from the one-pass cache. Prints a table, writes ``--out`` (JSON) and
the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from h2o_compress import CompressionConfig, load_model, make_cache
from h2o_compress.runtime.prefill import prefill


@torch.no_grad()
def continuation_perplexity(model, window: torch.Tensor, prompt: int, config: CompressionConfig) -> float:
    """Perplexity of ``window[:, prompt:]`` after ``window[:, :prompt]`` is prefilled into a cache of ``config``."""
    cache = make_cache(model, config, max_length=window.shape[1])
    logits = prefill(model, window[:, :prompt], cache)
    nll = 0.0
    for i in range(prompt, window.shape[1]):
        target = window[:, i]
        nll += torch.nn.functional.cross_entropy(logits.float(), target).item()
        logits = model(input_ids=target[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    return math.exp(nll / (window.shape[1] - prompt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="0,512,1024,2048")
    parser.add_argument("--starts", default="20000,60000", help="window starts (tokens into the tuning text)")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--continuation", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--text", default="sherlock", help="sherlock (the tuning text, which chooses the default) or "
                        "a reporting text (python_reference, persuasion, python_code: report, choose nothing)")
    parser.add_argument("--out", default="benchmarks/results/prefill_chunk_quality.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(device="cpu")
    if args.text == "sherlock":
        text = (Path(__file__).resolve().parents[1] / "h2o_compress/data/sherlock_holmes.txt").read_text()
    else:
        from h2o_compress.evaluation.corpus import reporting_text

        text = reporting_text(args.text)
    ids = tokenizer(text, return_tensors="pt").input_ids
    rows = []
    for start in (int(s) for s in args.starts.split(",")):
        window = ids[:, start : start + args.prompt_tokens + args.continuation]
        full = continuation_perplexity(model, window, args.prompt_tokens, CompressionConfig(policy="full"))
        for chunk in (int(c) for c in args.chunks.split(",")):
            config = CompressionConfig(policy="h2o", budget=0.2, kv_bits=4, prefill_chunk_size=chunk)
            ppl = continuation_perplexity(model, window, args.prompt_tokens, config)
            rows.append({"start": start, "chunk": chunk, "perplexity": ppl, "uncompressed": full})
            print(f"  start {start}, chunk {chunk or 'one pass'}: {ppl:.4f} (uncompressed {full:.4f})", flush=True)
    one_pass = {r["start"]: r["perplexity"] for r in rows if r["chunk"] == 0}
    which = "tuning text" if args.text == "sherlock" else f"reporting text {args.text}"
    lines = [f"# Chunked prefill: continuation perplexity after a long prompt (SmolLM2-135M, {which}, CPU)", "",
             f"`python {' '.join(sys.argv)}`", "",
             f"h2o 0.2 int4; {args.prompt_tokens}-token prompt prefilled, then {args.continuation} tokens scored one "
             "at a time.", "", "| window start | chunk | perplexity | x one pass | x uncompressed |",
             "|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['start']:,} | {r['chunk'] or 'one pass'} | {r['perplexity']:.4f} | "
                     f"{r['perplexity'] / one_pass.get(r['start'], r['perplexity']):.4f} | "
                     f"{r['perplexity'] / r['uncompressed']:.4f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
