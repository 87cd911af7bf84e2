"""The commands' defaults on every reporting text, worst text first: the README's quality table, assembled from the
result files the quality benchmarks wrote (nothing is measured here).

    python benchmarks/quality_summary.py

Reads ``results/prompt_read_whole/passkeys_<text>_<length>.json`` (``ask_defaults.py --protocol
question-in-prompt --settings "lookahead 0.5"``; for the first three texts at 3,072 tokens, the same ranking's earlier
run ``results/reporting_corpus/question_in_prompt_<text>_3072.json``), the streaming perplexity files of
``streaming_quality.py`` (``results/reporting_corpus/`` and ``results/prompt_read_whole/``; the default
ranks a token-by-token stream as ``h2o``) and the old default's passkeys (``question_in_prompt_h2o_*``). Writes
``--out`` (markdown) and prints it.
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


if __name__ == "__main__":
    main()
