"""Profile reports: derived ratios, then report.json, report.md, PNG plots (matplotlib) and a self-contained
report.html, all from the dict [`h2o_compress.profiling.sweep.run_profile`][h2o_compress.profiling.run_profile] returns."""

from __future__ import annotations

import base64
import html
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from h2o_compress.evaluation.corpus import text_role
from h2o_compress.policies import POLICIES
from h2o_compress.utils.checks import is_integer, is_real
from h2o_compress.utils.errors import InputError, short, write_failure
from h2o_compress.utils.files import make_dir, read_text, staging_dir
from h2o_compress.utils.outputs import SIGNED, OutputDir, manifest_key

MIB = 2**20
PLOTS = {
    "perplexity_vs_kv_bytes.png": "Perplexity vs KV cache bytes",
    "decode_speed_vs_context.png": "Decode tokens/s vs context length",
    "memory_vs_context.png": "Memory vs context length",
}
def _reading(chunk_size: int, short: bool = False) -> str:
    """How the perplexity text was read: token by token (exact decode semantics) or chunked (labelled so)."""
    if chunk_size == 1:
        return "token by token" if short else "read token by token (the exact decode semantics)"
    if short:
        return f"chunked, {chunk_size} per pass"
    return (f"CHUNKED: read {chunk_size} per forward pass (tokens of a chunk see each other uncompressed, which hides "
            "part of the compression's cost; --chunk-size 1 gives the token-by-token figure)")


# One colour per registered policy, in registry order ("full", the reference, is black), one marker per bit width.
PALETTE = ("tab:red", "tab:purple", "tab:blue", "tab:green", "tab:orange", "tab:brown", "tab:gray", "tab:pink",
           "tab:olive", "tab:cyan", "gold", "navy", "teal", "lime", "maroon", "coral")
BITS_MARKERS = {16: "o", 8: "s", 4: "^"}


def policy_color(policy: str) -> str:
    """The colour of ``policy`` in every plot, from its place in `h2o_compress.policies.POLICIES` (so a new
    policy gets its own colour with no edit here); a name not registered gets a stable one from its letters."""
    if policy == "full":
        return "black"
    names = [name for name in POLICIES if name != "full"]
    index = names.index(policy) if policy in names else sum(map(ord, str(policy)))
    return PALETTE[index % len(PALETTE)]


def bits_marker(bits) -> str:
    """The marker of a KV bit width in every plot."""
    return BITS_MARKERS.get(bits, "x")


