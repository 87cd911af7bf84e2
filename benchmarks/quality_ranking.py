"""The planner's quality ranking, ``h2o_compress/data/quality_ranking.json``, rebuilt from measured results (nothing
is measured here).

    python benchmarks/quality_ranking.py [--check]

Reads the 1,024-token streaming perplexity files of ``streaming_quality.py`` (``results/reporting_corpus/`` and
``results/prompt_read_whole/``): per setting, its perplexity as a ratio to the uncompressed cache's on the same
tokens, on each text of the reporting corpus it was measured on (the tuning text, ``sherlock``, is left out). A
setting's figure is its worst text's ratio. Settings that set a field the planner's candidates do not vary
(``key_offsets``, ``rotate``, ...) are left out. ``lookahead`` and ``snapkv`` rank a token-by-token stream exactly
as ``h2o`` does (checked here: equal wherever both were measured), so their rows are folded into ``h2o``'s and the
table says so (``same_as``). ``--check`` fails (exit 1) when the shipped table differs from the one the results
give, without writing it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h2o_compress import CompressionConfig
from streaming_quality import parse_setting  # the settings as that benchmark wrote them

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SOURCES = ("reporting_corpus/streaming_1024.json", "prompt_read_whole/streaming_1024.json")
OUT = ROOT / "h2o_compress" / "data" / "quality_ranking.json"
TUNING_TEXTS = ("sherlock",)
#: The fields a candidate of the planner varies (the rest keep their defaults there).
PLANNED_FIELDS = ("policy", "budget", "kv_bits", "k_bits", "v_bits", "quant", "group_size", "residual",
                  "heavy_ratio", "sink_tokens", "high_bits_fraction", "head_budgets", "layer_budgets")
SAME_AS = {"lookahead": "h2o", "snapkv": "h2o"}  # the same ranking of a token-by-token stream


def canonical(fields: dict) -> dict:
    """``fields`` as one spelling per setting: policy (``lookahead``/``snapkv`` as ``h2o``), budget and bits, then the
    other planned fields that differ from their defaults; a budget of 1.0 is the ``full`` policy (as the planner's
    candidates have it)."""
    config, default = CompressionConfig(**fields), CompressionConfig()
    full = config.policy == "full" or (config.budget_is_fraction and config.budget >= 1)
    policy = "full" if full else SAME_AS.get(config.policy, config.policy)
    out = {"policy": policy, "budget": 1.0 if full else config.budget, "kv_bits": config.kv_bits}
    return out | {name: getattr(config, name) for name in PLANNED_FIELDS
                  if name not in out and getattr(config, name) != getattr(default, name)}


def measured_rows() -> list[dict]:
    """Every row of the sources on a reporting text, its setting parsed, ``lookahead``/``snapkv`` renamed ``h2o``.

    Raises:
        SystemExit: a folded policy's ratio differs from ``h2o``'s on a text both were measured on.
    """
    rows = []
    for source in SOURCES:
        for row in json.loads((RESULTS / source).read_text())["rows"]:
            fields = parse_setting(row["setting"])
            if row["text"] in TUNING_TEXTS or set(fields) - set(PLANNED_FIELDS):
                continue
            rows.append({"fields": fields, "text": row["text"], "ratio": row["ratio"], "source": source})
    for row in rows:
        row["fields"] = canonical(row["fields"])
    seen: dict[tuple, float] = {}
    for row in rows:
        key = (json.dumps(row["fields"], sort_keys=True), row["text"])
        if key in seen and abs(seen[key] - row["ratio"]) > 1e-9:
            sys.exit(f"{row['fields']} on {row['text']}: {seen[key]} and {row['ratio']} differ; not the same ranking")
        seen[key] = row["ratio"]
    return rows


def table() -> dict:
    """The ranking table: per setting its worst text's ratio, that text and the texts measured, best first."""
    settings: dict[str, dict] = {}
    for row in measured_rows():
        entry = settings.setdefault(json.dumps(row["fields"], sort_keys=True), {"fields": row["fields"], "ratios": {}})
        entry["ratios"][row["text"]] = row["ratio"]
    entries = [{"setting": canonical({"policy": "full"}), "ratio": 1.0, "worst_text": None, "texts": [],
                "note": "the reference: the uncompressed cache itself"}]
    for entry in settings.values():
        worst = max(entry["ratios"], key=entry["ratios"].get)
        entries.append({"setting": entry["fields"], "ratio": round(entry["ratios"][worst], 4),
                        "worst_text": worst, "texts": sorted(entry["ratios"])})
    entries.sort(key=lambda e: e["ratio"])
    return {
        "metric": "streaming perplexity as a ratio to the uncompressed cache's (lower is better), on the worst "
                  "text of the reporting corpus measured",
        "model": "SmolLM2-135M", "tokens": 1024,
        "sources": [f"benchmarks/results/{s}" for s in SOURCES],
        "command": "python benchmarks/quality_ranking.py",
        "same_as": SAME_AS,
        "entries": entries,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the shipped table; write nothing")
    args = parser.parse_args()
    text = json.dumps(table(), indent=1) + "\n"
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT.relative_to(ROOT)} differs from the results: run python benchmarks/quality_ranking.py")
        print(f"{OUT.relative_to(ROOT)} matches the results")
        return
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
