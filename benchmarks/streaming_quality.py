"""Streaming perplexity of settings on the reporting corpus: the README's quality table (issue 35).

    python benchmarks/streaming_quality.py --tokens 1024 --settings "budget=0.2,kv_bits=4" "budget=0.1,kv_bits=4"

Each text is read token by token (``eval perplexity --chunk-size 1``, the exact decode semantics) through the
compressed cache, and its perplexity is divided by the same tokens' uncompressed perplexity. A setting is a
comma-separated list of :class:`~h2o_compress.CompressionConfig` fields. ``--texts`` defaults to the reporting
corpus (texts nobody tunes on); naming the tuning text (``sherlock``) adds it as a labelled column, for
comparison only: this script reports, it never chooses a setting. Rows already in ``--out`` (same text, tokens and
setting) are kept, so a stopped run resumes. Writes ``--out`` (JSON) and the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from h2o_compress import CompressionConfig, load_model
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, TEXT_NAMES, load_text, tokenize_text
from h2o_compress.evaluation.perplexity import reference_perplexity, streaming_perplexity
from h2o_compress.utils.errors import ConfigError


def parse_setting(text: str) -> dict:
    """``"budget=0.2,kv_bits=4"`` -> ``{"budget": 0.2, "kv_bits": 4}`` (ints, floats, True/False, else strings)."""
    fields = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        for kind in (int, float):
            try:
                fields[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            fields[key] = {"True": True, "False": False}.get(value, value)
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", required=True, help="CompressionConfig fields, key=value,...")
    parser.add_argument("--texts", default=",".join(REPORTING_TEXTS), help=f"names among {', '.join(TEXT_NAMES)}")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/reporting_corpus/streaming_1024.json")
    args = parser.parse_args()
    texts = args.texts.split(",")
    unknown = [t for t in texts if t not in TEXT_NAMES]
    if unknown:
        parser.error(f"--texts {unknown}; allowed: {', '.join(TEXT_NAMES)}")
    try:  # every setting checked before the model loads
        configs = {s: CompressionConfig(**parse_setting(s)) for s in args.settings}
    except (ConfigError, TypeError) as exc:
        parser.error(f"--settings: {exc}")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    command = "python benchmarks/streaming_quality.py " + shlex.join(sys.argv[1:])
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    for text in texts:
        ids = tokenize_text(tokenizer, load_text(text), args.tokens)
        reference = None
        for setting, config in configs.items():
            if any((r["text"], r["tokens"], r["setting"]) == (text, args.tokens, setting) for r in rows):
                continue
            reference = reference or reference_perplexity(model, ids)
            started = time.perf_counter()
            result = streaming_perplexity(model, ids, config, 1)
            row = {"text": text, "tokens": args.tokens, "setting": setting, "perplexity": result.perplexity,
                   "reference": reference, "ratio": result.perplexity / reference, "kv_bytes": result.kv_bytes,
                   "kv_fraction_of_fp16": result.kv_bytes / result.kv_bytes_full_fp16,
                   "seconds": round(time.perf_counter() - started, 1), "command": command}
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"rows": rows}, indent=1))
    out.write_text(json.dumps({"rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows))


def markdown(rows: list[dict]) -> str:
    """Settings x texts, perplexity as a ratio to the uncompressed cache; the tuning text labelled as such."""
    texts = list(dict.fromkeys(r["text"] for r in rows))
    settings = list(dict.fromkeys((r["tokens"], r["setting"]) for r in rows))
    names = [f"{t} (tuning text)" if t == "sherlock" else t for t in texts]
    lines = ["# Streaming perplexity x uncompressed, SmolLM2-135M, token by token, CPU", "",
             "| tokens | setting | KV bytes of fp16 | " + " | ".join(names) + " |",
             "|---:|---|---:|" + "---:|" * len(texts)]
    for tokens, setting in settings:
        found = {r["text"]: r for r in rows if (r["tokens"], r["setting"]) == (tokens, setting)}
        fraction = next(iter(found.values()))["kv_fraction_of_fp16"]
        cells = [f"{found[t]['ratio']:.3f}x" if t in found else "-" for t in texts]
        lines.append(f"| {tokens} | `{setting}` | {fraction:.1%} | " + " | ".join(cells) + " |")
    lines += ["", "Uncompressed perplexity: " + ", ".join(
        f"{t} {next(r['reference'] for r in rows if r['text'] == t):.2f}" for t in texts), "",
        "Commands:", ""] + [f"    {c}" for c in dict.fromkeys(r["command"] for r in rows)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
