"""The profile sweep and its report (JSON, Markdown, PNG, HTML) on a tiny model, and the report maths."""

from __future__ import annotations

import json
import math

import pytest
from helpers.tiny_lm import save_tiny_lm, tiny_lm, one_thread  # noqa: F401 (fixture)

from h2o_compress.utils.errors import ConfigError, InputError
from h2o_compress.profiling import ProfileSettings, run_profile, write_report
from h2o_compress.profiling.sweep import label
from h2o_compress.profiling.report import PLOTS, finalize, policy_comparison

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.usefixtures("one_thread")


def small_settings(**overrides) -> ProfileSettings:
    values = dict(model="tiny", policies=("h2o", "local", "sink"), budgets=(1.0, 0.5), kv_bits=(16, 4),
                  seq_lens=(32, 16), decode_tokens=2, ppl_tokens=40, chunk_size=8, agreement_prompts=1,
                  max_new_tokens=3)
    values.update(overrides)
    return ProfileSettings(**values)


def test_sweep_runs_the_reference_first_and_budget_one_once_per_bits():
    labels = [label(c) for c in small_settings(kv_bits=(16, 8, 4)).configs()]
    assert labels == ["full unquantized", "h2o 0.5 unquantized", "local 0.5 unquantized", "sink 0.5 unquantized",
                      "full 8-bit", "h2o 0.5 8-bit", "local 0.5 8-bit", "sink 0.5 8-bit",
                      "full 4-bit", "h2o 0.5 4-bit", "local 0.5 4-bit", "sink 0.5 4-bit"]
    assert [label(c) for c in small_settings(budgets=(0.2,), kv_bits=(4,), policies=("h2o",)).configs()] == [
        "full unquantized", "h2o 0.2 4-bit"]


@pytest.mark.parametrize("bad", [dict(kv_bits=(3,)), dict(policies=("nope",)), dict(budgets=(1.5,)),
                                 dict(seq_lens=()), dict(chunk_size=0), dict(group_size=48)])
def test_bad_settings(bad):
    with pytest.raises(ConfigError):
        small_settings(**bad)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    model, tokenizer = tiny_lm()
    report = run_profile(small_settings(), out, show_progress=False, model=model, tokenizer=tokenizer)
    return report, out


def test_report_figures(tiny_report):
    report, _ = tiny_report
    results = report["results"]
    assert [r["label"] for r in results] == ["full unquantized", "h2o 0.5 unquantized", "local 0.5 unquantized", "sink 0.5 unquantized",
                                             "full 4-bit", "h2o 0.5 4-bit", "local 0.5 4-bit", "sink 0.5 4-bit"]
    assert report["complete"] is True
    assert results[0]["perplexity"]["ratio"] == 1.0 and results[0]["agreement"]["token_match"] == 1.0
    for r in results:
        assert [s["seq_len"] for s in r["speed"]] == [16, 32]
        assert r["perplexity"]["tokens"] == 40 and r["perplexity"]["chunk_size"] == 8
        assert r["perplexity"]["ratio"] == pytest.approx(r["perplexity"]["perplexity"] / results[0]["perplexity"]["perplexity"])
        assert all(s["prefill_tokens_per_s"] > 0 and s["decode_tokens_per_s"] > 0 for s in r["speed"])
        assert all(s["peak_memory_bytes"] > 0 for s in r["speed"])
        assert 0 <= r["agreement"]["rouge_l"] <= 1
    h2o = results[1]
    assert h2o["perplexity"]["capacity"] == 20 and h2o["speed"][1]["capacity"] == math.ceil(0.5 * (32 + 2))
    assert h2o["perplexity"]["kv_bytes"] < results[0]["perplexity"]["kv_bytes"]
    assert results[5]["perplexity"]["kv_bytes"] < h2o["perplexity"]["kv_bytes"]  # 4-bit below 16-bit
    assert [(c["kv_bits"], c["budget"]) for c in report["policy_comparison"]] == [(16, 0.5), (4, 0.5)]
    assert report["environment"]["packages"]["torch"]


