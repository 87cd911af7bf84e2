"""Ours against llama.cpp and OpenVINO GenAI on CPU, side by side in one run (issue 50, Build item 3).

    python benchmarks/cpu_peers.py --peers-python benchmarks/peers/venv-cpu/bin/python \\
        --prompt-tokens 1024,7900 --new-tokens 128 --repeats 2

Every run is one fresh worker process (``benchmarks/peers/cpu_worker.py``): ours under this interpreter, the peers
under ``--peers-python`` (their own virtual environment: ``benchmarks/peers/requirements-cpu.txt`` says how to make
it; an engine that environment cannot import is skipped with a one-line note). All get the same prompt token ids
(the reporting text ``--text`` of `h2o_compress.evaluation.corpus`, tokenized here once, no special tokens), the same
threads (``OMP_WAIT_POLICY=passive``, ``--threads``), and decode exactly ``--new-tokens`` tokens greedily (end of
sequence ignored). Within each repeat every setting runs once, the order rotated between repeats; medians.

Settings (``--engines`` takes engine names, ``ours``, ``llama.cpp``, ``openvino``, or setting names):
  ours            h2o 0.2 + int4 KV, ``load_model``'s CPU defaults (weights as the package loads them on CPU)
  ours-fp32       the same with ``weights_bits=16`` (fp32 weights)
  ours-int4       the same with ``weights_bits=4`` (torch's int4 kernel, groups of 32; the head int8)
  llama-f16       llama-cpp-python on the same GGUF (Q4_1 weights), f16 KV (flash attention off: its default)
  llama-f16-fa    the same with flash attention on (llama.cpp's own CLI default on CPU is "auto")
  llama-q4_0      the same, q4_0 KV (its V cache needs flash attention, so flash attention on)
  ov-fp32         OpenVINO GenAI LLMPipeline, fp32 IR (optimum-cli export of our converted model), default KV (u8)
  ov-fp32-h2o-u4  + CacheEvictionConfig (SUM aggregation, 20% of prompt + new tokens held), u4 KV
  ov-int8         int8-weight IR, default KV (u8)
  ov-int8-h2o-u8  int8 IR + eviction, u8 KV
  ov-int8-h2o-u4  int8 IR + eviction, u4 KV

Reported per setting and prompt length: decode tokens/s, prefill tokens/s, end to end seconds (prefill + the new
tokens), peak RSS of the worker process (its VmHWM: load included), and the bytes a decode step reads
(weights + the KV cache held at the end, estimated per engine as the JSON's ``notes`` say) against the copy
bandwidth measured in the same run (a torch copy of a 256 MiB buffer, ``--threads`` threads, before and after).

Writes ``--out`` (JSON, every run) and the same path with ``.md``, the command beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "peers" / "cpu_worker.py"
REQUIREMENTS = "benchmarks/peers/requirements-cpu.txt"
DEFAULT_PEERS_PYTHON = ROOT / "benchmarks" / "peers" / "venv-cpu" / "bin" / "python"
ALIAS = "smollm2-135m"
BUDGET = 0.2
OURS = {"policy": "h2o", "budget": BUDGET, "kv_bits": 4}
SETTINGS = {  # name -> (engine, options, label)
    "ours": ("ours", dict(OURS), "ours, h2o 0.2 + int4 KV, CPU default weights"),
    "ours-fp32": ("ours", dict(OURS, weights_bits=16), "ours, h2o 0.2 + int4 KV, fp32 weights"),
    "ours-int4": ("ours", dict(OURS, weights_bits=4), "ours, h2o 0.2 + int4 KV, 4-bit weights (int4 groups of 32)"),
    "llama-f16": ("llama.cpp", {"kv_type": "f16"}, "llama.cpp, Q4_1 weights, f16 KV, no flash attn"),
    "llama-f16-fa": ("llama.cpp", {"kv_type": "f16", "flash_attn": True},
                     "llama.cpp, Q4_1 weights, f16 KV, flash attn"),
    "llama-q4_0": ("llama.cpp", {"kv_type": "q4_0", "flash_attn": True}, "llama.cpp, Q4_1 weights, q4_0 KV (flash attn)"),
    "ov-fp32": ("openvino", {"ir": "fp32"}, "OpenVINO GenAI, fp32 IR, u8 KV (default)"),
    "ov-fp32-h2o-u4": ("openvino", {"ir": "fp32", "evict": True, "budget": BUDGET, "kv": "u4"},
                       "OpenVINO GenAI, fp32 IR, H2O eviction (SUM), u4 KV"),
    "ov-int8": ("openvino", {"ir": "int8"}, "OpenVINO GenAI, int8 IR, u8 KV (default)"),
    "ov-int8-h2o-u8": ("openvino", {"ir": "int8", "evict": True, "budget": BUDGET, "kv": "u8"},
                       "OpenVINO GenAI, int8 IR, H2O eviction (SUM), u8 KV"),
    "ov-int8-h2o-u4": ("openvino", {"ir": "int8", "evict": True, "budget": BUDGET, "kv": "u4"},
                       "OpenVINO GenAI, int8 IR, H2O eviction (SUM), u4 KV"),
}
ENGINE_MODULES = {"llama.cpp": "llama_cpp", "openvino": "openvino_genai"}
# KV bytes per element and per (token, KV head, K or V, layer) beside the elements (scales, zero points)
KV_FORMATS = {"f16": (2.0, 0), "q4_0": (18 / 32, 0), "u8": (1.0, 8), "u4": (0.5, 8)}
NOTES = [
    "Each run is a fresh process; timings exclude loading, after a 32-token, 2-new-token warm-up in that process.",
    "decode tokens/s = (new tokens - 1) / seconds after the first new token (ours, llama.cpp: timed around the "
    "steps; OpenVINO: the generate call's wall time minus its own TTFT); prefill tokens/s = prompt / seconds to "
    "the first new token; end to end = prefill + decode seconds.",
    "Peak RSS: the worker process's VmHWM over its life (loading included; not ru_maxrss, which a child "
    "inherits from its parent on Linux); run_peak_rss_bytes in the JSON is the timed run's own peak (VmHWM reset "
    "after the warm-up).",
    "Bytes read per decoded token = weights read + KV held at the end of the run. Weights: ours, every parameter "
    "and buffer but an untied input embedding (one row read per token); llama.cpp, the GGUF's tensor bytes "
    "(SmolLM2's head is tied to token_embd, read in full); OpenVINO, the IR's openvino_model.bin. KV: ours, "
    "cache.nbytes(); llama.cpp, tokens held x layers x 2 x KV heads x head_dim at the KV type's size (f16 2 B, "
    "q4_0 18 B per 32); OpenVINO, tokens held (prompt + new, or at most max_cache_size with eviction) x the same "
    "elements at u8 1 B / u4 0.5 B plus 8 B of scale and zero point per token, head, K or V and layer.",
    "Copy bandwidth: memory traffic per second of a torch copy of a 256 MiB buffer, bytes read + bytes written "
    "(STREAM's convention, twice the bytes copied), median of 10, measured before and after the runs (the median "
    "of the two is used); 'of copy' = the decode step's bytes read per second / that figure.",
    "Weight products alone (ours): after the timed run, the same process calls every linear layer of the model "
    "(int8 through torch's _weight_int8pack_mm, 4-bit through _weight_int4pack_mm_for_cpu, or fp32; the head included) in model order on one row of its "
    "input width, as one decode step does, and takes the median of 20 passes; 1 / that time bounds any decode "
    "step built on these kernels.",
]


# ---------------------------------------------------------------------------------------------------- options


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="ours,llama.cpp,openvino",
                        help="comma-separated engines (ours, llama.cpp, openvino) or settings (" + ", ".join(SETTINGS) + ")")
    parser.add_argument("--prompt-tokens", default="1024,7900", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", default="persuasion", help="the reporting text the prompt tokens come from")
    parser.add_argument("--peers-python", default=os.environ.get("H2O_CPU_PEERS_PYTHON", str(DEFAULT_PEERS_PYTHON)),
                        help="the interpreter of the peers' environment (see " + REQUIREMENTS + ")")
    parser.add_argument("--work-dir", default=str(Path.home() / ".cache" / "h2o-compress-bench" / "cpu_peers"),
                        help="where the converted model and the OpenVINO IRs are kept between runs")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one worker run may take")
    parser.add_argument("--out", default="benchmarks/results/cpu_peers.json")
    parser.add_argument("--note", default="", help="a line for the markdown (e.g. the machine's load)")
    args = parser.parse_args(argv)
    args.settings = resolve_settings(parser, args.engines)
    try:
        args.lengths = [int(t) for t in args.prompt_tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--prompt-tokens {args.prompt_tokens!r}: comma-separated integers expected")
    if not args.lengths or min(args.lengths) < 33 or max(args.lengths) + args.new_tokens > 8192:
        parser.error("--prompt-tokens: each length from 33 to 8192 - --new-tokens (SmolLM2's context)")
    if args.new_tokens < 2 or args.repeats < 1 or args.threads < 1:
        parser.error("--new-tokens must be >= 2, --repeats and --threads >= 1")
    return args


def resolve_settings(parser: argparse.ArgumentParser, engines: str) -> list[str]:
    """The settings ``--engines`` names, in the table's order."""
    wanted = {name.strip() for name in engines.split(",") if name.strip()}
    known = {engine for engine, _, _ in SETTINGS.values()} | set(SETTINGS)
    unknown = sorted(wanted - known)
    if unknown or not wanted:
        parser.error(f"--engines: unknown {unknown}; allowed: {', '.join(sorted(known))}")
    return [name for name, (engine, _, _) in SETTINGS.items() if name in wanted or engine in wanted]


