"""``h2o-compress serve`` under load: the server with a compressed cache against the same server uncompressed.

    python benchmarks/serving.py --requests 12 --concurrency 4 --prompt-tokens 100,1000 --answer-tokens 128,256 \
        --memory-limit 1GiB --threads 2 --out benchmarks/results/serving_cpu.json

For each setting (``--policy h2o --budget 0.2 --kv-bits 4``, then ``--policy full --kv-bits 16``) the server is started
as a subprocess on a free loopback port with the same ``--memory-limit`` and ``--batch-size``, and a bounded load
generator (the ``openai`` async client, at most ``--concurrency`` requests in flight) sends the same fixed mix of
``--requests`` streamed completions: prompts of a random length in ``--prompt-tokens`` cut at random places from
the reporting corpus (the Python Language Reference and *Persuasion*, texts that chose no setting), each with a
random ``max_tokens`` in ``--answer-tokens`` (``--seed``), greedy. Reported per setting: output tokens/s (completion
tokens of every request over the wall time of the run), time to first token and per-token latency (after the
first token, over the request's completion tokens) p50/p99, the most sequences the server admitted at once (its
``h2o_running_sequences`` gauge, polled) and its largest KV cache bytes. Writes ``--out`` (JSON) and the same path
with ``.md``, the CPU and the command beside the figures.

``--peer-python PATH`` (a Python with ``llama-cpp-python[server]``, its own virtual environment:
benchmarks/peers/requirements-cpu.txt) adds llama.cpp's OpenAI-compatible server (``python -m llama_cpp.server``)
on the same GGUF, threads and load, its ``n_ctx`` the tokens of f16 KV that ``--memory-limit`` holds less the GGUF's
bytes, at most the model's context: it runs one sequence at a time (no continuous batching; the others wait,
``--interrupt_requests False``), so a larger ``n_ctx`` could admit no more.

``--smoke`` runs the same on a tiny random model saved to a temporary directory (a word-level tokenizer, prompts of
random words), a few short requests: seconds, for the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prompt_read_whole import cpu_name as cpu_features  # the model and vector features, as that benchmark reads them

ROOT = Path(__file__).resolve().parents[1]
#: The two servers compared: their name and their compression flags.
SETTINGS = {"h2o 0.2 int4": ["--policy", "h2o", "--budget", "0.2", "--kv-bits", "4"],
            "uncompressed": ["--policy", "full", "--kv-bits", "16"]}
#: The peer's row name.
PEER = "llama.cpp server"
#: The defaults of the options a smoke run sets otherwise.
DEFAULTS = {"requests": 12, "prompt_tokens": "100,4000", "answer_tokens": "128,512", "memory_limit": "1GiB"}
SMOKE = {"requests": 4, "prompt_tokens": "8,40", "answer_tokens": "4,12", "memory_limit": "2GiB"}
#: Seconds a server has to load its model and answer /health.
START_TIMEOUT_S = 300
#: Seconds between two reads of /metrics while the load runs.
POLL_S = 0.2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="What serve --model takes.")
    parser.add_argument("--requests", type=int, help="Requests sent (default 12; smoke 4).")
    parser.add_argument("--concurrency", type=int, default=4, help="Requests in flight at most.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-tokens", help="MIN,MAX prompt tokens (default 100,4000; smoke 8,40).")
    parser.add_argument("--answer-tokens", help="MIN,MAX max_tokens of a request (default 128,512; smoke 4,12).")
    parser.add_argument("--memory-limit", help="serve --memory-limit of both servers (default 1GiB; smoke 2GiB).")
    parser.add_argument("--batch-size", type=int, default=8, help="serve --batch-size of both servers.")
    parser.add_argument("--threads", type=int, default=2, help="serve --threads.")
    parser.add_argument("--peer-python", help="A Python with llama-cpp-python[server]: adds llama.cpp's server.")
    parser.add_argument("--note", action="append", default=[], help="A line for the results' notes.")
    parser.add_argument("--smoke", action="store_true", help="A tiny random model, a few short requests.")
    parser.add_argument("--out", default="benchmarks/results/serving_cpu.json")
    args = parser.parse_args(argv)
    defaults = SMOKE if args.smoke else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.prompt_range = _range(args.prompt_tokens)
        args.answer_range = _range(args.answer_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1")
    return args


def _range(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or not 0 < int(parts[0]) <= int(parts[1]):
        raise ValueError(f"{text!r} is not MIN,MAX with 0 < MIN <= MAX")
    return int(parts[0]), int(parts[1])


def cpu_name() -> str:
    """The CPU model, its widest vector features and its core count."""
    return f"{cpu_features()}, {os.cpu_count()} cores"


def save_tiny_model(path: Path) -> str:
    """A tiny random LLaMA and a word-level tokenizer (``w0`` ... ``w125``) saved to ``path`` (as the tests'
    ``save_tiny_model_dir``); returns ``str(path)``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(126)} | {"<unk>": 126, "</s>": 127}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def workload(args) -> list[dict]:
    """The fixed mix: ``{"prompt", "max_tokens"}`` per request, drawn with ``--seed``."""
    rng = random.Random(args.seed)
    lengths = [rng.randint(*args.prompt_range) for _ in range(args.requests)]
    answers = [rng.randint(*args.answer_range) for _ in range(args.requests)]
    if args.smoke:
        prompts = [" ".join(f"w{rng.randrange(126)}" for _ in range(n)) for n in lengths]
    else:
        from transformers import AutoTokenizer

        from h2o_compress.evaluation.corpus import reporting_text
        from h2o_compress.models import converted_dir

        tokenizer = AutoTokenizer.from_pretrained(converted_dir(args.model))
        ids = tokenizer(reporting_text("python_reference") + "\n\n" + reporting_text("persuasion")).input_ids
        starts = [rng.randrange(len(ids) - n) for n in lengths]
        prompts = [tokenizer.decode(ids[s : s + n]) for s, n in zip(starts, lengths)]
    return [{"prompt": p, "max_tokens": m} for p, m in zip(prompts, answers)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(args, model: str, flags: list[str], port: int) -> list[str]:
    """``h2o-compress serve`` with ``flags`` and the run's shared options."""
    return [sys.executable, "-m", "h2o_compress", "serve", "--model", model, "--port", str(port),
            "--served-name", "bench", "--memory-limit", args.memory_limit, "--batch-size", str(args.batch_size),
            "--threads", str(args.threads), "--max-queue", str(args.requests), "--log-level", "warning", *flags]


def peer_context(args) -> tuple[Path, int, int]:
    """The GGUF of ``--model``, the ``n_ctx`` of llama.cpp's server (the f16 KV tokens ``--memory-limit`` holds
    less the GGUF's bytes, at most the model's context) and the bytes of its KV cache (allocated at start)."""
    from transformers import AutoConfig

    from h2o_compress.models import converted_dir, gguf_path
    from h2o_compress.planner import parse_memory

    gguf = gguf_path(args.model)
    config = AutoConfig.from_pretrained(converted_dir(args.model))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # K and V, f16
    tokens = (parse_memory(args.memory_limit) - gguf.stat().st_size) // per_token
    n_ctx = int(min(tokens, config.max_position_embeddings))
    return gguf, n_ctx, n_ctx * per_token


def peer_command(args, port: int, gguf: Path, n_ctx: int) -> list[str]:
    """llama-cpp-python's OpenAI-compatible server on ``gguf`` with ``n_ctx`` tokens (`peer_context`), the run's
    threads."""
    return [args.peer_python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "bench",
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(args.threads),
            "--n_threads_batch", str(args.threads), "--interrupt_requests", "False", "--verbose", "False"]


def start_server(command: list[str], port: int, log: Path, ready: str = "/health") -> subprocess.Popen:
    """``command`` as a subprocess (``OMP_WAIT_POLICY=passive``), once ``ready`` answers 200.

    Raises:
        SystemExit: the server exited or did not answer within `START_TIMEOUT_S` (the tail of its log).
    """
    import httpx

    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    process = subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready}", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise SystemExit(f"the server did not start: {log.read_text()[-2000:]}")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM (graceful), then SIGKILL after 30 s."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def scrape(text: str) -> dict[str, float]:
    """The samples of a /metrics text by name (labels dropped: the last sample of a name wins)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def one_request(client, item: dict, usage_chunk: bool = True) -> dict:
    """Stream one completion; its arrival-relative times (seconds) and its token counts (``usage_chunk=False``, a
    server that sends no usage: completion tokens counted as the streamed chunks, one token each)."""
    sent = time.perf_counter()
    first = last = None
    usage, error, chunks = None, None, 0
    extra = {"stream_options": {"include_usage": True}} if usage_chunk else {}
    try:
        stream = await client.completions.create(model="bench", prompt=item["prompt"], max_tokens=item["max_tokens"],
                                                 temperature=0, stream=True, **extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
                chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
        error = f"{type(exc).__name__}: {exc}"
    done = time.perf_counter()
    tokens = usage.completion_tokens if usage else (0 if usage_chunk else chunks)
    return {"prompt_tokens": usage.prompt_tokens if usage else 0, "completion_tokens": tokens, "error": error,
            "ttft_s": None if first is None else first - sent, "latency_s": done - sent,
            "per_token_s": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None}


async def drive(url: str, items: list[dict], concurrency: int, ours: bool = True) -> tuple[list[dict], float, dict]:
    """Send every item, at most ``concurrency`` at once; the records, the wall seconds and the peaks of the server's
    gauges (``h2o_running_sequences``, ``h2o_kv_cache_bytes``) polled meanwhile (``ours=False``: a peer, which has
    neither those gauges nor a usage chunk)."""
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)
    peaks = {"h2o_running_sequences": 0.0, "h2o_kv_cache_bytes": 0.0}

    async def bounded(item):
        async with gate:
            return await one_request(client, item, usage_chunk=ours)

    async def poll(http):
        while ours:
            values = scrape((await http.get(url + "/metrics")).text)
            for name in peaks:
                peaks[name] = max(peaks[name], values.get(name, 0.0))
            await asyncio.sleep(POLL_S)

    async with httpx.AsyncClient(timeout=30) as http:
        poller = asyncio.create_task(poll(http))
        start = time.perf_counter()
        records = await asyncio.gather(*(bounded(item) for item in items))
        wall = time.perf_counter() - start
        poller.cancel()
        final = scrape((await http.get(url + "/metrics")).text) if ours else {}
    await client.close()
    return records, wall, {**peaks, "final": final}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; ``None`` if empty."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarize(name: str, flags: list[str], records: list[dict], wall: float, gauges: dict) -> dict:
    """One setting's row of the results."""
    ok = [r for r in records if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    per_token = [r["per_token_s"] for r in ok if r["per_token_s"] is not None]
    output = sum(r["completion_tokens"] for r in ok)
    final = gauges["final"]
    return {"setting": name, "flags": " ".join(flags), "requests": len(records), "errors": len(records) - len(ok),
            "error_examples": sorted({r["error"] for r in records if r["error"]})[:3],
            "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "output_tokens": output, "wall_s": wall,
            "output_tokens_per_s": output / wall if wall else 0.0,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "per_token_p50_s": percentile(per_token, 0.5), "per_token_p99_s": percentile(per_token, 0.99),
            "max_running_sequences": int(max(gauges["h2o_running_sequences"],
                                             final.get("h2o_peak_running_sequences", 0.0))),
            "max_kv_cache_bytes": int(gauges["h2o_kv_cache_bytes"]),
            "evicted_tokens": final.get("h2o_evicted_tokens_total", 0.0),
            "prefill_tokens": final.get("h2o_prefill_tokens_total", 0.0)}


def run_setting(args, model: str, name: str, flags: list[str], items: list[dict], scratch: Path) -> dict:
    """Start the server for one setting (`PEER`: llama.cpp's), drive the load through it, stop it; its row."""
    port, ours = free_port(), name != PEER
    if ours:
        command = serve_command(args, model, flags, port)
    else:
        gguf, n_ctx, kv_bytes = peer_context(args)
        command = peer_command(args, port, gguf, n_ctx)
    process = start_server(command, port, scratch / f"{name.replace(' ', '_')}.log", "/health" if ours else "/v1/models")
    try:
        records, wall, gauges = asyncio.run(drive(f"http://127.0.0.1:{port}", items, args.concurrency, ours))
    finally:
        stop_server(process)
    row = summarize(name, flags, records, wall, gauges)
    if not ours:  # one sequence at a time; its KV is n_ctx tokens of f16, allocated at start
        row["flags"] = f"--n_ctx {n_ctx}"
        row["max_running_sequences"], row["max_kv_cache_bytes"] = 1, kv_bytes
    return row


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


COLUMNS = ("setting", "server flags", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "per-token p50 ms",
           "per-token p99 ms", "max sequences admitted", "max KV MiB", "errors")


def table_rows(data: dict) -> list[list[str]]:
    return [[r["setting"], r["flags"], f"{r['output_tokens_per_s']:.2f}", _ms(r["ttft_p50_s"]), _ms(r["ttft_p99_s"]),
             _ms(r["per_token_p50_s"]), _ms(r["per_token_p99_s"]), str(r["max_running_sequences"]),
             f"{r['max_kv_cache_bytes'] / 2**20:.1f}", str(r["errors"])] for r in data["rows"]]


def render(data: dict) -> str:
    """The markdown of the results."""
    w = data["workload"]
    lines = ["# Serving under load: compressed against uncompressed", "", f"Command: `{data['command']}`", "",
             f"CPU: {data['cpu']}. Model: {data['model']}. `--memory-limit {data['memory_limit']}`, `--batch-size "
             f"{data['batch_size']}`, `--threads {data['threads']}`.", "",
             f"Workload: {w['requests']} streamed completions, at most {w['concurrency']} in flight, prompts of "
             f"{w['prompt_tokens']} tokens, max_tokens {w['answer_tokens']}, seed {w['seed']}, greedy.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(data)]
    lines += ["", *[f"- {note}" for note in data["notes"]], ""]
    return "\n".join(lines)


def print_table(data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"serve under load ({data['model']}, --memory-limit {data['memory_limit']})")
    for column in COLUMNS:
        table.add_column(column)
    for row in table_rows(data):
        table.add_row(*row)
    Console(width=200).print(table)


NOTES = [
    "Output tok/s: completion tokens of every request over the wall time of the whole run (both servers answer "
    "the same requests, greedy; a request may end early at its end-of-sequence token).",
    "TTFT: from sending a request to its first streamed text (includes its time queued for a row). Per-token: "
    "(last text - first text) / (completion tokens - 1), per request. A request longer (prompt + max_tokens) than "
    "the running batch's longest waits until that batch has drained (docs/guide/serving.md): that wait is in its "
    "TTFT, and it drives the p99 at this small scale.",
    "Max sequences admitted: the server's h2o_peak_running_sequences (/metrics) at the end of the run: the most "
    "sequences it ran at once, at most the rows the planner fits --memory-limit for the batch's longest request "
    "(and --batch-size). Max KV MiB: the largest h2o_kv_cache_bytes seen, polled every "
    f"{POLL_S} s (a lower bound).",
]


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="h2o-serving-bench-") as scratch:
        scratch = Path(scratch)
        model = save_tiny_model(scratch / "tiny") if args.smoke else args.model
        items = workload(args)
        settings = dict(SETTINGS) | ({PEER: []} if args.peer_python and not args.smoke else {})
        rows = [run_setting(args, model, name, flags, items, scratch) for name, flags in settings.items()]
    data = {"command": "python " + shlex.join(["benchmarks/serving.py", *(sys.argv[1:] if argv is None else argv)]),
            "cpu": cpu_name(), "model": "tiny random LLaMA (smoke)" if args.smoke else args.model,
            "memory_limit": args.memory_limit, "batch_size": args.batch_size, "threads": args.threads,
            "workload": {"requests": args.requests, "concurrency": args.concurrency, "seed": args.seed,
                         "prompt_tokens": args.prompt_tokens, "answer_tokens": args.answer_tokens},
            "notes": NOTES + args.note, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(data))
    print_table(data)


if __name__ == "__main__":
    main()