@dataclass
class Table:
    """A titled table rendered to Markdown and HTML (cells are already formatted strings)."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.rows)
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        return f"<h3>{html.escape(self.title)}</h3>{note}<table><tr>{head}</tr>{body}</table>"


# -- derived figures -------------------------------------------------------------------------------------
def finalize(report: dict) -> dict:
    """Add ratios against the reference (the first result: uncompressed, in the model's dtype) and the policy
    comparison.

    Adds ``perplexity.ratio``, ``corpora[text].ratio`` (the perplexity of each quality text over the reference's
    on that text; ``None`` where the reference has none), ``kv_fraction`` (the keys and values held / those of the
    uncompressed cache in the model's dtype, like with like: `kv_fraction_of`; perplexity stream), ``speed[i].decode_speed_ratio`` and ``metrics`` (``perplexity_ratio``, ``agreement`` =
    token match, ``passkey_accuracy``: the flat figures ``h2o-compress plan --profile`` reads) to each result, and
    ``report["policy_comparison"]``.

    Raises:
        InputError: a report without results.
    """
    results = report.get("results") or []
    if not results:
        raise InputError("the report has no results")
    ref = results[0]
    ref_ppl = ref["perplexity"]["perplexity"]
    ref_decode = {s["seq_len"]: s["decode_tokens_per_s"] for s in ref["speed"]}
    for record in results:
        ppl = record["perplexity"]
        ppl["ratio"] = ppl["perplexity"] / ref_ppl
        record["kv_fraction"] = kv_fraction_of(ppl, record.get("model_dtype"))
        for s in record["speed"]:
            base = ref_decode.get(s["seq_len"])
            s["decode_speed_ratio"] = s["decode_tokens_per_s"] / base if base else None
        record["metrics"] = {  # flat figures, as h2o-compress plan --profile reads them
            "perplexity_ratio": ppl["ratio"],
            "agreement": (record.get("agreement") or {}).get("token_match"),
            "passkey_accuracy": ((record.get("needle") or {}).get("overall") or {}).get("compressed"),
        }
    corpus_ratios(results)
    ref_scores = (ref.get("lm_eval") or {}).get("scores") or {}
    for record in results:
        if record.get("lm_eval"):
            record["lm_eval"]["vs_reference"] = lm_eval_vs_reference(record["lm_eval"].get("scores") or {}, ref_scores)
    report["reference"] = ref["label"]
    report["policy_comparison"] = policy_comparison(results)
    return report


def kv_fraction_of(figures: dict, model_dtype: str | None) -> float | None:
    """The share of the uncompressed cache in the model's dtype that ``figures`` (a perplexity or speed entry)
    holds: ``kv_bytes_held / kv_bytes_full`` (the keys and values of the tokens held against those of every token
    seen, so 1.0 when nothing is evicted or quantized; positions, scores and free slots are in ``kv_bytes``
    only). A report written before those were recorded: ``kv_bytes`` against the fp16 bytes scaled to
    ``model_dtype``. ``None`` without a reference size."""
    if figures.get("kv_bytes_full"):
        return figures["kv_bytes_held"] / figures["kv_bytes_full"]
    full = figures.get("kv_bytes_full_fp16") or 0
    full *= {"float32": 2, "float64": 4}.get(model_dtype or "", 1)
    return figures["kv_bytes"] / full if full else None


def corpus_ratios(results: list[dict]) -> None:
    """Set ``ratio`` in each ``record["corpora"][text]``: its perplexity / the reference's (``results[0]``) on the
    same text, ``None`` where the reference has no figure for that text."""
    reference = results[0].get("corpora") or {}
    for record in results:
        for text, entry in (record.get("corpora") or {}).items():
            base = (reference.get(text) or {}).get("perplexity")
            entry["ratio"] = entry["perplexity"] / base if base else None


def lm_eval_vs_reference(scores: dict, reference: dict) -> dict:
    """``{task: {"metric,filter": {"difference": ours - ref, "ratio": ours / ref}}}`` for each numeric lm-eval
    metric of ``scores`` also in ``reference`` (stderr entries left out; ``ratio`` is ``None`` where the
    reference is 0)."""
    out: dict = {}
    for task, metrics in scores.items():
        for key, value in metrics.items():
            base = (reference.get(task) or {}).get(key)
            if "_stderr," in key or not isinstance(value, (int, float)) or not isinstance(base, (int, float)):
                continue
            out.setdefault(task, {})[key] = {"difference": value - base, "ratio": value / base if base else None}
    return out


def _lm_eval_table(report: dict) -> Table | None:
    """One column per (task, metric) beside the perplexity, each with its change against the reference: the
    ratio for perplexity-like metrics (lower is better), the difference for the others (accuracy, exact match...);
    ``None`` when the sweep scored no lm-eval task."""
    results = report["results"]
    columns: list[tuple[str, str]] = []
    for r in results:
        for task, metrics in ((r.get("lm_eval") or {}).get("scores") or {}).items():
            columns += [(task, key) for key in metrics if "_stderr," not in key and (task, key) not in columns]
    if not columns:
        return None
    headers = ["Configuration", "Perplexity", "vs ref"]
    for task, key in columns:
        metric = key.split(",", 1)[0] if key.endswith(",none") else key
        ratio = "perplexity" in metric
        headers += [f"{task} {metric}", "vs ref" if ratio else "Δ vs ref"]
    rows = []
    for r in results:
        lm = r.get("lm_eval") or {}
        row = [r["label"], _f(r["perplexity"]["perplexity"], 3), _f(r["perplexity"].get("ratio"), 3, suffix="x")]
        for task, key in columns:
            value = ((lm.get("scores") or {}).get(task) or {}).get(key)
            change = ((lm.get("vs_reference") or {}).get(task) or {}).get(key) or {}
            row.append(_f(value, 4))
            if "perplexity" in key.split(",", 1)[0]:
                row.append(_f(change.get("ratio"), 3, suffix="x"))
            else:
                diff = change.get("difference")
                row.append("-" if diff is None else f"{diff:+.4f}")
        rows.append(row)
    settings = report["settings"]
    limit = settings.get("lm_eval_limit")
    return Table(
        "lm-eval scores",
        headers,
        rows,
        note=(f"lm-evaluation-harness tasks through the compressed cache (model type h2o-compress, "
              f"{'at most ' + str(limit) + ' documents' if limit else 'every document'} per task). "
              "Loglikelihood requests are scored against the compressed context, generation decodes with the cache, "
              f"rolling loglikelihood streams through it. Reference: {report.get('reference', results[0]['label'])}."),
    )


def _corpus_table(report: dict) -> Table | None:
    """Quality per corpus: per configuration, the perplexity ratio (and, with passkey lengths, the passkey
    accuracy) on the main text, then on each quality text; ``None`` when no row measured a quality text."""
    results, settings = report["results"], report["settings"]
    names: list[str] = []
    for r in results:
        names += [name for name in (r.get("corpora") or {}) if name not in names]
    if not names:
        return None
    needles = bool(settings.get("needle_lengths"))
    headers = ["Configuration"]
    for text in [settings.get("text_file"), *names]:
        headers += [f"{text_role(text)} ppl x", *([f"{text_role(text)} needle"] if needles else [])]
    rows = []
    for r in results:
        corpora = r.get("corpora") or {}
        figures = [(r["perplexity"].get("ratio"), _passkey(r))]
        figures += [((corpora.get(n) or {}).get("ratio"), (corpora.get(n) or {}).get("needle_accuracy")) for n in names]
        row = [r["label"]]
        for ratio, needle in figures:
            row += [_f(ratio, 3, suffix="x"), *([_f(needle, 2)] if needles else [])]
        rows.append(row)
    needle_note = "; needle: passkey accuracy with that text around the passkey" if needles else ""
    note = (f"Perplexity of the first {settings['ppl_tokens']} tokens (at most) of each text "
            f"({_reading(settings['chunk_size'], short=True)}) over the reference's on the same text "
            f"({report.get('reference', results[0]['label'])}){needle_note}. The tuning text is the only one any "
            "default, factor, policy or threshold is chosen on; reporting texts are never used to choose anything.")
    return Table("Quality per corpus", headers, rows, note=note)


def policy_comparison(results: list[dict]) -> list[dict]:
    """Per (kv bits, budget < 1): perplexity of each policy, the best one, and whether ``h2o`` beats both
    ``local`` and ``sink`` (``None`` when one of the three was not run)."""
    cells: dict[tuple, dict] = {}
    for r in results:
        c = r["config"]
        if c["policy"] == "full":
            continue
        cells.setdefault((c["kv_bits"], c["budget"]), {})[c["policy"]] = r["perplexity"]["perplexity"]
    rows = []
    for (bits, budget), ppl in sorted(cells.items(), key=lambda kv: (-kv[0][0], -kv[0][1])):
        beats = None
        if all(p in ppl for p in ("h2o", "local", "sink")):
            beats = ppl["h2o"] < ppl["local"] and ppl["h2o"] < ppl["sink"]
        rows.append({"kv_bits": bits, "budget": budget, "perplexity": ppl, "best": min(ppl, key=ppl.get),
                     "h2o_beats_local_and_sink": beats})
    return rows


# -- tables ----------------------------------------------------------------------------------------------
def _f(value, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value / scale:.{digits}f}{suffix}"


def _passkey(record: dict):
    """The row's passkey accuracy on the main text (``None`` without a passkey run)."""
    return ((record.get("needle") or {}).get("overall") or {}).get("compressed")


def tables(report: dict) -> list[Table]:
    """The report's tables: summary, quality per corpus (when the sweep measured quality texts), lm-eval scores
    (when it scored tasks), policy comparison, speed/memory per length, environment."""
    settings, results = report["settings"], report["results"]
    longest = max(settings["seq_lens"])
    summary = []
    for r in results:
        ppl, speed = r["perplexity"], {s["seq_len"]: s for s in r["speed"]}
        at = speed.get(longest) or r["speed"][-1]
        agree = r.get("agreement") or {}
        needle = _passkey(r)
        summary.append([
            r["label"], str(ppl["capacity"] or "all"), _f(ppl["kv_bytes"], 2, MIB), _f(r["kv_fraction"], 1, 0.01, "%"),
            _f(ppl["perplexity"], 3), _f(ppl["ratio"], 3, suffix="x"), _f(agree.get("token_match"), 2),
            _f(agree.get("prefix_match"), 2), _f(agree.get("rouge_l"), 2), _f(needle, 2),
            _f(at["prefill_tokens_per_s"], 1), _f(at["decode_tokens_per_s"], 1), _f(at["peak_memory_bytes"], 0, MIB),
        ])
    summary_table = Table(
        "Summary",
        ["Configuration", "Capacity", "KV MiB", "KV % of uncompressed", "Perplexity", "vs ref", "Token match",
         "Prefix match", "ROUGE-L", "Needle", f"Prefill tok/s @{longest}", f"Decode tok/s @{longest}",
         f"Peak MiB @{longest}"],
        summary,
        note=(f"Perplexity: {settings['ppl_tokens']} tokens, {_reading(settings['chunk_size'])}; "
              "capacity and KV bytes are those of that stream. Agreement: greedy generations vs the reference "
              f"({settings['agreement_prompts']} prompts, {settings['max_new_tokens']} new tokens). "
              f"Reference: {report['reference']}." + _dtype_note(results)),
    )
    comparison = Table(
        "H2O vs local vs sink (perplexity, lower is better)",
        ["KV bits", "Budget", "h2o", "local", "sink", "Best", "h2o beats both"],
        [[str(c["kv_bits"]), f"{c['budget']:g}", *(_f(c["perplexity"].get(p), 3) for p in ("h2o", "local", "sink")),
          c["best"], {True: "yes", False: "no", None: "-"}[c["h2o_beats_local_and_sink"]]]
         for c in report["policy_comparison"]],
    )
    speed_rows = [
        [r["label"], str(s["seq_len"]), str(s["capacity"] or "all"), _f(s["prefill_tokens_per_s"], 1),
         _f(s["decode_tokens_per_s"], 1), _f(s.get("decode_speed_ratio"), 2, suffix="x"), _f(s["kv_bytes"], 2, MIB),
         _f(s["peak_memory_bytes"], 0, MIB), _f(s.get("peak_memory_delta_bytes"), 1, MIB),
         _f(s.get("workspace_bytes"), 1, MIB), _decode_path(s)]
        for r in results for s in r["speed"]
    ]
    memory_kind = results[0].get("memory_kind", "")
    speed = Table(
        "Speed and memory per context length",
        ["Configuration", "Context", "Capacity", "Prefill tok/s", "Decode tok/s", "Decode vs ref", "KV MiB",
         "Peak MiB", "Run adds MiB", "Workspace MiB", "Decode attention"],
        speed_rows,
        note=(f"Prefill of the context in one pass, then {settings['decode_tokens']} greedy decode steps. "
              f"Peak memory: {memory_kind}" + _memory_note(memory_kind, settings.get("isolate"))
              + _weights_note(results)),
    )
    env = report["environment"]
    env_rows = [[k, str(v)] for k, v in env.items() if k != "packages"]
    env_rows += [[name, str(v)] for name, v in env["packages"].items()]
    env_rows += [["created", report["created"]], ["command", report.get("command") or "-"]]
    extra = [table for table in (_corpus_table(report), _lm_eval_table(report)) if table is not None]
    return [summary_table, *extra, comparison, speed,
            Table("Environment", ["Key", "Value"], env_rows)]


def _decode_path(speed: dict) -> str:
    """``cpu eager``, ``triton compiled``...: the decode attention kernel and whether the step ran compiled
    (``-`` in reports written before these were recorded)."""
    if "decode_kernel" not in speed:
        return "-"
    return f"{speed['decode_kernel'] or '-'} {'compiled' if speed['compiled'] else 'eager'}"


def _dtype_note(results: list[dict]) -> str:
    dtype = results[0].get("model_dtype") or "the model's dtype"
    note = (f" Unquantized rows keep keys and values in the model's dtype ({dtype}). KV %: the keys and values held "
            f"against those of the uncompressed {dtype} cache of the same tokens (like with like); KV MiB also counts "
            "positions, scores and free slots.")
    if dtype == "float32":
        note += " Quantized rows keep their residual window in fp16."
    return note


def _memory_note(kind: str, isolated: bool | None) -> str:
    where = {"cpu_peak_rss": " the process's peak resident set (weights, runtime and tokenizer included)",
             "cuda_max_memory_allocated": " the memory allocated on the GPU (weights included)"}.get(kind, "")
    alone = " in a fresh worker process per configuration" if isolated else ""
    return (f":{where}{alone}, its peak restarted before each context length (loading the model is not in it). "
            "'Run adds': the peak above what was held when the run started (KV cache + workspace); 'Workspace': "
            "that less the KV cache (activations, attention scratch, allocator slack).")


def _weights_note(results: list[dict]) -> str:
    weights = results[0].get("weights_bytes")
    return "" if weights is None else f" The model's weights: {weights / MIB:.0f} MiB."


# -- plots -----------------------------------------------------------------------------------------------
def _bits_of(record: dict) -> int:
    return record["config"]["kv_bits"]


def plot_perplexity(report: dict, path: Path) -> None:
    """Perplexity vs KV bytes (log x), one line per (policy, kv bits) across budgets; dashed: the reference."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    groups: dict[tuple, list] = {}
    for r in report["results"]:
        groups.setdefault((r["config"]["policy"], _bits_of(r)), []).append(
            (r["perplexity"]["kv_bytes"] / MIB, r["perplexity"]["perplexity"]))
    for (policy, bits), points in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        points.sort()
        ax.plot(*zip(*points), marker=bits_marker(bits), color=policy_color(policy),
                linestyle="-" if policy != "full" else "none", label=f"{policy} {bits}-bit", alpha=0.85)
    ref = report["results"][0]["perplexity"]["perplexity"]
    ax.axhline(ref, color="gray", linestyle="--", linewidth=1, label=f"reference {ref:.2f}")
    ax.set_xscale("log")
    _readable_log_ticks(ax)
    ax.set_xlabel("KV cache bytes at the end of the stream (MiB, log scale)")
    ax.set_ylabel("Streaming perplexity")
    s = report["settings"]
    ax.set_title(f"{s['model']}: perplexity of {s['ppl_tokens']} tokens ({_reading(s['chunk_size'], short=True)}) "
                 "vs KV bytes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _readable_log_ticks(ax) -> None:
    """Plain numbers (0.5, 1, 2, 5 ...) on a log axis instead of powers of ten, no crowded minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _per_bits_lines(report: dict, path: Path, series: list[tuple[str, str, float]], title: str) -> None:
    """One column of panels per kv bits; one row per ``(speed-record key, y label, scale)``; one line per config."""
    import matplotlib.pyplot as plt

    bits_list = sorted({_bits_of(r) for r in report["results"]}, reverse=True)
    fig, axes = plt.subplots(len(series), len(bits_list), figsize=(5.2 * len(bits_list), 4 * len(series)),
                             squeeze=False, sharex=True)
    for col, bits in enumerate(bits_list):
        records = [r for r in report["results"] if _bits_of(r) == bits or r is report["results"][0]]
        budgets = sorted({r["config"]["budget"] for r in records if r["config"]["policy"] != "full"}, reverse=True)
        for row, (key, ylabel, scale) in enumerate(series):
            ax = axes[row][col]
            for r in records:
                xs = [s["seq_len"] for s in r["speed"]]
                ys = [(s[key] or 0) / scale for s in r["speed"]]
                if r is report["results"][0]:
                    style, color, name = ":", "gray", f"reference ({r['label']})"
                else:
                    full = r["config"]["policy"] == "full"
                    style = "--" if full else ["-", "-.", ":"][budgets.index(r["config"]["budget"]) % 3]
                    color, name = policy_color(r["config"]["policy"]), r["label"]
                ax.plot(xs, ys, marker=bits_marker(_bits_of(r)), markersize=4, linestyle=style, color=color,
                        label=name)
            ax.set_title(f"{bits}-bit KV" + (" (+ reference)" if bits != 16 else ""))
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    """The three PNG plots of `PLOTS` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    names = list(PLOTS)
    model = report["settings"]["model"]
    plot_perplexity(report, out_dir / names[0])
    _per_bits_lines(report, out_dir / names[1], [("decode_tokens_per_s", "decode tokens/s", 1)],
                    f"{model}: decode speed after a prefill of the context")
    memory_label = "peak RSS (MiB)" if report["results"][0].get("memory_kind") == "cpu_peak_rss" else "peak CUDA MiB"
    _per_bits_lines(report, out_dir / names[2],
                    [("peak_memory_bytes", memory_label, MIB), ("kv_bytes", "KV cache (MiB)", MIB)],
                    f"{model}: memory vs context length")
    return [out_dir / n for n in names]


# -- files -----------------------------------------------------------------------------------------------
def _headline(report: dict) -> str:
    s = report["settings"]
    wins = [c["h2o_beats_local_and_sink"] for c in report["policy_comparison"] if c["budget"] <= 0.5]
    verdict = ""
    if wins and all(w is not None for w in wins):
        verdict = (f" H2O beats local and sink in perplexity in {sum(wins)} of {len(wins)} (kv bits, budget <= 0.5) "
                   "cells.")
    return (f"Model `{s['model']}` on {report['environment']['device']} "
            f"({report['environment']['device_name']}), {len(report['results'])} configurations; "
            f"reference: {report['reference']}.{verdict}")


def markdown(report: dict) -> str:
    """report.md: headline, plots (relative links) and tables."""
    parts = ["# h2o-compress profile", "", _headline(report), ""]
    parts += [f"![{title}]({name})\n" for name, title in PLOTS.items()]
    parts += [t.markdown() for t in tables(report)]
    return "\n".join(parts)


def html_page(report: dict, out_dir: Path) -> str:
    """report.html: the tables and the plots embedded as base64 PNGs (one file, no external resource)."""
    images = "".join(
        f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode((out_dir / name).read_bytes()).decode()}"><figcaption>{html.escape(title)}</figcaption></figure>'
        for name, title in PLOTS.items()
    )
    style = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}th{background:#f0f0f0}"
             "td:first-child{text-align:left}img{max-width:100%}figure{margin:1em 0}")
    body = "".join(t.html() for t in tables(report))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>h2o-compress profile</title>"
            f"<style>{style}</style></head><body><h1>h2o-compress profile</h1>"
            f"<p>{html.escape(_headline(report)).replace('`', '')}</p>{images}{body}</body></html>")


REPORT_FILES = ("report.json", *PLOTS, "report.md", "report.html")
"""The files [`write_report`][h2o_compress.profiling.write_report] writes in its directory (``run_profile`` also writes a ``rows`` folder)."""


def check_out_dir(out_dir: str | Path) -> Path:
    """Refuse ``out_dir`` when writing a report there would replace files profile did not write; creates nothing
    there (this user's manifest key is made once in the cache directory: `manifest_key`).

    Allowed: a path that does not exist yet, a directory with none of `REPORT_FILES`, or the output directory of an
    earlier profile run whose report files are still what its manifest, signed with this user's key, says profile
    wrote; a rerun resumes from it and ``--render`` may re-render into it.

    Raises:
        InputError: ``out_dir`` exists and is not a directory, its manifest path holds anything but a manifest
            (a directory, a symlink, a user's file), or it holds some of `REPORT_FILES` that profile did not write
            as this user (or that changed since; the message names the files).
        ConfigError: this user's manifest key cannot be had (an unusable cache directory).
    """
    target = OutputDir(out_dir)  # an empty path refused
    out = target.path
    if os.path.lexists(out) and not out.is_dir():
        raise InputError(f"output path {short(str(out))} exists and is not a directory; allowed: a directory "
                         "(new, empty or written by h2o-compress profile)")
    if not out.is_dir():
        manifest_key()  # made or read before any work, not first when the report is written
        return out
    target.check()
    clashes = target.foreign(REPORT_FILES)
    if clashes:
        unsigned = any(not entry.startswith(SIGNED) for name, entry in target.manifest().items() if name in clashes)
        raise InputError(
            f"output directory {short(str(out))} already holds {', '.join(clashes)}, not written by h2o-compress "
            "profile as this user (or changed since; its manifest, signed with this user's key, says what profile "
            "wrote" + ("; its entries for them are unsigned: written by hand, or before entries were signed" if unsigned
                       else "")
            + "): the report would replace them; allowed: a new or empty directory, or the output directory of an "
            "earlier profile run (choose another --out)")
    return out


def missing_dirs(out_dir: str | Path) -> list[Path]:
    """The directories creating ``out_dir`` would create (``out_dir`` first, then its missing parents)."""
    missing, path = [], Path(out_dir).absolute()
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty_dirs(dirs: list[Path]) -> None:
    """Remove each of ``dirs`` (deepest first, as `missing_dirs` lists them) while it exists and is empty:
    undoes the directories a failed run created and left empty, never anything with a file in it."""
    for path in dirs:
        try:
            path.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty (or not ours to remove): keep it and its parents
            return


def prepare_out_dir(out_dir: str | Path) -> Path:
    """Create ``out_dir`` (and parents) if needed and return it.

    Raises:
        InputError: it exists and is not a directory, or cannot be created.
    """
    out = Path(out_dir)
    return make_dir(out, lambda exc: InputError(
        f"output path {str(out)!r} exists and is not a directory" if exc is None
        else f"cannot create output directory {str(out)!r}: {exc.strerror or exc}"))


def load_report(path: str | Path) -> dict:
    """A report dict from a report.json written by [`write_report`][h2o_compress.profiling.write_report] or by an interrupted sweep.

    Raises:
        InputError: unreadable file, not JSON, or no ``results``/``settings``.
    """
    try:
        report = json.loads(read_text(path, "report", InputError))
    except InputError as exc:
        raise InputError(f"cannot read report: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"cannot read report {short(str(path))}: {short(str(exc), 120, repr_=False)}") from None
    if not isinstance(report, dict) or not report.get("results") or "settings" not in report:
        raise InputError(f"{short(str(path))} is not a profile report (no results or settings)")
    check_report(report, short(str(path)))
    return report


# -- validation, field by field ----------------------------------------------------------------------------
_number, _count = is_real, is_integer
_NUMBER, _COUNT, _TEXT = ("a number", _number), ("an integer", _count), ("a string", lambda v: isinstance(v, str))


def _or_none(kind: tuple) -> tuple:
    return (f"{kind[0]} or null", lambda v: v is None or kind[1](v))


_DICT = ("an object", lambda v: isinstance(v, dict))
_LIST = ("a list", lambda v: isinstance(v, list))
_RECORD_FIELDS = {
    "label": _TEXT,
    "config": _DICT,
    "config.policy": _TEXT,
    "config.kv_bits": _COUNT,
    "config.budget": _NUMBER,
    "perplexity": _DICT,
    "perplexity.perplexity": _NUMBER,
    "perplexity.kv_bytes": _NUMBER,
    "perplexity.kv_bytes_full_fp16": _NUMBER,
    "perplexity.capacity": _or_none(_COUNT),
    "speed": _LIST,
}
_STEP_FIELDS = {"seq_len": _COUNT, "capacity": _or_none(_COUNT), "prefill_tokens_per_s": _NUMBER,
                "decode_tokens_per_s": _NUMBER, "kv_bytes": _NUMBER, "peak_memory_bytes": _or_none(_NUMBER)}
_CORPUS_FIELDS = {"perplexity": _NUMBER, "tokens": _COUNT, "needle_accuracy": _or_none(_NUMBER)}
_OPTIONAL_FIELDS = {"agreement": ("token_match", "prefix_match", "rouge_l"), "needle": (), "lm_eval": ()}
_MISSING = object()


def _field(record: dict, dotted: str):
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _wrong(where: str, value, kind: str) -> str:
    if value is _MISSING:
        return f"{where} is missing; allowed: {kind}"
    return f"{where} is {short(value, 60)} ({type(value).__name__}); allowed: {kind}"


def record_problem(record, where: str = "row") -> str | None:
    """What makes ``record`` (one row of a report, as `h2o_compress.profiling.sweep.measure_config` returns
    it) unusable by the report: the first field missing or of the wrong type, as ``"<where>.<field> is ...;
    allowed: ..."``; ``None`` for a usable row."""
    if not isinstance(record, dict):
        return _wrong(where, record, "an object")
    for dotted, (kind, ok) in _RECORD_FIELDS.items():
        value = _field(record, dotted)
        if value is _MISSING or not ok(value):
            return _wrong(f"{where}.{dotted}", value, kind)
    if not record["speed"]:
        return f"{where}.speed is empty; allowed: one entry per context length"
    for i, step in enumerate(record["speed"]):
        if not isinstance(step, dict):
            return _wrong(f"{where}.speed[{i}]", step, "an object")
        for key, (kind, ok) in _STEP_FIELDS.items():
            value = step.get(key, _MISSING)
            if value is _MISSING or not ok(value):
                return _wrong(f"{where}.speed[{i}].{key}", value, kind)
    for name, numbers in _OPTIONAL_FIELDS.items():
        part = record.get(name)
        if part is None:
            continue
        if not isinstance(part, dict):
            return _wrong(f"{where}.{name}", part, "an object or null")
        for key in numbers:
            if not (part.get(key) is None or _number(part[key])):
                return _wrong(f"{where}.{name}.{key}", part[key], "a number or null")
    overall = (record.get("needle") or {}).get("overall")
    if overall is not None and not isinstance(overall, dict):
        return _wrong(f"{where}.needle.overall", overall, "an object or null")
    if overall and not (overall.get("compressed") is None or _number(overall["compressed"])):
        return _wrong(f"{where}.needle.overall.compressed", overall["compressed"], "a number or null")
    problem = _corpora_problem(record.get("corpora"), f"{where}.corpora")
    if problem:
        return problem
    scores = (record.get("lm_eval") or {}).get("scores")
    if scores is not None:
        if not isinstance(scores, dict):
            return _wrong(f"{where}.lm_eval.scores", scores, "an object {task: {metric: number}}")
        for task, metrics in scores.items():
            if not isinstance(metrics, dict):
                return _wrong(f"{where}.lm_eval.scores.{task}", metrics, "an object {metric: number}")
            for key, value in metrics.items():
                if not (value is None or _number(value)):
                    return _wrong(f"{where}.lm_eval.scores.{task}.{key}", value, "a number or null")
    return None


def _corpora_problem(corpora, where: str) -> str | None:
    """What makes a row's ``corpora`` (``{text: {perplexity, tokens, needle_accuracy[, ratio]}}``) unusable;
    ``None`` when it is usable or absent."""
    if corpora is None:
        return None
    if not isinstance(corpora, dict):
        return _wrong(where, corpora, "an object {text: {perplexity, tokens, needle_accuracy}} or null")
    for text, entry in corpora.items():
        if not isinstance(entry, dict):
            return _wrong(f"{where}.{text}", entry, "an object {perplexity, tokens, needle_accuracy}")
        fields = {**_CORPUS_FIELDS, **({"ratio": _or_none(_NUMBER)} if "ratio" in entry else {})}
        for key, (kind, ok) in fields.items():
            value = entry.get(key, _MISSING)
            if value is _MISSING or not ok(value):
                return _wrong(f"{where}.{text}.{key}", value, kind)
    return None


def _refused(name: str, problem: str) -> InputError:
    """The error of `check_report`: ``"<name> is incomplete: ..."`` for a missing field, else ``"<name>: ..."``."""
    lead = f"{name} is incomplete" if " is missing;" in problem else name
    return InputError(f"{lead}: {problem} (as h2o-compress profile writes it)")


def check_report(report: dict, name: str = "the report") -> None:
    """Refuse a report that cannot be rendered, field by field: every part the tables and plots read, each of the
    type they need (`record_problem` for each row), and a reference (the first result) with a finite
    perplexity > 0 on the main text and on each quality text it measured.

    Raises:
        InputError: naming the first missing or unusable field (``results[1].config.kv_bits``...), its value and
            what is allowed.
    """
    if not isinstance(report, dict):
        raise _refused(name, _wrong("the report", report, "an object"))
    for part, kind in (("settings", _DICT), ("environment", _DICT), ("results", _LIST), ("created", _TEXT)):
        value = report.get(part, _MISSING)
        if value is _MISSING or not (kind[1](value) or (part == "results" and isinstance(value, tuple))):
            raise _refused(name, _wrong(part, value, kind[0]))
    results, settings, env = report["results"], report["settings"], report["environment"]
    if not results:
        raise InputError(f"{name}: results is empty; allowed: at least the reference row")
    for key, (kind, ok) in {"model": _TEXT, "ppl_tokens": _COUNT, "chunk_size": _COUNT, "agreement_prompts": _COUNT,
                            "max_new_tokens": _COUNT, "decode_tokens": _COUNT}.items():
        value = settings.get(key, _MISSING)
        if value is _MISSING or not ok(value):
            raise _refused(name, f"{_wrong('settings.' + key, value, kind)}")
    lengths = settings.get("seq_lens", _MISSING)
    if not isinstance(lengths, (list, tuple)) or not lengths or not all(_count(n) for n in lengths):
        raise _refused(name, f"{_wrong('settings.seq_lens', lengths, 'a non-empty list of integers')}")
    for key, kind in (("device", _TEXT), ("device_name", _TEXT), ("packages", _DICT)):
        value = env.get(key, _MISSING)
        if value is _MISSING or not kind[1](value):
            raise _refused(name, f"{_wrong('environment.' + key, value, kind[0])}")
    ref = _field(results[0], "perplexity.perplexity") if isinstance(results[0], dict) else _MISSING
    if _number(ref) and not (math.isfinite(ref) and ref > 0):
        raise InputError(f"{name}: the reference perplexity is {short(ref)}; allowed: a finite number > 0")
    for i, record in enumerate(results):
        problem = record_problem(record, f"results[{i}]")
        if problem:
            raise _refused(name, problem)
    for text, entry in (results[0].get("corpora") or {}).items():
        if not (math.isfinite(entry["perplexity"]) and entry["perplexity"] > 0):
            raise InputError(f"{name}: the reference perplexity of quality text {short(text)} is "
                             f"{short(entry['perplexity'])}; allowed: a finite number > 0")


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md, the PNG plots and report.html into ``out_dir`` (created if needed).

    Returns:
        ``{file name: path}`` of every file written.

    Raises:
        InputError: ``out_dir`` exists and is not a directory, cannot be created, or holds report files that
            profile did not write (`check_out_dir`).
    """
    check_out_dir(out_dir)
    check_report(report)
    if "policy_comparison" not in report:
        finalize(report)
    try:
        page = markdown(report)  # everything the tables read, before a file is written
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise InputError(f"the report cannot be rendered ({short(exc, 80)}); allowed: a complete report") from None
    target = OutputDir(prepare_out_dir(out_dir))  # each file replaced only while it is what profile wrote
    written = {"report.json": target.write("report.json", json.dumps(report, indent=2, default=str) + "\n")}
    try:
        # matplotlib writes where it is told: a staging directory of this run (one a killed run left is removed)
        with staging_dir(Path(tempfile.gettempdir()), "h2o-plots-") as scratch:
            for path in write_plots(report, scratch):
                written[path.name] = target.write(path.name, path.read_bytes())
            page_html = html_page(report, scratch)
    except OSError as exc:  # the scratch directory (the system's temporary one): full, read-only...
        raise InputError(write_failure(exc.filename or tempfile.gettempdir(), exc)) from None
    written["report.md"] = target.write("report.md", page)
    written["report.html"] = target.write("report.html", page_html)
    return written