# ------------------------------------------------------------------------------------------------ preparation


def prompt_ids(text: str, tokens: int) -> list[int]:
    """The first ``tokens`` token ids of reporting text ``text`` (SmolLM2's tokenizer, no special tokens)."""
    from transformers import AutoTokenizer

    from h2o_compress.evaluation.corpus import reporting_text, tokenize_text
    from h2o_compress.models import converted_dir

    tokenizer = AutoTokenizer.from_pretrained(converted_dir(ALIAS))
    ids = tokenize_text(tokenizer, reporting_text(text), tokens)[0].tolist()
    if len(ids) < tokens:
        sys.exit(f"error: text {text!r} gives {len(ids)} tokens, fewer than --prompt-tokens {tokens}")
    return ids


def available_engines(settings: list[str], peers_python: str) -> dict[str, str | None]:
    """For each peer engine the settings need: ``None`` when ``peers_python`` imports it, else why not."""
    found = {}
    for engine in sorted({SETTINGS[name][0] for name in settings} - {"ours"}):
        module = ENGINE_MODULES[engine]
        if not Path(peers_python).exists():
            found[engine] = f"{peers_python} does not exist"
            continue
        done = subprocess.run([peers_python, "-c", f"import {module}"], capture_output=True, text=True)
        found[engine] = None if done.returncode == 0 else f"{module} not importable by {peers_python}"
    return found


