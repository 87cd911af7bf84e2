"""``profile --ray`` (each configuration a Ray task) and resuming a sweep from its saved rows, on a tiny model.

Ray runs as one local instance with 2 CPUs for the whole module (started once, shut down at the end).
"""

from __future__ import annotations

import json
import sys

import pytest
from helpers.tiny_lm import save_tiny_lm, tiny_lm, one_thread  # noqa: F401 (fixture)
from typer.testing import CliRunner

from h2o_compress.cli import app
from h2o_compress.utils.errors import ConfigError, ModelLoadError
from h2o_compress.profiling import ProfileSettings, run_profile
from h2o_compress.profiling import sweep as profile_module
from h2o_compress.profiling.rows import ROWS_DIR

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("ray")]  # one Ray instance at a time

# Figures that depend on the clock or on the process (its peak RSS), not on what was computed.
VOLATILE = ("seconds", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_speed_ratio", "tokens_per_s",
            "peak_memory_bytes", "peak_memory_delta_bytes", "memory_after_load_bytes", "memory_after_warmup_bytes",
            "prefill_s", "decode_s", "compile_s", "memory_before_bytes", "workspace_bytes")


def stable(value):
    """``value`` without the clock- and process-dependent figures (recursively)."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def two_configs(model: str, **overrides) -> ProfileSettings:
    """A 2-configuration grid (the reference ``full unquantized`` and ``h2o 0.5 unquantized``), a few tokens each."""
    values = dict(model=model, policies=("h2o",), budgets=(0.5,), kv_bits=(16,), seq_lens=(16,), decode_tokens=2,
                  ppl_tokens=24, chunk_size=4, agreement_prompts=1, max_new_tokens=3, threads=1,
                  min_capacity=0)  # 16-token sequences: the floor off in the Ray workers too, so h2o evicts
    values.update(overrides)
    return ProfileSettings(**values)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-ray"))


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    from h2o_compress.integrations.ray_sweep import runtime_env

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2**20,
             configure_logging=False, runtime_env=runtime_env())  # the workers import this checkout's package
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_run(ray_instance, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray-out")
    return run_profile(two_configs(model_dir), out, show_progress=False, ray_address="local"), out


def test_ray_and_local_sweeps_give_the_same_rows(ray_run, model_dir, tmp_path):
    ray_report, out = ray_run
    local = run_profile(two_configs(model_dir, isolate=False), tmp_path, show_progress=False)
    assert [r["label"] for r in ray_report["results"]] == ["full unquantized", "h2o 0.5 unquantized"]
    assert stable(ray_report["results"]) == stable(local["results"])
    assert ray_report["results"][1]["perplexity"]["ratio"] != 1.0  # the two rows are not the same row
    assert ray_report["executor"]["kind"] == "ray" and ray_report["executor"]["per_task"] == "1 CPU"
    assert local["executor"] == {"kind": "local"} and ray_report["rows_reused"] == local["rows_reused"] == 0
    assert ray_report["settings"]["isolate"] is True and ray_report["environment"]["device"] == "cpu"
    # the same report files as a local run
    written = json.loads((out / "report.json").read_text())
    assert written["complete"] is True and stable(written["results"]) == stable(ray_report["results"])
    assert all((out / name).is_file() for name in ("report.md", "report.html", "perplexity_vs_kv_bytes.png"))
    # each task measured in its own worker process, as a local isolated sweep does
    assert all(r["memory_after_load_bytes"] > 0 and r["memory_kind"] == "cpu_peak_rss" for r in ray_report["results"])


def test_ray_rerun_computes_only_the_missing_row(ray_run, model_dir):
    first, out = ray_run
    rows = sorted((out / ROWS_DIR).glob("*.json"))
    assert [p.name.split(".")[0] for p in rows] == ["full_unquantized", "h2o_0"]  # "h2o_0.5_unquantized.<hash>.json"
    rows[1].unlink()  # as if the sweep had been killed before its second row finished
    again = run_profile(two_configs(model_dir), out, show_progress=False, ray_address="local")
    assert again["rows_reused"] == 1
    assert again["results"][0]["seconds"] == first["results"][0]["seconds"]  # reused, not measured again
    assert again["results"][1]["seconds"] != first["results"][1]["seconds"]  # measured again
    assert stable(again["results"]) == stable(first["results"])
    assert rows[1].is_file()


def _counting(real, calls, dies_on: str | None = None):
    """:func:`measure_config` that appends each configuration's label to ``calls`` (and raises KeyboardInterrupt,
    as a killed sweep, for policy ``dies_on``)."""
    def measure(model, tokenizer, settings, config, references=None):
        if config.policy == dies_on:
            raise KeyboardInterrupt
        calls.append(profile_module.label(config))
        return real(model, tokenizer, settings, config, references)

    return measure


def test_an_error_in_a_ray_task_is_the_library_error(ray_instance, tmp_path):
    with pytest.raises(ModelLoadError) as caught:
        run_profile(two_configs(str(tmp_path / "no-such-model")), None, show_progress=False, ray_address="local")
    assert "no-such-model" in str(caught.value) and "Traceback" not in str(caught.value)


@pytest.fixture
def counted(monkeypatch):
    """The labels of the configurations measured, through the real :func:`measure_config`."""
    calls = []
    monkeypatch.setattr(profile_module, "measure_config", _counting(profile_module.measure_config, calls))
    return calls


def test_killed_local_sweep_resumes_without_redoing_finished_rows(tmp_path, monkeypatch):
    model, tokenizer = tiny_lm()
    settings = two_configs("tiny")
    real, calls = profile_module.measure_config, []
    monkeypatch.setattr(profile_module, "measure_config", _counting(real, calls, dies_on="h2o"))
    with pytest.raises(KeyboardInterrupt):  # killed while measuring its second row
        run_profile(settings, tmp_path, show_progress=False, model=model, tokenizer=tokenizer)
    assert calls == ["full unquantized"]
    partial = json.loads((tmp_path / "report.json").read_text())
    assert partial["complete"] is False and [r["label"] for r in partial["results"]] == ["full unquantized"]

    calls.clear()
    monkeypatch.setattr(profile_module, "measure_config", _counting(real, calls))
    report = run_profile(settings, tmp_path, show_progress=False, model=model, tokenizer=tokenizer)
    assert calls == ["h2o 0.5 unquantized"] and report["rows_reused"] == 1
    assert report["complete"] is True and report["results"][0]["agreement"]["token_match"] == 1.0
    assert 0 <= report["results"][1]["agreement"]["token_match"] <= 1  # compared with the reused generations

    calls.clear()  # everything finished: nothing is measured, the report is written again
    again = run_profile(settings, tmp_path, show_progress=False, model=model, tokenizer=tokenizer)
    assert calls == [] and again["rows_reused"] == 2
    assert again["results"] == report["results"]


@pytest.mark.parametrize("change", [dict(ppl_tokens=20), dict(decode_tokens=3), dict(threads=2),
                                    dict(text_file="TEXT")])
def test_a_changed_setting_does_not_reuse_stale_rows(tmp_path, counted, change):
    model, tokenizer = tiny_lm()
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30, encoding="utf-8")
    before = dict(text_file=str(text)) if "text_file" in change else {}
    run_profile(two_configs("tiny", **before), tmp_path / "out", show_progress=False, model=model, tokenizer=tokenizer)
    assert len(counted) == 2
    if "text_file" in change:  # the same file name, another text
        text.write_text("Heavy hitters are the few tokens that receive most of the attention. " * 30)
        change = before
    report = run_profile(two_configs("tiny", **change), tmp_path / "out", show_progress=False, model=model,
                         tokenizer=tokenizer)
    assert len(counted) == 4 and report["rows_reused"] == 0
    assert len(list((tmp_path / "out" / ROWS_DIR).glob("*.json"))) == 4  # the old rows are kept, not replaced


def test_placement_defaults_do_not_split_one_sweep_in_two(tmp_path, model_dir):
    """The CLI passes every placement argument (at its default); the API passes none: one sweep, so the API run
    reuses the CLI run's rows (it measured them all again: docs/guide/evaluation.md's Ray example after its CLI
    example). The weight bits are kept resolved (a model directory: 16 by default)."""
    cli = two_configs(model_dir, placement={"weights_bits": None, "device_map": None, "max_memory": None,
                                            "offload_folder": None})
    assert cli.placement == {"weights_bits": 16}
    first = run_profile(cli, tmp_path, show_progress=False)
    report = run_profile(two_configs(model_dir), tmp_path, show_progress=False)
    assert first["rows_reused"] == 0 and report["rows_reused"] == 2


def test_no_resume_measures_again(tmp_path, counted):
    model, tokenizer = tiny_lm()
    run_profile(two_configs("tiny"), tmp_path, show_progress=False, model=model, tokenizer=tokenizer)
    report = run_profile(two_configs("tiny"), tmp_path, show_progress=False, model=model, tokenizer=tokenizer,
                         resume=False)
    assert len(counted) == 4 and report["rows_reused"] == 0


def test_without_ray_one_clear_error_naming_the_extra(monkeypatch, tmp_path, model_dir):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    with pytest.raises(ConfigError, match=r"h2o-compress\[ray\]"):
        run_profile(two_configs(model_dir), tmp_path / "api", show_progress=False, ray_address="local")
    for args in (["--ray"], ["--ray", "auto"], ["--ray=ray://head:10001"]):
        result = CliRunner().invoke(app, ["profile", "--model", model_dir, *args, "--out", str(tmp_path / "cli")])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: --ray needs Ray") and "h2o-compress[ray]" in result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "cli").exists() and not (tmp_path / "api").exists()  # refused before any side effect


def test_ray_refuses_a_loaded_model_and_an_empty_address(tmp_path):
    pytest.importorskip("ray")
    model, tokenizer = tiny_lm()
    with pytest.raises(ConfigError, match="loaded model"):
        run_profile(two_configs("tiny"), None, show_progress=False, model=model, tokenizer=tokenizer,
                    ray_address="local")
    with pytest.raises(ConfigError, match="empty"):
        run_profile(two_configs("tiny"), None, show_progress=False, ray_address=" ")


def test_cli_rerun_says_how_many_rows_were_reused(model_dir, tmp_path):
    args = ["profile", "--model", model_dir, "--policies", "h2o", "--budgets", "0.5", "--kv-bits", "16",
            "--seq-len", "16", "--decode-tokens", "2", "--ppl-tokens", "24", "--chunk-size", "4",
            "--agreement-prompts", "0", "--no-isolate", "--threads", "1", "--out", str(tmp_path)]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "reused" not in first.stdout
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "2 configurations, 2 reused from" in second.stdout
