"""The commands' defaults on every reporting text, worst text first: the README's quality table, assembled from the
result files the quality benchmarks wrote (nothing is measured here).

    python benchmarks/quality_summary.py

Reads ``results/prompt_read_whole/passkeys_<text>_<length>.json`` (``ask_defaults.py --protocol
question-in-prompt --settings "lookahead 0.5"``; for the first three texts at 3,072 tokens, the same ranking's earlier
run ``results/reporting_corpus/question_in_prompt_<text>_3072.json``), the streaming perplexity files of
``streaming_quality.py`` (``results/reporting_corpus/`` and ``results/prompt_read_whole/``; the default
ranks a token-by-token stream as ``h2o``) and the old default's passkeys (``question_in_prompt_h2o_*``). Writes
``--out`` (markdown) and, from the ``eval ruler --json`` files in ``results/ruler/``, ``results/ruler/ruler_4k.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TEXTS = ("python_reference", "persuasion", "python_code", "german_jokes", "fortune_quotes", "pci_ids")
DEFAULT_STREAM = ("policy=lookahead,budget=0.2,kv_bits=4", "budget=0.2,kv_bits=4")  # the same ranking in a stream


def passkeys(text: str, length: int, setting: str) -> tuple[int, int] | None:
    """``(right of 9, uncompressed right of 9)`` for ``setting`` at ``length``, or ``None`` when not measured."""
    for path in (RESULTS / "prompt_read_whole" / f"passkeys_{text}_{length}.json",
                 RESULTS / "reporting_corpus" / f"question_in_prompt_{text}_{length}.json",
                 RESULTS / "reporting_corpus" / f"question_in_prompt_h2o_{text}_{length}.json"):
        if not path.exists():
            continue
        rows = {row["setting"]: row["right"] for row in json.loads(path.read_text())["rows"]}
        reference = rows.get("uncompressed")
        if setting in rows:
            return round(9 * rows[setting]), None if reference is None else round(9 * reference)
    return None


def streaming(text: str, tokens: int) -> float | None:
    """The default's streaming perplexity ratio on ``text`` at ``tokens``, or ``None``."""
    for folder in ("prompt_read_whole", "reporting_corpus"):
        path = RESULTS / folder / f"streaming_{tokens}.json"
        if path.exists():
            for row in json.loads(path.read_text())["rows"]:
                if row["text"] == text and row["setting"] in DEFAULT_STREAM:
                    return row["ratio"]
    return None


def cell(pair) -> str:
    if pair is None:
        return "-"
    right, reference = pair
    return f"{right} ({reference})" if reference is not None else str(right)


RULER_COMMANDS = {
    "ruler_4k_075.json": "h2o-compress eval ruler --policies h2o,snapkv,lookahead,kvzip --ratios 0.75 --length 4096 "
                         "--samples 1 --threads 1 --json",
    "ruler_4k_default_ratios.json": "h2o-compress eval ruler --policies lookahead --ratios 0.25,0.5,0.875 "
                                    "--length 4096 --samples 1 --threads 1 --no-reference --json",
}


def ruler_table() -> list[str]:
    """``results/ruler/ruler_4k.md``'s lines from the ``eval ruler --json`` files there (each setting's task scores,
    their mean, the share of the uncompressed mean and the KV bytes of fp16)."""
    scores, shares, commands = {}, {}, []
    for name, command in RULER_COMMANDS.items():
        path = RESULTS / "ruler" / name
        if path.exists() and path.stat().st_size:
            found = json.loads(path.read_text())
            scores |= found["scores"]
            shares |= found["kv_share"]
            commands.append(command)
    if not scores:
        return []
    tasks = list(next(iter(scores.values())))
    mean = {s: sum(v.values()) / len(v) for s, v in scores.items()}
    base = mean.get("uncompressed")
    lines = ["# RULER-style tasks at 4,096 tokens, SmolLM2-135M, CPU (eviction only, fp32 storage)", "",
             "| setting | " + " | ".join(tasks) + " | mean | of uncompressed | KV of fp16 |",
             "|---|" + "---:|" * (len(tasks) + 3)]
    for setting, row in scores.items():
        share = "-" if not base else f"{mean[setting] / base:.0%}"
        lines.append(f"| {setting} | " + " | ".join(f"{row[t]:.2f}" for t in tasks)
                     + f" | {mean[setting]:.3f} | {share} | {shares[setting]:.1%} |")
    return lines + ["", "One seeded sample per task (a 4k generation takes about a minute on one CPU thread).",
                    "Ratio: the share of each prompt's tokens removed (kvpress's compression ratio).", ""] + [
        f"`{c}`" for c in commands]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "prompt_read_whole" / "defaults_by_text.md"))
    args = parser.parse_args()
    rows = []
    for text in TEXTS:
        reference = {n: passkeys(text, n, "lookahead 0.5") for n in (1536, 3072)}
        old = {n: passkeys(text, n, "h2o 0.5") for n in (1536, 3072)}
        for n in old:  # the old default's files hold no reference: the default's run has it
            if old[n] is not None and reference[n] is not None:
                old[n] = (old[n][0], reference[n][1])
        rows.append((text, reference, old, streaming(text, 1024), streaming(text, 4096)))
    rows.sort(key=lambda r: -(r[3] or 0))  # worst streaming perplexity first
    lines = ["| reporting text (worst first) | passkeys 1.5k: default (uncompressed) | 3k | old default `h2o` 1.5k / 3k "
             "| streaming perplexity 1,024 | 4,096 |", "|---|---:|---:|---:|---:|---:|"]
    for text, new, old, short, long in rows:
        ratio = lambda r: "-" if r is None else f"{r:.3f}x"  # noqa: E731
        lines.append(f"| {text} | {cell(new[1536])} | {cell(new[3072])} | {cell(old[1536])} / {cell(old[3072])} | "
                     f"{ratio(short)} | {ratio(long)} |")
    Path(args.out).write_text("\n".join(lines) + "\n\n`python benchmarks/quality_summary.py`\n")
    print("\n".join(lines))
    ruler = ruler_table()
    if ruler:
        (RESULTS / "ruler" / "ruler_4k.md").write_text("\n".join(ruler) + "\n")
        print("\n".join(ruler))


if __name__ == "__main__":
    main()
