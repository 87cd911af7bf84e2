"""Side by side against kvpress and transformers' QuantizedCache, on the same model, inputs and machine, in one run.

    python benchmarks/compare_peers.py            # default grid (~25 min on 2 shared CPU cores)
    python benchmarks/compare_peers.py --quick    # smoke test (~5 min)
    python benchmarks/compare_peers.py --full     # every setting of the issue (about an hour)

kvpress pins transformers < 5.3 while this package is tested with 5.23, so the peers run in their own virtual
environment, ``benchmarks/peers/.venv``, created on first use from ``benchmarks/peers/requirements.txt``
(torch first, alone, as ``torch==2.13.0``: the CPU wheel). Two worker processes are started from this run, one
per environment (``benchmarks/peers/ours_worker.py``, ``benchmarks/peers/peer_worker.py``); both load the same
converted SmolLM2-135M-Instruct weights in fp32, use the same number of torch threads, and receive the same token
ids, made once here by the main environment's tokenizer (the peer environment never tokenizes: DESIGN.md
pitfall 9). Quality tasks run in both workers at once; speed runs one setting at a time, alternating sides.

Tasks:
  needle  long-context QA, kvpress's home ground: a ~1k-token context of real prose holding three pass keys
          ("the pass key of the red box is 48213") is compressed at prefill, then three questions are answered
          greedily afterwards from the compressed cache. Reported: exact answers, the teacher-forced NLL of the
          right answer (nats/token; finer than right/wrong), and the bytes the cache holds while answering.
  ppl     streaming perplexity: a text is read chunk by chunk and compression acts while it is read (ours:
          eviction after each chunk; kvpress: ``DecodingPress`` compressing back to the same token count after
          each chunk; QuantizedCache: streams natively).
  speed   prefill seconds, decode tokens/s (median step) and peak RSS above the idle process at 1k and 4k tokens.

Equal bytes: kvpress's ``compression_ratio`` r keeps ``int((1 - r) x context)`` tokens; our setting "keep b" uses
r = 1 - b for the peers and, for QA, compress-then-ask as ``h2o_compress.runtime.ask`` does it: the context is compressed
to ``int(b x context)`` tokens (kvzip: after its reconstruction pass), then each question and its answer are added
to a frozen copy that evicts nothing more, which is what kvpress holds while answering. Bytes are counted the same way on both sides: every tensor
the cache holds at the time (full-precision keys/values, quantized data, scales, zero points; ours also its fp32
score accumulators). Writes ``benchmarks/results/peers.json``, ``peers.md`` and ``peers_*.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
REQUIREMENTS = PEERS / "requirements.txt"
KEEPS = (0.5, 0.25, 0.1)
BITS = (16, 8, 4)
PRESSES = ("ObservedAttentionPress", "SnapKVPress", "StreamingLLMPress", "TOVAPress", "KnormPress",
           "ExpectedAttentionPress", "KVzipPress", "PyramidKVPress", "AdaKVPress")
# QA only: KVzip scores by reconstructing the context and AdaKV masks evicted tokens per head, which kvpress's
# DecodingPress (the streaming perplexity task) does not support.
PPL_PRESSES = PRESSES[:6]
SHORT = {"ObservedAttentionPress": "ObservedAttention", "SnapKVPress": "SnapKV", "StreamingLLMPress": "StreamingLLM",
         "TOVAPress": "TOVA", "KnormPress": "Knorm", "ExpectedAttentionPress": "ExpectedAttention",
         "KVzipPress": "KVzip", "PyramidKVPress": "PyramidKV", "AdaKVPress": "AdaKV-ExpectedAttention"}
# Ours beyond the paper's h2o: h2o-mean (heavy 0.9), SnapKV, KVzip and lookahead scoring, the PyramidKV layer
# schedule, and KVzip's own allocation (global layer budgets, adaptive heads);
# (policy, bits, heavy_ratio, layer_budgets, head_budgets, sink_tokens, high_bits_fraction, evict_chat_header).
OURS_ASK = [("h2o-mean", 16, 0.9), ("h2o-mean", 4, 0.9), ("snapkv", 16, 0.9), ("snapkv", 4, 0.9),
            ("kvzip", 16, 0.9), ("kvzip", 4, 0.9), ("lookahead", 16, 0.9), ("lookahead", 4, 0.9),
            ("h2o-mean", 4, 0.9, "pyramid"), ("tova", 16),
            ("kvzip", 16, 0.9, "global", "adaptive"), ("kvzip", 4, 0.9, "global", "adaptive"),
            ("lookahead", 4, 0.9, "global", "adaptive"),
            ("kvzip", 16, 1.0, "global", "adaptive", 4), ("kvzip", 8, 1.0, "global", "adaptive", 4),
            ("kvzip", 4, 1.0, "global", "adaptive", 4),  # KVzip's own setting: no recent window, 4 sinks
            ("kvzip", 4, 1.0, "global", "adaptive", 4, 0.5),  # + half the held tokens at 8 bits
            # + the chat template's header evicted first, as kvpress's KVzipPress does
            ("kvzip", 16, 1.0, "global", "adaptive", 4, None, True), ("kvzip", 8, 1.0, "global", "adaptive", 4, None, True),
            ("kvzip", 4, 1.0, "global", "adaptive", 4, None, True)]
COLORS = ("red", "blue", "green")
DEPTHS = (0.2, 0.5, 0.8)
INSTRUCTION = ("There are pass keys hidden inside a lot of irrelevant text. Find them and memorize them. "
               "I will quiz you about them.")
NEEDLE = "The pass key of the {color} box is {key}. Remember it. {key} is the pass key of the {color} box."
QUESTION = "\n\nWhat is the pass key of the {color} box?"
ANSWER_PREFIX = "The pass key of the {color} box is"

MODES = {
    "quick": dict(
        needle_items=1, context_tokens=1000, max_new_tokens=8,
        ours_needle=[("h2o", 16), ("h2o", 4), ("h2o", 16, 0.9), ("local", 16), ("sink", 16), ("h2o-mean", 4, 0.9),
                     ("kvzip", 4, 0.9)], keeps=(0.25,),
        ours_full_bits=(16,),
        peer_dynamic_needle=True,
        presses=("ObservedAttentionPress", "SnapKVPress", "StreamingLLMPress", "KVzipPress", "AdaKVPress"),
        quanto_presses={"ObservedAttentionPress": (0.25,)},
        ppl_tokens=256, ppl_chunk=32, ours_ppl=[("h2o", 16), ("h2o", 4)], ppl_presses=("KnormPress", "StreamingLLMPress"),
        speed_lengths=(1024,), speed_steps=8,
        speed_ours=[("dynamic", None, None), ("h2o", 0.2, 4)], speed_peers=[("dynamic", None), ("quanto4", None),
                                                                          ("dynamic", "SnapKVPress")],
    ),
    "default": dict(
        needle_items=2, context_tokens=1000, max_new_tokens=8,
        ours_needle=[("h2o", 16), ("h2o", 8), ("h2o", 4), ("h2o", 16, 0.9), ("h2o", 4, 0.9), ("local", 16), ("sink", 16),
                     ("sink", 4)] + OURS_ASK,
        keeps=KEEPS, ours_full_bits=(4,), peer_dynamic_needle=False, presses=PRESSES,
        quanto_presses={"ObservedAttentionPress": KEEPS, "SnapKVPress": KEEPS, "KVzipPress": KEEPS},
        ppl_tokens=512, ppl_chunk=32,
        ours_ppl=[("h2o", 16), ("h2o", 8), ("h2o", 4), ("local", 16), ("local", 4), ("sink", 16), ("sink", 4)],
        ppl_presses=PPL_PRESSES,
        speed_lengths=(1024, 4096), speed_steps=16,
        speed_ours=[("dynamic", None, None), ("h2o", 0.2, 16), ("h2o", 0.2, 4), ("full", None, 4)],
        speed_peers=[("dynamic", None), ("quanto4", None), ("hqq4", None), ("dynamic", "SnapKVPress"),
                     ("quanto4", "SnapKVPress")],
    ),
    "full": dict(
        needle_items=3, context_tokens=1000, max_new_tokens=8,
        ours_needle=[(p, b) for p in ("h2o", "local", "sink") for b in BITS] + [("h2o", b, 0.9) for b in BITS] + OURS_ASK,
        keeps=KEEPS, ours_full_bits=BITS,
        peer_dynamic_needle=True,
        presses=PRESSES, quanto_presses={p: KEEPS for p in PRESSES},
        ppl_tokens=1024, ppl_chunk=8, ours_ppl=[(p, b) for p in ("h2o", "local", "sink") for b in BITS],
        ppl_presses=PPL_PRESSES,
        speed_lengths=(1024, 4096), speed_steps=32,
        speed_ours=[("dynamic", None, None), ("h2o", 0.2, 16), ("h2o", 0.2, 8), ("h2o", 0.2, 4), ("local", 0.2, 4),
                    ("full", None, 4)],
        speed_peers=[("dynamic", None), ("quanto4", None), ("hqq4", None), ("dynamic", "SnapKVPress"),
                     ("quanto4", "SnapKVPress"), ("dynamic", "ObservedAttentionPress")],
    ),
}
SPEED_KEEP = 0.2
CACHE_LABEL = {"dynamic": "", "quanto4": " + quanto int4", "hqq4": " + HQQ int4"}


def say(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# ------------------------------------------------------------------------------------------- the peer venv


def ensure_peer_venv(venv: Path) -> tuple[Path | None, str | None]:
    """The venv's python, (re)built when requirements.txt changed; ``(None, error)`` when it cannot be built."""
    python = venv / "bin" / "python"
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    marker = venv / ".requirements.sha256"
    if python.exists() and marker.exists() and marker.read_text().strip() == digest:
        return python, None
    say(f"building the peer environment in {venv} (torch==2.13.0 first, then {REQUIREMENTS.name}) ...")
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", "torch==2.13.0"],
             [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            error = f"`{' '.join(step)}` failed (exit {done.returncode}): {(done.stderr or done.stdout)[-2000:]}"
            say("peer environment:", error)
            return None, error
    marker.write_text(digest)
    return python, None


# ------------------------------------------------------------------------------------------------ workers


class Worker:
    """A worker process answering JSON-line commands (see benchmarks/peers/common.py)."""

    def __init__(self, name: str, argv: list[str], workdir: Path, threads: int):
        self.name, self.workdir, self.count = name, workdir, 0
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
                   PYTHONPATH=str(ROOT))
        self.log_path = workdir / f"{name}.log"
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=open(self.log_path, "w"), text=True, cwd=ROOT, env=env)
        self.pending: list[tuple[int, Path]] = []

    def send(self, cmd: str, **fields) -> None:
        self.count += 1
        out = self.workdir / f"{self.name}-{self.count}-{cmd}.json"
        self.process.stdin.write(json.dumps({"id": self.count, "cmd": cmd, "out": str(out), **fields}) + "\n")
        self.process.stdin.flush()
        self.pending.append((self.count, out))

    def receive(self) -> dict:
        """The result of the oldest pending command; ``{"error": ...}`` if it failed or the worker died."""
        ident, out = self.pending.pop(0)
        line = self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text()[-3000:]
            return {"error": f"{self.name} worker exited (code {self.process.poll()}); log tail:\n{tail}"}
        reply = json.loads(line)
        if not reply.get("ok"):
            return {"error": reply.get("error", "unknown error")}
        return json.loads(out.read_text())

    def call(self, cmd: str, **fields) -> dict:
        self.send(cmd, **fields)
        return self.receive()

    def close(self) -> None:
        try:
            self.process.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.process.kill()