def gguf_facts(path: Path) -> dict:
    """The GGUF's tensor bytes, the bytes a decode step reads (the input embedding is skipped when the file has
    its own output head) and the model's KV geometry."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {tensor.name: int(tensor.n_bytes) for tensor in reader.tensors}
    total = sum(sizes.values())
    read = total - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)
    return {"path": str(path), "tensor_bytes": total, "read_bytes": read, "tied_head": "output.weight" not in sizes}


def model_geometry() -> dict:
    from h2o_compress.models import converted_dir

    config = json.loads((converted_dir(ALIAS) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {"layers": config["num_hidden_layers"], "kv_heads": config["num_key_value_heads"], "head_dim": head_dim}


def export_irs(work: Path, peers_python: str, formats: set[str]) -> dict[str, str]:
    """OpenVINO IRs of our converted SmolLM2 (``save_pretrained`` of ``load_model(weights_bits=16)``, then
    ``optimum-cli export openvino --weight-format fp32|int8``), made once per GGUF and kept in ``work``."""
    hf = work / "hf"
    if not (hf / "model.safetensors").exists():
        from h2o_compress import load_model

        model, tokenizer = load_model(ALIAS, device="cpu", weights_bits=16)
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
        del model
    cli = Path(peers_python).parent / "optimum-cli"
    paths = {}
    for weight_format in sorted(formats):
        target = work / f"ov-{weight_format}"
        if not (target / "openvino_model.bin").exists():
            print(f"exporting the OpenVINO IR ({weight_format}) to {target} ...", flush=True)
            done = subprocess.run([str(cli), "export", "openvino", "--model", str(hf), "--task",
                                   "text-generation-with-past", "--weight-format", weight_format, str(target)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"optimum-cli export ({weight_format}) failed: {done.stderr.strip()[-600:]}")
        paths[weight_format] = str(target)
    return paths


def copy_bandwidth(threads: int, mib: int = 256, repeats: int = 10) -> float:
    """Memory traffic per second of ``torch.Tensor.copy_`` of a ``mib`` MiB buffer (bytes read + bytes written,
    STREAM's convention: twice the bytes copied), median of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    source = torch.ones(mib * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - began)
    return 2 * source.numel() / statistics.median(times)


# ------------------------------------------------------------------------------------------------------ runs


def worker_env(threads: int) -> dict:
    return dict(os.environ, OMP_WAIT_POLICY="passive", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                OPENBLAS_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def run_worker(name: str, length: int, args, context: dict, scratch: Path) -> dict:
    """One fresh worker process for setting ``name`` at ``length`` prompt tokens; its result record."""
    engine, options, _ = SETTINGS[name]
    options = dict(options)
    if engine == "llama.cpp":
        options["gguf"] = context["gguf"]["path"]
    if engine == "openvino":
        options["ir"] = context["irs"][options["ir"]]
    out = scratch / f"{name}-{length}.json"
    out.unlink(missing_ok=True)
    job = {"engine": engine, "setting": name, "options": options, "ids_file": context["ids_file"],
           "prompt_tokens": length, "new_tokens": args.new_tokens, "threads": args.threads, "out": str(out)}
    job_file = scratch / "job.json"
    job_file.write_text(json.dumps(job))
    python = sys.executable if engine == "ours" else args.peers_python
    try:
        done = subprocess.run([python, str(WORKER), str(job_file)], capture_output=True, text=True,
                              timeout=args.timeout, env=worker_env(args.threads), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"setting": name, "engine": engine, "error": f"timed out after {args.timeout:.0f} s"}
    if not out.exists():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"setting": name, "engine": engine, "error": f"worker exited {done.returncode}: {tail}"}
    return json.loads(out.read_text())


def run_all(args, context: dict, scratch: Path) -> list[dict]:
    """Every setting at every length, ``--repeats`` times, alternating: one pass over the settings per repeat,
    the order rotated by one each repeat."""
    runs = []
    for length in args.lengths:
        for repeat in range(args.repeats):
            shift = repeat % len(context["settings"])
            order = context["settings"][shift:] + context["settings"][:shift]
            for name in order:
                record = run_worker(name, length, args, context, scratch)
                record.update(repeat=repeat, length=length)
                runs.append(record)
                print(run_line(record), flush=True)
    return runs


def run_line(record: dict) -> str:
    head = f"{record['length']:>5} tokens  repeat {record['repeat']}  {record['setting']:<15}"
    if "error" in record:
        return f"{head} error: {record['error']}"
    return (f"{head} decode {record['decode_tokens_per_s']:7.2f} tok/s  prefill {record['prefill_tokens_per_s']:7.1f}"
            f" tok/s  e2e {record['end_to_end_s']:6.2f} s  peak RSS {record['peak_rss_bytes'] / 2**20:6.0f} MiB")


# ---------------------------------------------------------------------------------------------------- figures


def kv_estimate(record: dict, geometry: dict) -> int | None:
    """The KV bytes a peer holds at the end of its run (NOTES say how); ours reports its own."""
    options = SETTINGS[record["setting"]][1]
    held = record["prompt_tokens"] + record["new_tokens"]
    if record["engine"] == "llama.cpp":
        kind = options["kv_type"]
    elif record["engine"] == "openvino":
        kind = options.get("kv") or "u8"
        if record.get("eviction"):
            held = min(held, record["eviction"]["max_cache_size"])
    else:
        return record.get("kv_bytes")
    element, extra = KV_FORMATS[kind]
    slots = geometry["layers"] * 2 * geometry["kv_heads"]
    return int(held * slots * (geometry["head_dim"] * element + extra))


def weights_estimate(record: dict, context: dict) -> int | None:
    if record["engine"] == "ours":
        return record.get("weights_read_bytes")
    if record["engine"] == "llama.cpp":
        return context["gguf"]["read_bytes"]
    ir = context["irs"][SETTINGS[record["setting"]][1]["ir"]]
    return (Path(ir) / "openvino_model.bin").stat().st_size


def summarize(runs: list[dict], context: dict, copy_Bps: float) -> list[dict]:
    """One row per (length, setting): medians over the repeats that ran, the bytes per token and their rate."""
    rows = []
    for length in sorted({r["length"] for r in runs}):
        for name in context["settings"]:
            mine = [r for r in runs if r["length"] == length and r["setting"] == name]
            good = [r for r in mine if "error" not in r]
            row = {"setting": name, "label": SETTINGS[name][2], "engine": SETTINGS[name][0], "length": length,
                   "repeats": len(good), "errors": [r["error"] for r in mine if "error" in r]}
            if good:
                row.update({key: statistics.median(r[key] for r in good) for key in (
                    "decode_tokens_per_s", "prefill_tokens_per_s", "end_to_end_s", "peak_rss_bytes")})
                row["version"] = good[0]["version"]
                row["generated"] = good[0]["generated"]
                row["weights_read_bytes"] = weights_estimate(good[0], context)
                row["kv_bytes"] = kv_estimate(good[0], context["geometry"])
                row["bytes_per_token"] = row["weights_read_bytes"] + row["kv_bytes"]
                row["read_Bps"] = row["bytes_per_token"] * row["decode_tokens_per_s"]
                row["of_copy"] = row["read_Bps"] / copy_Bps
                if "weight_products_s" in good[0]:
                    row["weight_products_s"] = statistics.median(r["weight_products_s"] for r in good)
            rows.append(row)
    return rows


def same_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def criteria(rows: list[dict]) -> list[str]:
    """The issue's bars, where the run has both sides: ours' decode against llama.cpp f16 and OpenVINO's int8
    eviction, and end to end against llama.cpp."""
    lines = []
    for length in sorted({r["length"] for r in rows}):
        at = {r["setting"]: r for r in rows if r["length"] == length and r.get("repeats")}
        if "ours" not in at:
            continue
        ours = at["ours"]
        for peer in ("llama-f16", "ov-int8-h2o-u8", "ov-int8-h2o-u4"):
            if peer in at:
                lines.append(f"- {length} tokens: ours / {peer} decode = "
                             f"{ours['decode_tokens_per_s'] / at[peer]['decode_tokens_per_s']:.2f}x")
        if "llama-f16" in at:
            lines.append(f"- {length} tokens: end to end llama-f16 / ours = "
                         f"{at['llama-f16']['end_to_end_s'] / ours['end_to_end_s']:.2f}x (above 1: ours faster)")
        lines.extend(products_bound(length, ours, at))
    return lines


def products_bound(length: int, ours: dict, at: dict) -> list[str]:
    """Ours' weight products alone (every linear layer on one row, nothing else of the step) as a ceiling on its
    decode speed, against each OpenVINO eviction row's whole decode step."""
    if not ours.get("weight_products_s"):
        return []
    ceiling = 1 / ours["weight_products_s"]
    lines = [f"- {length} tokens: ours' weight products alone take {ours['weight_products_s'] * 1e3:.2f} ms per "
             f"token: no step on these kernels decodes faster than {ceiling:.1f} tokens/s"]
    for peer in ("ov-int8-h2o-u8", "ov-int8-h2o-u4"):
        if peer in at:
            lines.append(f"- {length} tokens: that ceiling / {peer} decode = "
                         f"{ceiling / at[peer]['decode_tokens_per_s']:.2f}x")
    return lines


# ----------------------------------------------------------------------------------------------------- output


def render(data: dict) -> str:
    """The markdown report: the command, the machine, one table per prompt length, the bars, the notes."""
    lines = ["# CPU decode against llama.cpp and OpenVINO GenAI", "", "```", data["command"], "```", "",
             f"- machine: {data['environment']['cpu']}, {data['environment']['cores']} cores; threads "
             f"{data['threads']}; load average before/after {data['load_before']} / {data['load_after']}",
             f"- copy bandwidth: {data['copy_Bps_before'] / 1e9:.2f} GB/s before, "
             f"{data['copy_Bps_after'] / 1e9:.2f} after (256 MiB torch copy, read + write)",
             f"- prompt: the first tokens of the reporting text `{data['text']}`; {data['new_tokens']} new tokens, "
             f"greedy, end of sequence ignored; {data['repeats']} repeat(s), medians",
             f"- commit {data['environment']['commit']}, torch {data['environment']['torch']}, "
             f"transformers {data['environment']['transformers']}"]
    if data.get("note"):
        lines.append(f"- {data['note']}")
    lines += [f"- skipped: {line}" for line in data["skipped"]]
    for length in sorted({r["length"] for r in data["rows"]}):
        lines += ["", f"## {length}-token prompt", "", table_head()]
        reference = next((r for r in data["rows"] if r["length"] == length and r.get("repeats")), None)
        lines += [table_row(r, reference) for r in data["rows"] if r["length"] == length]
    bars = criteria(data["rows"])
    if bars:
        lines += ["", "## Against the issue's bars", "", *bars]
    lines += ["", "## How the figures are made", "", *[f"- {note}" for note in data["notes"]], ""]
    return "\n".join(lines)


def table_head() -> str:
    return ("| setting | version | decode tok/s | prefill tok/s | end to end s | peak RSS MiB | weights MB read | "
            "KV MB | MB read/token | GB/s read | of copy | same tokens as first row |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(row: dict, reference: dict | None) -> str:
    if not row.get("repeats"):
        return f"| {row['label']} | | {'; '.join(row['errors']) or 'not run'} | | | | | | | | | |"
    same = same_prefix(row["generated"], reference["generated"]) if reference else 0
    return (f"| {row['label']} | {row['version']} | {row['decode_tokens_per_s']:.1f} | "
            f"{row['prefill_tokens_per_s']:.0f} | {row['end_to_end_s']:.2f} | {row['peak_rss_bytes'] / 2**20:.0f} | "
            f"{row['weights_read_bytes'] / 1e6:.0f} | {row['kv_bytes'] / 1e6:.1f} | {row['bytes_per_token'] / 1e6:.0f} | "
            f"{row['read_Bps'] / 1e9:.2f} | {row['of_copy']:.0%} | {same}/{len(row['generated'])} |")


def environment() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": commit.stdout.strip() or "?"}


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def prepare(args, scratch: Path) -> tuple[dict, list[str]]:
    """The settings that can run (skipped ones as one-line notes), the prompt ids file, the GGUF and IR paths."""
    from h2o_compress.models import gguf_path
    from h2o_compress.models.loading import file_hash

    missing = available_engines(args.settings, args.peers_python)
    skipped = [f"{engine}: {why} (install: see {REQUIREMENTS})" for engine, why in missing.items() if why]
    for line in skipped:
        print(f"note: skipping {line}", flush=True)
    settings = [name for name in args.settings if not missing.get(SETTINGS[name][0])]
    ids_file = scratch / "ids.json"
    ids_file.write_text(json.dumps(prompt_ids(args.text, max(args.lengths))))
    gguf = gguf_path(ALIAS)
    context = {"settings": settings, "ids_file": str(ids_file), "gguf": gguf_facts(gguf), "irs": {},
               "geometry": model_geometry()}
    formats = {SETTINGS[name][1]["ir"] for name in settings if SETTINGS[name][0] == "openvino"}
    if formats:
        try:
            context["irs"] = export_irs(Path(args.work_dir) / f"{ALIAS}-{file_hash(gguf)[:12]}", args.peers_python, formats)
        except RuntimeError as exc:
            skipped.append(f"openvino: {exc}")
            print(f"note: skipping openvino: {exc}", flush=True)
            context["settings"] = [name for name in settings if SETTINGS[name][0] != "openvino"]
    return context, skipped


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.update(OMP_WAIT_POLICY="passive", OMP_NUM_THREADS=str(args.threads))
    command = "python benchmarks/cpu_peers.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="cpu_peers-") as scratch:
        context, skipped = prepare(args, Path(scratch))
        if not context["settings"]:
            sys.exit("error: no engine to run (every one requested was skipped)")
        load_before, copy_before = load_average(), copy_bandwidth(args.threads)
        runs = run_all(args, context, Path(scratch))
        load_after, copy_after = load_average(), copy_bandwidth(args.threads)
    copy_Bps = statistics.median([copy_before, copy_after])
    data = {"command": command, "environment": environment(), "threads": args.threads, "text": args.text,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "note": args.note, "skipped": skipped,
            "load_before": load_before, "load_after": load_after, "copy_Bps_before": copy_before,
            "copy_Bps_after": copy_after, "copy_Bps": copy_Bps, "gguf": context["gguf"], "irs": context["irs"],
            "geometry": context["geometry"], "notes": NOTES, "rows": summarize(runs, context, copy_Bps), "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    markdown = render(data)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