def test_speed_rows_name_the_decode_kernel(tmp_path):
    """Two sweeps that differ only in ``attention_kernel`` are told apart in the JSON and the speed table."""
    model, tokenizer = tiny_lm()
    tables = {}
    for kernel in ("auto", "torch"):
        settings = small_settings(policies=("h2o",), budgets=(0.5,), kv_bits=(4,), seq_lens=(16,),
                                  agreement_prompts=0, attention_kernel=kernel)
        report = run_profile(settings, tmp_path / kernel, show_progress=False, model=model, tokenizer=tokenizer)
        speeds = [s for r in report["results"] for s in r["speed"]]
        expected = "cpu" if kernel == "auto" else "torch"  # the CPU kernel builds here (tests/attention)
        assert [(s["decode_kernel"], s["compiled"]) for s in speeds] == [(expected, False)] * 2
        tables[kernel] = (tmp_path / kernel / "report.md").read_text()
    assert "| cpu eager |" in tables["auto"] and "torch eager" not in tables["auto"]
    assert "| torch eager |" in tables["torch"] and "cpu eager" not in tables["torch"]


def test_report_files(tiny_report):
    report, out = tiny_report
    assert json.loads((out / "report.json").read_text())["results"][1]["label"] == "h2o 0.5 unquantized"
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    md = (out / "report.md").read_text()
    assert all(f"]({name})" in md for name in PLOTS)
    assert "| h2o 0.5 4-bit |" in md and "### H2O vs local vs sink" in md
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "src=\"http" not in page
    assert "<td>sink 0.5 unquantized</td>" in page


def record(policy, budget, bits, ppl):
    return {"label": f"{policy} {budget} {bits}", "config": {"policy": policy, "budget": budget, "kv_bits": bits},
            "perplexity": {"perplexity": ppl, "kv_bytes": 50, "kv_bytes_full_fp16": 100},
            "speed": [{"seq_len": 8, "decode_tokens_per_s": ppl}]}


def test_finalize_ratios_and_policy_comparison():
    report = {"results": [record("full", 1.0, 16, 10.0), record("h2o", 0.2, 16, 11.0), record("local", 0.2, 16, 15.0),
                          record("sink", 0.2, 16, 12.0), record("h2o", 0.1, 4, 14.0), record("local", 0.1, 4, 13.0),
                          record("sink", 0.1, 4, 20.0), record("h2o", 0.5, 8, 10.5)]}
    finalize(report)
    assert report["results"][1]["perplexity"]["ratio"] == pytest.approx(1.1)
    assert report["results"][1]["kv_fraction"] == 0.5
    assert report["results"][2]["speed"][0]["decode_speed_ratio"] == pytest.approx(1.5)
    assert report["policy_comparison"] == [
        {"kv_bits": 16, "budget": 0.2, "perplexity": {"h2o": 11.0, "local": 15.0, "sink": 12.0}, "best": "h2o",
         "h2o_beats_local_and_sink": True},
        {"kv_bits": 8, "budget": 0.5, "perplexity": {"h2o": 10.5}, "best": "h2o", "h2o_beats_local_and_sink": None},
        {"kv_bits": 4, "budget": 0.1, "perplexity": {"h2o": 14.0, "local": 13.0, "sink": 20.0}, "best": "local",
         "h2o_beats_local_and_sink": False},
    ]
    assert policy_comparison(report["results"][:1]) == []
    with pytest.raises(InputError):
        finalize({"results": []})


def test_out_dir_that_is_a_file(tmp_path, tiny_report):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        write_report(tiny_report[0], tmp_path / "file")


def test_isolated_worker_measures_peak_rss(tmp_path):
    model_dir = save_tiny_lm(tmp_path / "model")
    settings = small_settings(model=model_dir, policies=("h2o",), budgets=(1.0,), kv_bits=(16,), seq_lens=(16,),
                              agreement_prompts=0, isolate=True, threads=1)
    report = run_profile(settings, None, show_progress=False)
    (result,) = report["results"]
    assert report["settings"]["isolate"] is True and result["memory_kind"] == "cpu_peak_rss"
    assert 0 < result["memory_after_load_bytes"] <= result["memory_after_warmup_bytes"] <= result["speed"][0]["peak_memory_bytes"]
    assert result["speed"][0]["peak_memory_delta_bytes"] >= 0
    assert "agreement" not in result and result["perplexity"]["ratio"] == 1.0


def test_report_json_feeds_the_memory_planner(tiny_report):
    from h2o_compress.planner import load_quality

    report, out = tiny_report
    quality = load_quality(out / "report.json")  # perplexity ratio per setting, lower is better
    assert len(quality) == len(report["results"])
    assert sorted(quality.values()) == sorted(r["perplexity"]["ratio"] for r in report["results"])