# ------------------------------------------------------------------------------------------------- inputs


def build_inputs(tokenizer, grid: dict, seed: int) -> dict:
    """Token ids of every input, made once with the main environment's tokenizer."""
    from h2o_compress.evaluation.corpus import default_corpus
    from h2o_compress.evaluation.needle import make_haystack, plant_needle

    corpus = default_corpus()
    rng = random.Random(seed)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    separator = "\u2063SPLIT\u2063"
    items = []
    for _ in range(grid["needle_items"]):
        keys = {color: str(rng.randint(10000, 99999)) for color in COLORS}
        needles = {color: NEEDLE.format(color=color, key=keys[color]) for color in COLORS}

        def render(haystack: str) -> tuple[str, str]:
            text = haystack
            for color, depth in sorted(zip(COLORS, DEPTHS), key=lambda pair: -pair[1]):
                text = plant_needle(text, needles[color], depth)
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{INSTRUCTION}\n\n{text}{separator}"}],
                add_generation_prompt=True, tokenize=False)
            context, suffix = chat.split(separator)
            return context, suffix

        overhead = len(encode(render("")[0]))
        offset = rng.randrange(0, len(corpus) - 12 * grid["context_tokens"])
        context, suffix = render(make_haystack(tokenizer, corpus, grid["context_tokens"] - overhead, offset))
        questions = [{"color": color, "key": keys[color], "depth": depth,
                      "ids": encode(QUESTION.format(color=color) + suffix + ANSWER_PREFIX.format(color=color)),
                      "answer_ids": encode(" " + keys[color])} for color, depth in zip(COLORS, DEPTHS)]
        items.append({"context_ids": encode(context), "questions": questions})
    ppl_start = corpus.find("\n\n", len(corpus) // 2) + 2
    ppl_ids = encode(corpus[ppl_start: ppl_start + 8 * grid["ppl_tokens"]])[: grid["ppl_tokens"]]
    speed_text = encode(corpus[10000: 10000 + 8 * max(grid["speed_lengths"])])
    speed_ids = {str(length): speed_text[:length] for length in grid["speed_lengths"]}
    return {"needle": items, "ppl_ids": ppl_ids, "speed_ids": speed_ids}


# ------------------------------------------------------------------------------------------------ methods


def keep_label(keep: float | None) -> str:
    return "" if keep is None else f" keep {keep:g}"


def needle_methods(grid: dict) -> tuple[list[dict], list[dict]]:
    ours = [{"name": "DynamicCache (transformers 5.23)", "kind": "dynamic", "family": "reference",
             "line": "DynamicCache", "keep": 1.0, "bits": 32}]
    for bits in grid["ours_full_bits"]:
        ours.append({"name": f"ours full {bits}-bit", "kind": "ours", "policy": "full", "kv_bits": bits,
                     "family": "ours", "line": f"ours full {bits}-bit", "keep": 1.0, "bits": bits})
    for policy, bits, *extra in grid["ours_needle"]:
        heavy, layers, heads, sinks, high, header = (extra + [None] * 6)[:6]
        label = policy + (f"-heavy{heavy:g}" if heavy else "") + (f"-{layers}" if layers else "") + (
            f"-{heads}-heads" if heads else "") + (f"-sinks{sinks}" if sinks else "") + (
            f"-hi8-{high:g}" if high else "") + ("-evict-header" if header else "")
        options = ({"heavy_ratio": heavy} if heavy else {}) | ({"layer_budgets": layers} if layers else {}) | (
            {"head_budgets": heads} if heads else {}) | ({"sink_tokens": sinks} if sinks else {}) | (
            {"high_bits_fraction": high} if high else {}) | ({"evict_chat_header": True} if header else {})
        for keep in grid["keeps"]:
            ours.append({"name": f"ours {label} {bits}-bit{keep_label(keep)}", "kind": "ours", "policy": policy,
                         "kv_bits": bits, "keep": keep, "family": "ours", "line": f"ours {label} {bits}-bit",
                         "bits": bits, **options})
    peers = [{"name": "DynamicCache (transformers 5.2)", "cache": "dynamic", "family": "reference",
              "line": "DynamicCache (peer env)", "keep": 1.0, "bits": 32}] if grid["peer_dynamic_needle"] else []
    peers += [{"name": "QuantizedCache quanto int4", "cache": "quanto4", "family": "QuantizedCache",
              "line": "QuantizedCache quanto int4", "keep": 1.0, "bits": 4},
             {"name": "QuantizedCache HQQ int4", "cache": "hqq4", "family": "QuantizedCache",
              "line": "QuantizedCache HQQ int4", "keep": 1.0, "bits": 4}]
    for press in grid["presses"]:
        for keep in grid["keeps"]:
            peers.append(_press_method(press, keep, "dynamic"))
    for press, keeps in grid["quanto_presses"].items():
        for keep in keeps:
            peers.append(_press_method(press, keep, "quanto4"))
    return ours, peers


def _press_method(press: str, keep: float, cache: str) -> dict:
    line = f"kvpress {SHORT[press]}{CACHE_LABEL[cache]}"
    return {"name": f"{line}{keep_label(keep)}", "press": press, "ratio": round(1 - keep, 6), "cache": cache,
            "family": "kvpress" + ("+quanto" if cache != "dynamic" else ""), "line": line, "keep": keep,
            "bits": 4 if cache != "dynamic" else 32}


def ppl_methods(grid: dict, tokens: int) -> tuple[list[dict], list[dict]]:
    ours = [{"name": "DynamicCache (transformers 5.23)", "kind": "dynamic", "family": "reference",
             "line": "DynamicCache", "keep": 1.0}]
    for bits in grid["ours_full_bits"]:
        if bits != 16:
            ours.append({"name": f"ours full {bits}-bit", "kind": "ours", "policy": "full", "kv_bits": bits,
                         "family": "ours", "line": f"ours full {bits}-bit", "keep": 1.0})
    for policy, bits in grid["ours_ppl"]:
        for keep in grid["keeps"]:
            ours.append({"name": f"ours {policy} {bits}-bit{keep_label(keep)}", "kind": "ours", "policy": policy,
                         "kv_bits": bits, "budget": keep, "keep": keep, "family": "ours",
                         "line": f"ours {policy} {bits}-bit"})
    peers = [{"name": "DynamicCache (transformers 5.2)", "cache": "dynamic", "family": "reference",
              "line": "DynamicCache (peer env)", "keep": 1.0},
             {"name": "QuantizedCache quanto int4", "cache": "quanto4", "family": "QuantizedCache",
              "line": "QuantizedCache quanto int4", "keep": 1.0},
             {"name": "QuantizedCache HQQ int4", "cache": "hqq4", "family": "QuantizedCache",
              "line": "QuantizedCache HQQ int4", "keep": 1.0}]
    for press in grid["ppl_presses"]:
        for keep in grid["keeps"]:
            line = f"kvpress DecodingPress({SHORT[press]})"
            peers.append({"name": f"{line}{keep_label(keep)}", "cache": "dynamic", "press": press,
                          "target": math.ceil(keep * tokens), "keep": keep, "family": "kvpress", "line": line})
    return ours, peers


def speed_methods(grid: dict, length: int) -> list[tuple[str, dict]]:
    """(side, method), alternating sides so machine noise hits both alike. The peer environment's DynamicCache
    (a cross-check of the two transformers versions) runs at the first length only."""
    ours = []
    for policy, keep, bits in grid["speed_ours"]:
        if policy == "dynamic":
            ours.append({"name": "DynamicCache (transformers 5.23)", "kind": "dynamic"})
        elif policy == "full":
            ours.append({"name": f"ours full {bits}-bit", "kind": "ours", "policy": "full", "kv_bits": bits})
        else:
            ours.append({"name": f"ours {policy} {bits}-bit keep {keep:g}", "kind": "ours", "policy": policy,
                         "kv_bits": bits, "budget": keep})
    peers = []
    for cache, press in grid["speed_peers"]:
        if press is None:
            name = {"dynamic": "DynamicCache (transformers 5.2)", "quanto4": "QuantizedCache quanto int4",
                    "hqq4": "QuantizedCache HQQ int4"}[cache]
            if cache != "dynamic" or length == grid["speed_lengths"][0]:
                peers.append({"name": name, "cache": cache})
        else:
            peers.append({"name": f"kvpress {SHORT[press]}{CACHE_LABEL[cache]} keep {SPEED_KEEP:g}", "cache": cache,
                          "press": press, "ratio": round(1 - SPEED_KEEP, 6)})
    order = []
    for index in range(max(len(ours), len(peers))):
        if index < len(ours):
            order.append(("ours", ours[index]))
        if index < len(peers):
            order.append(("peers", peers[index]))
    return order


# ---------------------------------------------------------------------------------------------- summaries


def summarize_needle(records: list[dict], methods: list[dict], inputs: dict, tokenizer) -> list[dict]:
    from h2o_compress.evaluation.needle import is_correct

    rows = []
    for method in methods:
        mine = [r for r in records if r["method"] == method["name"]]
        errors = [r["error"] for r in mine if "error" in r]
        row = {k: method.get(k) for k in ("name", "family", "line", "keep", "bits")}
        if errors or not mine:
            row["error"] = errors[0] if errors else "no result"
            rows.append(row)
            continue
        answers, correct, nlls, kv, ctx_kv, kept = [], [], [], [], [], []
        for record in mine:
            item = inputs["needle"][record["item"]]
            ctx_kv.append(record["context_kv_bytes"])
            for question, result in zip(item["questions"], record["questions"]):
                text = tokenizer.decode(result["answer_ids"], skip_special_tokens=True)
                answers.append(text.strip())
                correct.append(is_correct(text, question["key"]))
                nlls.append(result["answer_nll"])
                kv.append(result["kv_bytes"])
                kept.append(result["kept_tokens"])
        row.update(questions=len(correct), accuracy=sum(correct) / len(correct), answer_nll=statistics.mean(nlls),
                   kv_bytes=statistics.mean(kv), context_kv_bytes=statistics.mean(ctx_kv),
                   kept_tokens=statistics.mean(kept), answers=answers,
                   seconds=sum(r["seconds"] for r in mine))
        rows.append(row)
    return rows


def summarize_ppl(records: list[dict], methods: list[dict]) -> list[dict]:
    by_name = {r["method"]: r for r in records}
    rows = []
    for method in methods:
        record = by_name.get(method["name"], {"error": "no result"})
        row = {k: method.get(k) for k in ("name", "family", "line", "keep")}
        row.update({k: v for k, v in record.items() if k != "method"})
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------- reporting


def mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def plot_quality(needle_rows, ppl_rows, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []

    def lines(rows, y_key, x_key):
        groups: dict[str, list] = {}
        for row in rows:
            if row.get("error") or row.get(y_key) is None or row.get(x_key) is None:
                continue
            groups.setdefault(row["line"], []).append((row[x_key] / 2**20, row[y_key]))
        return {name: sorted(points) for name, points in groups.items()}

    palette = {"h2o-heavy0.9": "darkred", "h2o": "tab:red", "local": "tab:olive", "sink": "tab:brown", "full": "tab:gray",
               "h2o-mean-heavy0.9": "crimson", "h2o-mean-heavy0.9-pyramid": "salmon", "snapkv-heavy0.9": "teal",
               "kvzip-heavy0.9": "indigo", "tova": "olive",
               "ObservedAttention": "tab:blue", "SnapKV": "tab:cyan", "StreamingLLM": "tab:purple", "TOVA": "tab:green",
               "Knorm": "tab:pink", "ExpectedAttention": "tab:orange", "KVzip": "navy", "PyramidKV": "peru",
               "AdaKV-ExpectedAttention": "goldenrod", "quanto": "black", "HQQ": "dimgray"}

    def style(name):
        color = next((c for key, c in palette.items() if f" {key} " in f" {name} " or f"({key})" in name), "black")
        if name.startswith("ours"):
            marker = {"16-bit": "o", "8-bit": "D", "4-bit": "s"}.get(name.split()[-1], "o")
            return dict(linestyle="-", linewidth=2.2, marker=marker, color=color)
        if name.startswith("Dynamic"):
            return dict(linestyle="none", marker="*", markersize=14, color="gold", markeredgecolor="black")
        if name.startswith("QuantizedCache"):
            return dict(linestyle="none", marker="P", markersize=10, color=color)
        if "quanto" in name:
            return dict(linestyle=":", marker="s", color=color, markerfacecolor="white")
        return dict(linestyle="--", marker="^", color=color)

    def scalar_axis(axis, y=False):
        from matplotlib.ticker import FormatStrFormatter, ScalarFormatter

        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(ScalarFormatter())
        axis.tick_params(axis="x", which="minor", labelsize=7)
        if y:
            axis.yaxis.set_major_formatter(FormatStrFormatter("%.2g"))
            axis.yaxis.set_minor_formatter(FormatStrFormatter("%.2g"))
            axis.tick_params(axis="y", which="minor", labelsize=7)

    figure, axes = plt.subplots(1, 2, figsize=(18, 6.5))
    for axis, key, label in ((axes[0], "accuracy", "pass keys retrieved (fraction)"),
                             (axes[1], "answer_nll", "NLL of the right answer (nats/token, lower is better)")):
        for name, points in lines(needle_rows, key, "kv_bytes").items():
            axis.plot(*zip(*points), label=name, **style(name))
        axis.set_xscale("log")
        scalar_axis(axis)
        axis.set_xlabel("KV cache MiB held while answering (log)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.suptitle("Long-context QA (3 pass keys in ~1k tokens, compressed at prefill), SmolLM2-135M, CPU")
    figure.tight_layout()
    path = out_dir / "peers_needle.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(str(path))

    if any(row.get("ppl_ratio") for row in ppl_rows):
        figure, axis = plt.subplots(figsize=(12, 6.5))
        for name, points in lines(ppl_rows, "ppl_ratio", "kv_bytes").items():
            axis.plot(*zip(*points), label=name, **style(name))
        axis.set_xscale("log")
        axis.set_yscale("log")
        scalar_axis(axis, y=True)
        axis.set_xlabel("KV cache MiB at the end of the stream (log)")
        axis.set_ylabel("perplexity / DynamicCache perplexity (log)")
        axis.set_title("Streaming perplexity (compression while reading), SmolLM2-135M, CPU")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        figure.tight_layout()
        path = out_dir / "peers_ppl.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(str(path))
    return written


def same_keep_pairs(needle_rows: list[dict]) -> list[dict]:
    """Each kvpress setting against ours at the same keep fraction and the same storage: ours h2o 16-bit (kept
    tokens unquantized, as kvpress alone) or 4-bit (as kvpress + quanto int4), with the default heavy_ratio 0.5
    and, where run, heavy_ratio 0.9 (most of the budget chosen by score, as kvpress does)."""
    by_name = {r["name"]: r for r in needle_rows if not r.get("error")}
    key = lambda row: (row["accuracy"], -row["answer_nll"])  # noqa: E731
    pairs = []
    for row in by_name.values():
        if not row["family"].startswith("kvpress"):
            continue
        bits = 4 if row["family"] == "kvpress+quanto" else 16
        mine = [by_name.get(f"ours {label} {bits}-bit keep {row['keep']:g}") for label in ("h2o", "h2o-heavy0.9")]
        if mine[0] is None:
            continue
        best = max(filter(None, mine), key=key)
        better = "ours" if key(best) > key(row) else "peer"
        if abs(best["answer_nll"] - row["answer_nll"]) <= 0.05 and best["accuracy"] == row["accuracy"]:
            better = "tie"
        pairs.append({"keep": row["keep"], "peer": row["name"], "peer_right": row["accuracy"],
                      "peer_nll": row["answer_nll"], "peer_kv_bytes": row["kv_bytes"],
                      "ours_default": mine[0], "ours_heavy": mine[1], "better": better})
    return sorted(pairs, key=lambda p: (-p["keep"], p["peer"]))


def comparisons(needle_rows: list[dict]) -> list[dict]:
    """Matched pairs at (nearly) equal bytes: ours h2o 16-bit vs each press alone, ours h2o 4-bit vs each press
    + quanto int4, at each keep fraction; and every peer vs our best setting holding no more bytes."""
    by_name = {r["name"]: r for r in needle_rows if not r.get("error")}
    ours = [r for r in by_name.values() if r["family"] == "ours"]
    pairs = []
    for row in by_name.values():
        if row["family"] not in ("kvpress", "kvpress+quanto", "QuantizedCache"):
            continue
        candidates = [o for o in ours if o["kv_bytes"] <= row["kv_bytes"] * 1.02]
        if not candidates:
            continue
        best = max(candidates, key=lambda o: (o["accuracy"], -o["answer_nll"]))
        verdict = "tie"
        if (best["accuracy"], -best["answer_nll"]) > (row["accuracy"], -row["answer_nll"] - 0.05):
            verdict = "ours"
        if row["accuracy"] > best["accuracy"] or (row["accuracy"] == best["accuracy"]
                                                   and row["answer_nll"] < best["answer_nll"] - 0.05):
            verdict = "peer"
        pairs.append({"peer": row["name"], "peer_accuracy": row["accuracy"], "peer_nll": row["answer_nll"],
                      "peer_kv_bytes": row["kv_bytes"], "ours": best["name"], "ours_accuracy": best["accuracy"],
                      "ours_nll": best["answer_nll"], "ours_kv_bytes": best["kv_bytes"], "better": verdict})
    return pairs


def keep_targets(needle_rows: list[dict]) -> list[dict]:
    """Issue 16's target, press by press at each keep fraction: of our settings at that keep holding no more bytes
    (2% slack) than the press, the one with the lowest answer NLL among those with at least its passkey accuracy
    (else the lowest NLL), and whether it beats the press on NLL with at least its accuracy."""
    rows = [r for r in needle_rows if not r.get("error") and r.get("keep") is not None and r["keep"] < 1]
    out = []
    for press in (r for r in rows if r["family"] in ("kvpress", "kvpress+quanto")):
        mine = [r for r in rows if r["family"] == "ours" and r["keep"] == press["keep"]
                and r["kv_bytes"] <= press["kv_bytes"] * 1.02]
        if not mine:
            continue
        enough = [r for r in mine if r["accuracy"] >= press["accuracy"]] or mine
        best = min(enough, key=lambda r: (r["answer_nll"], -r["accuracy"]))
        out.append({"keep": press["keep"], "press": press["name"], "press_accuracy": press["accuracy"],
                    "press_nll": press["answer_nll"], "press_kv_bytes": press["kv_bytes"], "ours": best["name"],
                    "ours_accuracy": best["accuracy"], "ours_nll": best["answer_nll"], "ours_kv_bytes": best["kv_bytes"],
                    "met": best["answer_nll"] < press["answer_nll"] and best["accuracy"] >= press["accuracy"]})
    return sorted(out, key=lambda t: (-t["keep"], t["press"]))


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        "# h2o-compress against kvpress and transformers' QuantizedCache",
        "",
        f"Generated by `{report['command']}` ({report['mode']} mode) on {report['date']}; "
        f"{report['machine']['cpus']} CPU cores shared with other jobs (load average "
        f"{report['machine']['load_start']} at the start, {report['machine']['load_end']} at the end), "
        f"{report['threads']} torch thread(s) per worker, fp32 weights and caches. Wall time "
        f"{report['wall_s'] / 60:.1f} min. Model: SmolLM2-135M-Instruct (30 layers, 3 KV heads x 64), the same converted "
        "safetensors on both sides; token ids made once by the main environment's tokenizer.",
        "",
        f"- ours: {_versions(report['ours_env'])}; h2o-compress at commit {report.get('core_revision', 'unknown')}",
        f"- peers: {_versions(report['peer_env'])}",
        "",
        "## Sanity",
        "",
    ]
    sanity = report.get("sanity", {})
    for key, value in sanity.items():
        lines.append(f"- {key}: {value}")
    lines += ["", "## Long-context QA (needle), compressed at prefill, questions afterwards", "",
              f"{report['needle_setup']}", "",
              "| method | keep | right | answer NLL | KV MiB answering | KV MiB context | % of DynamicCache | kept tokens |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    needle = report["needle"]
    dynamic = next((r for r in needle if r["name"].startswith("DynamicCache (transformers 5.23") and not r.get("error")),
                   None)
    for row in needle:
        if row.get("error"):
            lines.append(f"| {row['name']} | {row['keep']} | error: {row['error'][:160]} | | | | | |")
            continue
        share = 100 * row["kv_bytes"] / dynamic["kv_bytes"] if dynamic else float("nan")
        lines.append(
            f"| {row['name']} | {row['keep']:g} | {round(row['accuracy'] * row['questions'])}/{row['questions']} | "
            f"{row['answer_nll']:.3f} | {mib(row['kv_bytes'])} | {mib(row['context_kv_bytes'])} | {share:.1f} | "
            f"{row['kept_tokens']:.0f} |")
    lines += ["", "![needle](peers_needle.png)", "",
              "### Same keep fraction, same storage (ours h2o 16-bit vs a press alone; ours h2o 4-bit vs press + quanto)",
              "", "right / NLL / KiB held; 'heavy 0.9' = our H2O with heavy_ratio 0.9 instead of the default 0.5.", "",
              "| keep | peer | peer right | peer NLL | peer KiB | ours h2o | ours h2o heavy 0.9 | better |",
              "|---:|---|---:|---:|---:|---|---|---|"]
    cell = lambda r: "-" if r is None else f"{r['accuracy']:.2f} / {r['answer_nll']:.3f} / {r['kv_bytes'] / 1024:.0f}"  # noqa: E731
    for pair in report.get("same_keep", []):
        lines.append(
            f"| {pair['keep']:g} | {pair['peer']} | {pair['peer_right']:.2f} | {pair['peer_nll']:.3f} | "
            f"{pair['peer_kv_bytes'] / 1024:.0f} | {cell(pair['ours_default'])} | {cell(pair['ours_heavy'])} | "
            f"{pair['better']} |")
    targets = report.get("keep_targets") or keep_targets(needle)
    if targets:
        lines += ["", "### Every press at its keep: our best setting there, at equal or fewer bytes", "",
                  "Ours = of our settings at the same keep holding no more bytes than the press (2% slack), the lowest "
                  "answer NLL among those with at least the press's passkey accuracy. 'met': lower NLL and at least "
                  "the accuracy.", "",
                  "| keep | press | right | NLL | KiB | ours | right | NLL | KiB | met |",
                  "|---:|---|---:|---:|---:|---|---:|---:|---:|---|"]
        for t in targets:
            lines.append(
                f"| {t['keep']:g} | {t['press']} | {t['press_accuracy']:.2f} | {t['press_nll']:.3f} | "
                f"{t['press_kv_bytes'] / 1024:.0f} | {t['ours']} | {t['ours_accuracy']:.2f} | {t['ours_nll']:.3f} | "
                f"{t['ours_kv_bytes'] / 1024:.0f} | {'yes' if t['met'] else '**no**'} |")
        for keep in sorted({t["keep"] for t in targets}, reverse=True):
            missed = [t["press"] for t in targets if t["keep"] == keep and not t["met"]]
            lines.append(f"\nkeep {keep:g}: " + ("met against every press" if not missed else
                                                 "not met against " + ", ".join(missed)))
    lines += ["",
              "### Matched at equal or fewer bytes (ours = our best setting holding no more bytes than the peer)", "",
              "| peer | right | NLL | KiB | ours | right | NLL | KiB | better |", "|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for pair in report["comparisons"]:
        lines.append(
            f"| {pair['peer']} | {pair['peer_accuracy']:.2f} | {pair['peer_nll']:.3f} | {pair['peer_kv_bytes'] / 1024:.0f} | "
            f"{pair['ours']} | {pair['ours_accuracy']:.2f} | {pair['ours_nll']:.3f} | {pair['ours_kv_bytes'] / 1024:.0f} | "
            f"{pair['better']} |")
    lines += ["", "## Streaming perplexity (compression while reading)", "", report["ppl_setup"], "",
              "| method | keep | perplexity | x DynamicCache | KV MiB at end | kept tokens |", "|---|---:|---:|---:|---:|---:|"]
    for row in report["ppl"]:
        if row.get("error"):
            lines.append(f"| {row['name']} | {row['keep']} | error: {row['error'][:200]} | | | |")
            continue
        lines.append(f"| {row['name']} | {row['keep']:g} | {row['perplexity']:.3f} | {fmt(row.get('ppl_ratio'), '.3f')} | "
                     f"{mib(row['kv_bytes'])} | {row['kept_tokens']} |")
    lines += ["", "![ppl](peers_ppl.png)", "", "## Decode speed and memory", "", report["speed_setup"], "",
              "| context | method | prefill s | decode tok/s | x DynamicCache raw | x DynamicCache load-normalized | "
              "KV MiB | peak RSS prefill MiB | peak RSS decode MiB |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["speed"]:
        if row.get("error"):
            lines.append(f"| {row.get('length')} | {row['method']} | error: {row['error'][:200]} | | | | | | |")
            continue
        lines.append(f"| {row['length']} | {row['method']} | {row['prefill_s']:.2f} | {row['decode_tokens_per_s']:.2f} | "
                     f"{fmt(row.get('speed_vs_dynamic'), '.2f')} | {fmt(row.get('speed_vs_dynamic_normalized'), '.2f')} | "
                     f"{mib(row['kv_bytes'])} | {row['peak_prefill_mib']:.0f} | "
                     f"{row['peak_decode_mib']:.0f} |")
    if report.get("failures"):
        lines += ["", "## What could not be run", ""] + [f"- {f}" for f in report["failures"]]
    lines += ["", "Notes on where a peer is ahead, why, and what would close it: `benchmarks/README.md`, "
              "section *compare_peers.py*.", ""]
    path.write_text("\n".join(lines))


def core_revision() -> str:
    """The git commit of the checkout, marked when h2o_compress/ has uncommitted changes ("unknown" outside git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "h2o_compress"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
        return commit + (" + uncommitted changes in h2o_compress/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions(env: dict) -> str:
    if not env or env.get("error"):
        return f"not available ({(env or {}).get('error', 'not started')[:300]})"
    return ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items()) + f", python {env.get('python')}"


# -------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="mode", help="smoke test (~5 min)")
    size.add_argument("--full", action="store_const", const="full", dest="mode", help="every setting (~1 h)")
    parser.add_argument("--tasks", default="needle,ppl,speed", help="comma list of needle, ppl, speed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per worker (default 1: on a shared 2-core machine more threads oversubscribe)")
    parser.add_argument("--venv", default=str(PEERS / ".venv"), help="where the peer virtual environment lives")
    parser.add_argument("--no-peers", action="store_true", help="run our side only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default="",
                        help="comma list of substrings: run only the QA / perplexity settings whose name contains "
                             "one of them (the DynamicCache references always run), e.g. 'kvzip-heavy1,KVzip keep'")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--keep-workdir", action="store_true", help="keep worker logs and intermediate JSON")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild peers.md and the plots from an existing peers.json (no measurement)")
    args = parser.parse_args()
    if args.report_only:
        out_dir = Path(args.out_dir)
        report = json.loads((out_dir / "peers.json").read_text())
        report["plots"] = plot_quality(report["needle"], report["ppl"], out_dir)
        (out_dir / "peers.json").write_text(json.dumps(report, indent=1, default=str))
        write_markdown(report, out_dir / "peers.md")
        say(f"rebuilt {out_dir / 'peers.md'} and {len(report['plots'])} plot(s) from peers.json")
        return
    mode = args.mode or "default"
    grid = MODES[mode]
    tasks = set(args.tasks.split(","))
    started = time.time()
    load_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="compare-peers-"))
    say(f"mode {mode}, tasks {sorted(tasks)}, workdir {workdir}")
    failures: list[str] = []

    from h2o_compress import load_model
    from h2o_compress.models import converted_dir

    model_dir = converted_dir("smollm2-135m")
    _, tokenizer = load_model("smollm2-135m", device="cpu")
    inputs = build_inputs(tokenizer, grid, args.seed)
    inputs_path = workdir / "inputs.json"
    inputs_path.write_text(json.dumps(inputs))
    say(f"inputs: {len(inputs['needle'])} QA contexts of {[len(i['context_ids']) for i in inputs['needle']]} tokens, "
        f"{len(inputs['ppl_ids'])} perplexity tokens, speed at {list(inputs['speed_ids'])}")

    peer_python, venv_error = (None, "--no-peers") if args.no_peers else ensure_peer_venv(Path(args.venv))
    if venv_error and not args.no_peers:
        failures.append(f"peer environment could not be built: {venv_error}")
    ours = Worker("ours", [sys.executable, str(PEERS / "ours_worker.py")], workdir, args.threads)
    peers = Worker("peers", [str(peer_python), str(PEERS / "peer_worker.py")], workdir, args.threads) \
        if peer_python else None
    ours.send("load", model="smollm2-135m", threads=args.threads)
    if peers:
        peers.send("load", model_dir=str(model_dir), threads=args.threads)
    ours_env = ours.receive()
    peer_env = peers.receive() if peers else {"error": venv_error}
    if ours_env.get("error"):
        raise SystemExit(f"our worker failed to load the model: {ours_env['error']}")
    if peers and peer_env.get("error"):
        failures.append(f"peer worker failed to load the model: {peer_env['error'][-1500:]}")
        peers.close()
        peers = None
    say("workers ready:", _versions(ours_env), "|", _versions(peer_env))

    # sanity: the same ids give the same logits in both environments
    sanity: dict = {}
    sanity_ids = inputs["needle"][0]["context_ids"][:512]
    logits_path = workdir / "ours_logits.pt"
    result = ours.call("sanity", ids=sanity_ids, save_logits=str(logits_path))
    sanity["ours: full 16-bit vs DynamicCache, max |logit diff| (512 tokens)"] = result.get(
        "ours_full16_vs_dynamic_max_abs_logit_diff", result.get("error"))
    if peers:
        result = peers.call("sanity", ids=sanity_ids, ours_logits=str(logits_path))
        sanity["peer env DynamicCache (transformers 5.2) vs ours DynamicCache (5.23), max |logit diff|"] = result.get(
            "max_abs_logit_diff", result.get("error"))
        sanity["same argmax at every position"] = result.get("argmax_agreement")

    shown, skip = [], False  # the command as given, without the venv path (this machine's own)
    for arg in sys.argv[1:]:
        if not skip and not arg.startswith("--venv"):
            shown.append(arg)
        skip = arg == "--venv"
    report: dict = {"command": " ".join(["python benchmarks/compare_peers.py", *shown]),
                    "mode": mode, "date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                    "core_revision": core_revision(),
                    "ours_env": ours_env, "peer_env": peer_env, "grid": {k: str(v) for k, v in grid.items()},
                    "needle": [], "ppl": [], "speed": [], "comparisons": []}
    ours_needle, peer_needle = needle_methods(grid)
    ours_ppl, peer_ppl = ppl_methods(grid, len(inputs["ppl_ids"]))
    if args.methods:
        wanted = [part.strip() for part in args.methods.split(",") if part.strip()]
        ours_needle, peer_needle, ours_ppl, peer_ppl = (
            [m for m in methods if m["name"].startswith("DynamicCache") or any(w in m["name"] for w in wanted)]
            for methods in (ours_needle, peer_needle, ours_ppl, peer_ppl))

    # quality: both workers at once
    queued = []
    if "needle" in tasks:
        ours.send("needle", inputs=str(inputs_path), methods=ours_needle, max_new_tokens=grid["max_new_tokens"])
        if peers:
            peers.send("needle", inputs=str(inputs_path), methods=peer_needle, max_new_tokens=grid["max_new_tokens"])
        queued.append("needle")
    if "ppl" in tasks:
        ours.send("ppl", inputs=str(inputs_path), methods=ours_ppl, chunk=grid["ppl_chunk"])
        if peers:
            peers.send("ppl", inputs=str(inputs_path), methods=peer_ppl, chunk=grid["ppl_chunk"])
        queued.append("ppl")
    say(f"quality tasks queued ({', '.join(queued)}): {len(ours_needle)} + {len(peer_needle)} QA settings, "
        f"{len(ours_ppl)} + {len(peer_ppl)} perplexity settings")
    records = {task: [] for task in queued}
    for task in queued:
        for worker in filter(None, (ours, peers)):
            result = worker.receive()
            if result.get("error"):
                failures.append(f"{worker.name} {task} failed: {result['error'][-1500:]}")
            records[task] += result.get("results", [])
        say(f"{task} done")
    if "needle" in records:
        report["needle"] = summarize_needle(records["needle"], ours_needle + (peer_needle if peers else []), inputs,
                                            tokenizer)
        report["comparisons"] = comparisons(report["needle"])
        report["same_keep"] = same_keep_pairs(report["needle"])
        report["keep_targets"] = keep_targets(report["needle"])
    if "ppl" in records:
        report["ppl"] = summarize_ppl(records["ppl"], ours_ppl + (peer_ppl if peers else []))
        reference = next((r.get("perplexity") for r in report["ppl"]
                          if r["name"].startswith("DynamicCache (transformers 5.23")), None)
        for row in report["ppl"]:
            if reference and row.get("perplexity"):
                row["ppl_ratio"] = row["perplexity"] / reference
    for row in report["needle"] + report["ppl"]:
        if row.get("error"):
            failures.append(f"{row['name']}: {row['error'][:600]}")

    ours.close()
    if peers:
        peers.close()

    # speed: one setting at a time, each in a fresh worker process (clean peak-memory figures), alternating sides
    if "speed" in tasks:
        for length in grid["speed_lengths"]:
            for index, (side, method) in enumerate(speed_methods(grid, length)):
                if side == "peers" and not peer_python:
                    continue
                if side == "ours":
                    worker = Worker(f"speed-{length}-{index}-ours", [sys.executable, str(PEERS / "ours_worker.py")],
                                    workdir, args.threads)
                    loaded = worker.call("load", model="smollm2-135m", threads=args.threads)
                else:
                    worker = Worker(f"speed-{length}-{index}-peers", [str(peer_python), str(PEERS / "peer_worker.py")],
                                    workdir, args.threads)
                    loaded = worker.call("load", model_dir=str(model_dir), threads=args.threads)
                result = loaded if loaded.get("error") else worker.call(
                    "speed", inputs=str(inputs_path), method=method, length=length, steps=grid["speed_steps"])
                worker.close()
                result.setdefault("method", method["name"])
                result.setdefault("length", length)
                result["side"] = side
                report["speed"].append(result)
                if result.get("error"):
                    failures.append(f"speed {method['name']} at {length}: {result['error'][:600]}")
                else:
                    say(f"speed {length} {method['name']}: {result['decode_tokens_per_s']:.2f} tok/s "
                        f"({result.get('decode_cost_vs_probe', float('nan')):.2f} probes/step), "
                        f"prefill {result['prefill_s']:.1f}s")
        for length in grid["speed_lengths"]:
            base = next((r for r in report["speed"] if r["length"] == length and not r.get("error")
                         and r["method"].startswith("DynamicCache (transformers 5.23")), None)
            for row in report["speed"]:
                if base and row["length"] == length and not row.get("error"):
                    row["speed_vs_dynamic"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                    if row.get("decode_cost_vs_probe") and base.get("decode_cost_vs_probe"):
                        row["speed_vs_dynamic_normalized"] = base["decode_cost_vs_probe"] / row["decode_cost_vs_probe"]

    report["failures"] = failures
    report["sanity"] = sanity
    report["wall_s"] = time.time() - started
    report["machine"] = {"cpus": os.cpu_count(), "load_start": load_start,
                         "load_end": " ".join(f"{x:.1f}" for x in os.getloadavg()), "platform": platform.platform()}
    n_ctx = [len(i["context_ids"]) for i in inputs["needle"]]
    report["needle_setup"] = (
        f"{len(n_ctx)} context(s) of {n_ctx} tokens, 3 pass keys each at depths {list(DEPTHS)}, 3 questions per "
        f"context answered after the compressed prefill, greedy, at most {grid['max_new_tokens']} new tokens; "
        "'right' = the first number written is the pass key. 'answer NLL' = teacher-forced NLL of the right "
        "answer's tokens (space + 5 digits). 'keep' b: kvpress compression_ratio = 1 - b; ours: the context "
        "compressed to int(b x context) tokens, each question + answer added to a frozen copy (compress-then-ask, "
        "as h2o_compress.runtime.ask), i.e. what kvpress holds while answering. KV MiB answering = mean "
        "bytes held at the end of the answer (every tensor: data, scales, zero points, our fp32 scores).")
    report["ppl_setup"] = (
        f"{len(inputs['ppl_ids'])} tokens of the shipped corpus read {grid['ppl_chunk']} tokens per forward pass; "
        "ours: budget b of the stream length, eviction after each chunk; kvpress: DecodingPress(press, "
        "compression_interval=1, target_size=ceil(b x tokens)), so the same token count after each chunk; "
        "QuantizedCache: int4 with its 128-token full-precision residual, no eviction.")
    report["speed_setup"] = (
        f"Prefill of {list(grid['speed_lengths'])} tokens of real prose then {grid['speed_steps']} greedy decode steps; "
        "decode tok/s = 1 / median step time. Each setting runs alone, in a fresh worker process of its side (model "
        "loaded, 64-token warm-up); sides alternate. Load-normalized: each decode step is followed by a fixed probe "
        "(the 30 MLPs on one token) and the step/probe ratio's median is compared with DynamicCache's, so other jobs "
        "on the shared machine cancel out; raw ratios move by +-30% between identical runs here. Peak RSS = the "
        "kernel's high-water mark (VmHWM, reset per phase) above the process's idle level during prefill / during "
        "decode (the decode figure includes the cache); model weights excluded; single runs, so allocator-dependent "
        "(read differences under ~50 MiB as noise).")
    report["plots"] = plot_quality(report["needle"], report["ppl"], out_dir) if report["needle"] or report["ppl"] else []
    (out_dir / "peers.json").write_text(json.dumps(report, indent=1, default=str))
    write_markdown(report, out_dir / "peers.md")
    say(f"wrote {out_dir / 'peers.json'}, {out_dir / 'peers.md'} and {len(report['plots'])} plot(s) "
        f"in {report['wall_s'] / 60:.1f} min")
    for failure in failures:
        say("FAILED:", failure[:300])
    if args.keep_workdir:
        say("worker logs and intermediate files kept in", workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
