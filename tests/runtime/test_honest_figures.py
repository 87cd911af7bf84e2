"""Figures that say what they count: the KV share is taken of the uncompressed cache in the model's own dtype (float32
on a CPU), like with like, so no unquantized or default cache reads above 100%; a hybrid's constant states are shown
apart; ``--json``'s config shows the floor in force; the planner's lines say "process memory" where they count the
process; a batch line names the setting given; profile rows say "unquantized" and their peak restarts per run."""

from __future__ import annotations

import re

import pytest

from h2o_compress import CompressionConfig, generate
from h2o_compress.cli.generate import kv_share_text
from helpers.tiny_lm import english_tokenizer, tiny_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "The story of the red-headed league begins in the town of London, where"


def _share_line(result, dtype: str = "float32") -> str:
    return kv_share_text({**result.to_dict(), "kv_dtype": dtype})


@pytest.mark.parametrize("config", [CompressionConfig(policy="full", kv_bits=16), CompressionConfig(policy="lookahead")],
                         ids=["full-16", "command-default"])
def test_an_unquantized_cache_is_all_of_the_uncompressed_float32_one_not_more(config):
    model, tokenizer = tiny_lm()
    result = generate(model, tokenizer, PROMPT, config, max_new_tokens=6, chat=False)
    seen = result.prompt_tokens + result.new_tokens - 1
    assert result.kv_bytes_full == 2 * 2 * (32 + 32) * seen * 4  # layers x kv heads x widths x tokens x fp32
    assert result.kv_bytes_held == result.kv_bytes_full  # like with like: every token, in the model's dtype
    assert result.kv_bytes > result.kv_bytes_held  # positions and free slots: counted, but apart
    line = _share_line(result)
    assert "= 100.0% of the uncompressed cache (float32, the model's dtype)" in line
    assert "positions, scores and free slots" in line and "fp16" not in line and "16-bit" not in line


def test_a_compressed_cache_is_a_share_below_the_uncompressed_one():
    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="h2o", budget=0.2, kv_bits=4, min_capacity=0)
    result = generate(model, tokenizer, PROMPT, config, max_new_tokens=6, chat=False)
    assert 0 < result.kv_bytes_held < result.kv_bytes < result.kv_bytes_full
    share = float(re.search(r"= ([0-9.]+)% of the uncompressed", _share_line(result)).group(1))
    assert share == pytest.approx(100 * result.kv_bytes_held / result.kv_bytes_full, abs=0.05) and share < 20


def test_a_hybrids_constant_states_are_shown_apart_not_in_the_share():
    from helpers.architectures import tiny_causal_lm

    model = tiny_causal_lm("qwen3_next")
    if isinstance(model, str):
        pytest.skip(f"no tiny qwen3_next here: {model}")
    config = CompressionConfig(policy="h2o", budget=0.3, kv_bits=4, min_capacity=0)
    result = generate(model, english_tokenizer(), PROMPT, config, max_new_tokens=4, chat=False)
    assert result.kv_state_bytes > result.kv_bytes_full > result.kv_bytes_held > 0  # the states dwarf the keys
    line = _share_line(result)
    share = float(re.search(r"= ([0-9.]+)% of the uncompressed", line).group(1))
    assert share < 100 and "linear-attention/SSM states (uncompressed)" in line


def test_json_config_shows_the_floor_in_force(tiny_model_dir, default_floor):
    from h2o_compress.jobs import run_generate

    report = run_generate("w1 w2 w3 w4", tiny_model_dir, CompressionConfig(budget=0.2, kv_bits=4),
                          max_new_tokens=2, chat=False, threads=1)
    assert report.figures["config"]["min_capacity"] == report.figures["min_capacity"] == default_floor


def test_plan_lines_say_process_memory_where_they_count_the_process():
    from h2o_compress.planner import describe_choice, fit_batch

    model, _ = tiny_lm()
    config = CompressionConfig(policy="h2o", budget=16, kv_bits=4)
    own = fit_batch(model, config, "1GiB", 32, 8)
    assert own.own_weight_bytes is None and own.loaded_text.startswith("weights ")
    held = fit_batch(model, config, "1GiB", 32, 8, held=own.weight_bytes + 2**20)
    assert held.own_weight_bytes == own.weight_bytes and held.weight_bytes == own.weight_bytes + 2**20
    line = describe_choice(held, "1GiB")
    assert "process memory 1." in line and f"(weights {own.loaded_text.split()[1]} " in line


def test_the_batch_line_names_the_setting_given(default_floor):
    from h2o_compress.jobs.batch import setting_text
    from h2o_compress.runtime.batch import row_config

    given = CompressionConfig(policy="h2o", budget=0.2, kv_bits=4)
    assert setting_text(given, row_config(given, 150), 150, "float32") == \
        f"h2o 20% int4 g32 r3 (nothing evicted: 150 tokens <= --min-capacity {default_floor})"
    assert setting_text(given, row_config(given, 2000), 2000, "float32") == \
        "h2o 20% int4 g32 r3 (400 tokens kept per layer and KV head)"


def test_profile_labels_say_unquantized_and_the_note_names_the_dtype():
    from h2o_compress.profiling.report import _dtype_note, kv_fraction_of
    from h2o_compress.profiling.sweep import REFERENCE, label

    assert label(REFERENCE) == "full unquantized"
    assert label(CompressionConfig(policy="h2o", budget=0.5, kv_bits=16)) == "h2o 0.5 unquantized"
    assert "(float32)" in _dtype_note([{"model_dtype": "float32"}])
    # a reference row of a report written before the held bytes were recorded: against float32, not fp16
    assert kv_fraction_of({"kv_bytes": 200, "kv_bytes_full_fp16": 100}, "float32") == 1.0


PEAK_RESTART = """
import json, torch
from h2o_compress.profiling.sweep import measured_memory, memory_now, reset_peak_memory
cpu = torch.device("cpu")
earlier = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched: a peak like loading the model's
del earlier
if not reset_peak_memory(cpu) or memory_now(cpu) is None:
    print(json.dumps(None))
else:
    before = memory_now(cpu)
    run = torch.ones(16 * 2**20 // 4)  # 16 MiB: below the earlier peak
    print(json.dumps({"before": before, **measured_memory(cpu, before, kv_bytes=run.numel() * 4)}))
"""


def test_profile_peak_restarts_so_a_run_below_an_earlier_peak_still_shows_what_it_added():
    # a fresh process, as profile's isolated runs are: a long-lived test worker's allocator reuses pages it holds
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PEAK_RESTART], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if figures is None:
        pytest.skip("this platform cannot restart the peak resident set")
    assert 15 * 2**20 <= figures["peak_memory_delta_bytes"] < 60 * 2**20
    assert figures["memory_before_bytes"] == figures["before"] and figures["workspace_bytes"] < 45 * 2**20
