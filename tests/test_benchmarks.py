"""The GPU benchmarks run end to end on the CPU: gpu_throughput's smoke mode (tiny model, tiny contexts) and
kernel_bandwidth's sm_90 resources (compiled with Triton's ptxas, no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_throughput_smoke_writes_every_part(tmp_path):
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("gpu.*")}
    command = [sys.executable, "benchmarks/gpu_throughput.py", "--smoke", "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert {"command", "environment", "model", "notes", "copy_GBps", "speed", "max_batch", "quality",
            "criterion", "unavailable"} <= set(data)
    assert {"device", "torch", "transformers", "commit"} <= set(data["environment"])
    assert data["model"]["random_weights"] and any("RANDOM" in note for note in data["notes"])
    assert data["copy_GBps"] > 0
    ok = [row for row in data["speed"] if row["status"] == "ok"]
    assert {row["setting"] for row in ok} >= {"sdpa-dynamic", "sdpa-static", "h2o0.2-4", "h2o0.5-16",
                                              "sdpa-static+compile", "h2o0.2-4+compile"}
    assert all(row["decode_tokens_per_s"] > 0 and row["kv_bytes"] > 0 and row["floor_ms"] > 0 for row in ok)
    assert all(row["kv_GBps"] > 0 for row in ok if not row["compiled"])  # per-layer hooks time eager steps only
    assert (tmp_path / "gpu.png").stat().st_size > 0
    assert any(row["status"] == "does not fit" for row in data["speed"])  # the smoke memory cap bites
    compressed = next(r for r in ok if r["setting"] == "h2o0.2-4" and r["context"] == 192 and r["batch"] == 1)
    full = next(r for r in ok if r["setting"] == "sdpa-dynamic" and r["context"] == 192 and r["batch"] == 1)
    assert compressed["kv_bytes"] < full["kv_bytes"] / 4
    assert all(row["confirmed"] >= 1 for row in data["max_batch"])
    crit = data["criterion"]
    assert crit["layers"] == 1 and "speedup" in crit and crit["kv_ratio"] > 10  # measured on a 1-layer slice
    if "rows" in data["quality"]:  # the real SmolLM2 (its model wheel) is installed
        rows = {row["setting"]: row for row in data["quality"]["rows"]}
        assert abs(rows["sdpa-dynamic"]["perplexity_ratio"] - 1) < 1e-4 and rows["h2o0.2-4"]["perplexity_ratio"] > 0
    else:
        assert data["quality"]["error"]
    markdown = (tmp_path / "gpu.md").read_text()
    assert "Done criterion" in markdown and "RANDOM" in markdown and "## Decode at 192 tokens" in markdown
    assert before == {p.name: p.stat().st_mtime_ns for p in results.glob("gpu.*")}  # GPU results untouched
    # the CUDA-graph pool: planned for compiled runs only, measured on CUDA only; a measured row gets its table line
    assert all((row["planned_graph_pool_bytes"] > 0) == row["compiled"] for row in ok)
    assert all(row["graph_pool_bytes"] is None for row in ok) and "CUDA-graph pool" not in markdown
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_throughput

    compiled = next(r for r in ok if r["setting"] == "h2o0.2-4+compile")
    compiled["graph_pool_bytes"] = compiled["planned_graph_pool_bytes"] // 2
    table = gpu_throughput.render(data).split("## CUDA-graph pool")[1]
    assert f"| {compiled['name']} | {compiled['context']} | {compiled['batch']} |" in table and "| 0.50 |" in table


def test_kernel_bandwidth_reports_sm90_resources_without_a_gpu(tmp_path):
    """``benchmarks/kernel_bandwidth.py`` on a machine without a GPU: every option compiled for sm_90, its resources
    and the bytes-in-flight proxy in the JSON, a markdown table naming the default and the best option, a plot; a
    register cap lowers the registers it reports; ``--device cuda`` is refused here with a clear message."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kb.json"
    command = [sys.executable, "benchmarks/kernel_bandwidth.py", "--shapes", "smollm2", "--formats", "4,16",
               "--blocks", "64", "--warps", "4", "--stages", "3", "--max-registers", "0,96", "--out", str(out)]
    # (int4's own launch is 5 stages, so none of these rows is its default; 16-bit's is block 64, 4 warps, 3 stages)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 4 and data["defaults"]["16"] == dict(block=64, num_warps=4, num_stages=3,
                                                                       max_registers=0)
    rows = {(r["bits"], r["max_registers"]): r for r in data["rows"]}
    for row in rows.values():
        assert row["registers"] > 0 and row["shared_bytes"] > 0 and row["programs_per_sm"] >= 1
        per_token = 2 * (64 * row["bits"] / 8 + (4 * 64 / 32 if row["bits"] < 16 else 0))
        assert row["bytes_per_iteration"] == 64 * per_token
        assert row["bytes_in_flight_per_sm"] == row["programs_per_sm"] * row["bytes_per_iteration"] * 2
    assert rows[(4, 96)]["registers"] <= 96 < rows[(4, 0)]["registers"]
    assert rows[(16, 0)]["default"] and not rows[(16, 96)]["default"] and not rows[(4, 0)]["default"]
    text = out.with_suffix(".md").read_text()
    assert "## smollm2" in text and "**(default)**" in text and "- 4-bit: best" in text
    assert out.with_suffix(".png").stat().st_size > 0
    refused = subprocess.run([sys.executable, "benchmarks/kernel_bandwidth.py", "--device", "cuda", "--out",
                              str(tmp_path / "x.json")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env=env)
    if not torch.cuda.is_available():
        assert refused.returncode != 0 and "no CUDA GPU here" in refused.stderr + refused.stdout


@pytest.mark.parametrize("argv, env_interpret, message", [
    (["--shapes", "llama-7b,gpt-9"], False, "unknown shape(s) ['gpt-9']; allowed: llama-7b, smollm2"),
    (["--formats", "4,3"], False, "--formats [3] not allowed; allowed: 4, 8, 16"),
    ([], True, "TRITON_INTERPRET=1 is set: the kernels must compile for the GPU here; unset it"),
])
def test_kernel_bandwidth_refuses_bad_options(tmp_path, argv, env_interpret, message):
    """Bad options stop ``kernel_bandwidth.py`` before any compile, naming the value and what is allowed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | ({"TRITON_INTERPRET": "1"}
                                                                            if env_interpret else {})
    done = subprocess.run([sys.executable, "benchmarks/kernel_bandwidth.py", *argv, "--out", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_throughput_smoke_compares_settings_at_one_memory_limit(tmp_path):
    """benchmarks/throughput.py end to end at tiny sizes on SmolLM2: the uncompressed cache at the batch the limit
    was set for, ours at a larger one, the mixed-length run both ways, and the three outputs."""
    out = tmp_path / "throughput.json"
    command = [sys.executable, "benchmarks/throughput.py", "--prompt-tokens", "64", "--new-tokens", "4", "--curve", "1",
               "--full-batch", "2", "--mixed", "4", "--mixed-batch", "2", "--threads", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["batches"]["uncompressed"] == 2 and data["batches"]["h2o 0.2 int4"] > 2
    largest = {r["setting"]: r for r in data["runs"] if r["largest"]}
    assert set(largest) == {"uncompressed", "h2o 0.2 int4", "ask defaults"}
    assert all(r["errors"] == 0 and r["new_tokens"] > 0 and r["decode_tokens_per_s"] > 0 for r in data["runs"])
    assert largest["h2o 0.2 int4"]["planned_bytes"] <= data["memory_limit_bytes"]
    assert [r["refill"] for r in data["mixed"]] == [True, False]
    assert out.with_suffix(".md").read_text().startswith("# Batch throughput")
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["benchmarks/eviction_directions.py", "--phase", "report", "--texts", "sherlock"],
     "reads only the reporting corpus"),
    (["benchmarks/streaming_quality.py", "--texts", "nope", "--settings", "budget=0.2"], "allowed: sherlock"),
    (["benchmarks/streaming_quality.py", "--settings", "budget=7.5,kv_bits=4"], "budget"),
])
def test_quality_benchmarks_refuse_bad_texts_and_settings_before_loading_a_model(argv, message):
    """The benchmark that chooses settings reads the tuning text only, the one that reports reads the reporting
    corpus (the tuning text only as a labelled column); a bad text or setting stops them before any model loads."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.integration
def test_throughput_runs_the_gpu_runbook_path_at_a_toy_size(tmp_path):
    """``throughput.py --model llama-tiny-random`` (the code path of the GPU runbook's LLaMA-7B run, random weights
    and SmolLM2's tokenizer) under a given ``--memory-limit``: both settings answer, ours at a larger planned batch
    inside the limit, and the tables name the model and the limit."""
    out = tmp_path / "throughput.json"
    command = [sys.executable, "benchmarks/throughput.py", "--model", "llama-tiny-random", "--prompt-tokens", "200",
               "--new-tokens", "4", "--threads", "1", "--curve", "", "--mixed", "0", "--settings", "h2o 0.2 int4",
               "--memory-limit", "56MiB", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["model"] == "llama-tiny-random" and data["memory_limit_bytes"] == 56 * 2**20
    runs = {r["setting"]: r for r in data["runs"]}
    assert set(runs) == {"uncompressed", "h2o 0.2 int4"} and not any(r["errors"] for r in runs.values())
    assert runs["h2o 0.2 int4"]["batch_size"] > runs["uncompressed"]["batch_size"] > 1
    assert all(r["planned_bytes"] <= data["memory_limit_bytes"] for r in runs.values())
    table = out.with_suffix(".md").read_text()
    assert "llama-tiny-random" in table and "(--memory-limit)" in table


@pytest.mark.integration
def test_cpu_peers_runs_ours_at_a_toy_size_and_skips_missing_peers(tmp_path):
    """``benchmarks/cpu_peers.py`` with no peers installed (as in CI): two of our settings run in their own worker
    processes at a toy size and fill every figure; a requested peer the environment lacks is skipped with a one-line
    note, not a traceback; the JSON and the markdown carry the command."""
    out = tmp_path / "cpu_peers.json"
    command = [sys.executable, "benchmarks/cpu_peers.py", "--engines", "ours-fp32,ours-int4,llama.cpp", "--prompt-tokens", "40",
               "--new-tokens", "3", "--repeats", "1", "--peers-python", str(tmp_path / "no-python"), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "note: skipping llama.cpp" in done.stdout and "Traceback" not in done.stdout + done.stderr
    data = json.loads(out.read_text())
    rows = {row["setting"]: row for row in data["rows"]}
    assert set(rows) == {"ours-int4", "ours-fp32"}
    for row in rows.values():
        assert row["repeats"] == 1 and not row["errors"] and len(row["generated"]) == 3
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["peak_rss_bytes"] > 0
        assert row["bytes_per_token"] == row["weights_read_bytes"] + row["kv_bytes"] and row["kv_bytes"] > 0
        assert 0 < row["weight_products_s"] < 2 / row["decode_tokens_per_s"]  # part of a step (2x: toy-size noise)
    assert rows["ours-fp32"]["weights_read_bytes"] > 2 * rows["ours-int4"]["weights_read_bytes"]
    assert data["copy_Bps"] > 0 and data["command"].startswith("python benchmarks/cpu_peers.py --engines")
    markdown = out.with_suffix(".md").read_text()
    assert "## 40-token prompt" in markdown and "skipped: llama.cpp" in markdown and data["command"] in markdown


def test_cpu_peers_refuses_unknown_engines_before_loading_anything():
    """A setting ``cpu_peers.py`` does not know stops it at once, naming what is allowed."""
    done = subprocess.run([sys.executable, "benchmarks/cpu_peers.py", "--engines", "ours,vllm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--engines: unknown ['vllm']; allowed:" in done.stderr
    assert "Traceback" not in done.stderr


#: gpu_check.py's sections in priority order: (section letter of its docstring, step name).
GPU_CHECK_ORDER = [("-", "environment"), ("a", "cuda-tests"), ("a", "triton-vs-torch"), ("b", "compiled-vs-eager"),
                   ("c", "decode-speed"), ("d", "peak-vs-planner"), ("e", "max-batch")]


def test_gpu_check_dry_run_gives_every_section_its_figures(tmp_path):
    """``gpu_check.py --dry-run`` (CPU, tiny sizes): every section runs in priority order and
    passes, and ``gpu_check.json`` holds each one's figures: pytest's counts, the Triton op and the compiled step
    within tolerance of the torch form with the same tokens kept, tokens/s of the three settings at both contexts,
    measured peak against the planner, and a larger batch for ours at the memory limit."""
    command = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and [(s["section"], s["name"]) for s in report["steps"]] == GPU_CHECK_ORDER
    assert all(s["status"] == "passed" and s["figures"] for s in report["steps"]), [
        (s["name"], s["status"], s["output_tail"][-500:]) for s in report["steps"] if s["status"] != "passed"]
    figures = {s["name"]: s["figures"] for s in report["steps"]}
    cuda = figures["environment"][0]["cuda"]
    counts = figures["cuda-tests"][0]
    assert not counts.get("failed") and not counts.get("error") and counts.get("passed" if cuda else "skipped", 0) > 0
    triton = figures["triton-vs-torch"]
    if triton[0].get("skipped"):  # a figure-less row: accepted only on a CPU without Triton
        assert not cuda and "Triton is not installed" in triton[0]["skipped"]
    else:
        assert {row["bits"] for row in triton} >= {4, 16} and all(
            row["ok"] and row["same_tokens_kept"] and row["max_abs_logits_diff"] <= row["tolerance"]
            and row["kernel"] == "triton" for row in triton)
    (compiled,) = figures["compiled-vs-eager"]
    assert compiled["steps"] == 64 and compiled["ok"] and compiled["same_tokens_kept"] and compiled["backend"]
    assert compiled["max_abs_logits_diff"] <= 1e-4
    speed = {(r["setting"], r["context"]): r for r in figures["decode-speed"] if r["status"] == "ok"}
    assert set(speed) == {(s, c) for s in ("sdpa-static+compile", "h2o0.2-4", "h2o0.2-4+compile") for c in (96, 192)}
    assert all(r["decode_tokens_per_s"] > 0 and r["batch"] == 4 for r in speed.values())
    assert speed["h2o0.2-4", 192]["kv_bytes"] < speed["sdpa-static+compile", 192]["kv_bytes"] / 4
    memory = {r["setting"]: r for r in figures["peak-vs-planner"]}
    assert set(memory) == {"sdpa-static", "h2o0.2-4"}
    assert all(r["peak_bytes"] > r["weight_bytes"] and 0.5 < r["measured_over_planned"] < 1.5 for r in memory.values())
    assert memory["h2o0.2-4"]["planned_cache_bytes"] < memory["sdpa-static"]["planned_cache_bytes"] / 4
    batches = {r["setting"]: r["confirmed"] for r in figures["max-batch"]}
    assert batches["h2o0.2-4"] > batches["sdpa-dynamic"] >= 1
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}: figures" in markdown for _, name in GPU_CHECK_ORDER)
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_gpu_check_skips_a_step_past_its_budget(tmp_path):
    """A step that would start past the check's budget is recorded as skipped, not run (``--smoke``: the old name
    of ``--dry-run``)."""
    command = [sys.executable, "benchmarks/gpu_check.py", "--smoke", "--budget-minutes", "0", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(step["status"].startswith("skipped") for step in report["steps"])
    assert "| environment |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_serving_smoke_compares_the_two_servers_under_load(tmp_path):
    """``benchmarks/serving.py --smoke``: two ``h2o-compress serve`` subprocesses (compressed, uncompressed) on a
    tiny model answer the same streamed mix through the openai client; every figure is filled, the results name the
    CPU and the command."""
    out = tmp_path / "serving.json"
    command = [sys.executable, "benchmarks/serving.py", "--smoke", "--seed", "3", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {row["setting"]: row for row in data["rows"]}
    assert set(rows) == {"h2o 0.2 int4", "uncompressed"}
    for row in rows.values():
        assert row["requests"] == 4 and row["errors"] == 0 and row["output_tokens"] > 0
        assert row["output_tokens_per_s"] > 0 and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 < row["per_token_p50_s"] <= row["per_token_p99_s"] and row["max_running_sequences"] >= 1
    assert rows["uncompressed"]["evicted_tokens"] == 0  # (the tiny prompts stay under ours' capacity floor)
    assert rows["h2o 0.2 int4"]["prompt_tokens"] == rows["uncompressed"]["prompt_tokens"]  # the same mix
    markdown = out.with_suffix(".md").read_text()
    assert data["command"] in markdown and data["cpu"] in markdown and "cores" in data["cpu"]


#: The benchmarks that time decoding, and the package's own steps each must run (the decode loop, the prefill).
DECODING_BENCHMARKS = {
    "decode_speed.py": {"fixed_steps", "feed_prompt", "compiled_decode_step", "decode_step"},
    "long_stream.py": {"fixed_steps", "prompt_chunks", "decode_step"},
    "gpu_throughput.py": {"run_steps", "prompt_chunks", "prefill_replicated", "compiled_decode_step", "decode_step"},
    "cpu_weight_paths.py": {"feed_prompt", "decode_one", "decode_step"},
}


def _model_calls_in_loops(tree) -> list[int]:
    """Lines of a call passing ``past_key_values=`` inside a ``for``/``while`` loop or a comprehension: a forward
    pass per iteration, i.e. a hand-written decode loop or chunked prefill."""
    import ast

    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.GeneratorExp, ast.ListComp))]
    return sorted({call.lineno for loop in loops for call in ast.walk(loop) if isinstance(call, ast.Call)
                   and any(k.arg == "past_key_values" for k in call.keywords)})


@pytest.mark.parametrize("script", sorted(DECODING_BENCHMARKS))
def test_decoding_benchmarks_run_the_package_steps_not_their_own_loops(script):
    import ast

    tree = ast.parse((ROOT / "benchmarks" / script).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("h2o_compress.runtime") for alias in node.names}
    missing = DECODING_BENCHMARKS[script] - imported
    assert not missing, f"{script} no longer imports {missing}"
    assert _model_calls_in_loops(tree) == [], f"{script} runs its own forward passes in a loop"
    defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"decode_step", "forward_step", "Stepper", "decode_one", "prefill"}  # no private copies


def test_the_loop_scan_finds_a_hand_written_decode_loop():
    import ast

    loop = ("for _ in range(8):\n    logits = model(input_ids=token, past_key_values=cache).logits\n"
            "    token = logits.argmax(-1)\n")
    chunks = "outs = [model(input_ids=c, past_key_values=cache) for c in ids.split(64, 1)]\n"
    assert _model_calls_in_loops(ast.parse(loop)) == [2] and _model_calls_in_loops(ast.parse(chunks)) == [1]
    assert _model_calls_in_loops(ast.parse("model(input_ids=ids, past_key_values=cache)\n")) == []


def test_benchmarks_import_only_names_the_package_has():
    """Every ``from h2o_compress... import name`` of a benchmark script names something that exists (a script that
    imports a removed name fails only when someone runs it, long after the change)."""
    import ast
    import importlib

    missing = []
    for script in sorted(Path(__file__).resolve().parents[1].joinpath("benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("h2o_compress"):
                try:
                    module = importlib.import_module(node.module)
                except ImportError as error:
                    if (error.name or "").startswith("h2o_compress"):
                        missing.append(f"{script.name}: {node.module}")
                    continue
                missing += [f"{script.name}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name)
                            and importlib.util.find_spec(f"{node.module}.{alias.name}") is None]
    assert not missing, "benchmark scripts import names the package no longer has:\n" + "\n".join(missing)
