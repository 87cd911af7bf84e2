"""Thin commands: each CLI command parses its options, calls one library function that Python users can call too
(:mod:`h2o_compress.jobs`, :func:`h2o_compress.profiling.run_profile`), and prints; no command function is over 60
lines. The library functions are checked here from Python on the tiny model."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import h2o_compress
from h2o_compress import AskJob, CompressionConfig, ConfigError, GenerateJob, InputError, run_ask, run_generate
from h2o_compress.cli import app, click_app
from h2o_compress.profiling import ProfileSettings, run_profile
from h2o_compress.utils.defaults import default_of

CLI = Path(h2o_compress.__file__).parent / "cli"
MAX_LINES = 60
WORDS = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"


def _registered(command) -> list:
    """The functions behind the commands of the click ``command`` and its groups (every command imported:
    `h2o_compress.cli.click_app`), unwrapped from their decorators."""
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        return [inspect.unwrap(command.callback)]
    return [fn for sub in subcommands.values() for fn in _registered(sub)]


def _command_lengths() -> dict[str, int]:
    """``{module:function: lines}`` of every registered command, from its first decorator to its last line."""
    lengths = {}
    for fn in _registered(click_app):
        path = Path(inspect.getsourcefile(fn))
        assert path.parent == CLI, f"command {fn.__name__} is defined outside h2o_compress/cli: {path}"
        tree = ast.parse(path.read_text())
        (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn.__name__]
        first = min([d.lineno for d in node.decorator_list] + [node.lineno])
        lengths[f"{path.name}:{fn.__name__}"] = node.end_lineno - first + 1
    return lengths


def test_no_command_function_is_over_60_lines():
    lengths = _command_lengths()
    assert {"generate.py:generate", "ask.py:ask", "profile.py:profile_command", "plan.py:plan"} <= set(lengths)
    assert len(lengths) >= 8, lengths  # generate, ask, plan, profile and the eval commands
    long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not long, f"command functions over {MAX_LINES} lines (move the logic into the library): {long}"


def test_option_defaults_are_read_from_the_library():
    from h2o_compress import ask, generate

    assert default_of(GenerateJob, "max_new_tokens") == default_of(generate, "max_new_tokens")
    assert default_of(AskJob, "max_new_tokens") == default_of(ask, "max_new_tokens")
    with pytest.raises(KeyError):
        default_of(GenerateJob, "prompt")
    params = {p.name: p.default for p in _profile_params()}
    for option, field in (("policies", "policies"), ("budgets", "budgets"), ("kv_bits", "kv_bits"),
                          ("seq_len", "seq_lens"), ("needle_depths", "needle_depths"),
                          ("needle_lengths", "needle_lengths"), ("lm_eval_tasks", "lm_eval_tasks"),
                          ("quality_texts", "quality_texts")):
        parsed = [float(v) for v in params[option].split(",") if v] if option in ("budgets", "needle_depths") else \
            [v if option in ("policies", "lm_eval_tasks", "quality_texts") else int(v)
             for v in params[option].split(",") if v]
        assert tuple(parsed) == tuple(default_of(ProfileSettings, field)), option
    for name in ("decode_tokens", "ppl_tokens", "chunk_size", "agreement_prompts", "max_new_tokens", "isolate",
                 "lm_eval_limit", "text_file"):
        assert params[name] == default_of(ProfileSettings, name), name


def _profile_params():
    import typer

    command = typer.main.get_command(app).commands["profile"]
    return [p for p in command.params if p.name not in ("help",)]


# -- the library functions, from Python ---------------------------------------------------------------------------
def test_run_generate_gives_the_figures_of_generate_json(tiny_model_dir, tmp_path):
    pieces = []
    report = run_generate(WORDS, tiny_model_dir, CompressionConfig(budget=8, kv_bits=4), max_new_tokens=4,
                          chat=False, on_text=pieces.append, load={"device": "cpu"})
    assert report.result.new_tokens == len(report.result.token_ids) <= 4
    assert "".join(pieces) == report.result.text
    figures = report.to_dict()
    # the config as it ran, its floor the one in force (not the config's None)
    assert figures["config"] == report.config.to_dict() | {"min_capacity": report.config.floor}
    assert figures["config"]["budget"] == 8
    assert figures["model"] == tiny_model_dir and figures["kv_dtype"] == "float32" and figures["weights_bits"] == 16
    assert "token_ids" not in figures and report.plan is None
    cli = CliRunner().invoke(app, ["generate", "--model", tiny_model_dir, "--no-chat", "--policy", "h2o", "--budget",
                                   "8", "--kv-bits", "4", "--max-new-tokens", "4", "--device", "cpu", "--json", WORDS])
    assert cli.exit_code == 0, cli.output
    printed = json.loads(cli.stdout)
    assert list(printed) == list(figures)  # the same object, key for key
    assert printed["text"] == figures["text"] and printed["kv_bytes"] == figures["kv_bytes"]


def test_run_generate_saves_and_resumes_a_prompt_cache(tiny_model_dir, tmp_path):
    path = tmp_path / "prompt.safetensors"
    saved = run_generate(WORDS, tiny_model_dir, CompressionConfig(budget=10, kv_bits=4), max_new_tokens=3,
                         chat=False, save_cache=str(path), load={"device": "cpu"})
    assert path.is_file() and "cache_save_s" in saved.figures
    resumed = run_generate(WORDS + " w13", tiny_model_dir, max_new_tokens=3, chat=False, load_cache=str(path),
                           load={"device": "cpu"})
    assert "cache_load_s" in resumed.figures and resumed.config == saved.config


def test_run_generate_picks_a_setting_under_a_memory_limit(tiny_model_dir):
    from h2o_compress.utils.memory import _status_kib

    lines = []
    resident = _status_kib("VmRSS")  # this whole test process: on a CPU the limit bounds the process, not the job
    report = run_generate(WORDS, tiny_model_dir, max_new_tokens=2, chat=False, memory_limit="64GiB",
                          on_plan=lines.append, load={"device": "cpu"})
    assert report.plan is not None and report.config == report.plan.config
    assert len(lines) == 1 and lines[0].startswith("memory limit 64.00 GiB: picked")
    if resident is not None and not torch.cuda.is_available():
        assert report.plan.weight_bytes >= 0.8 * resident > 10 * 2**20  # the process, not the tiny model's weights
        assert report.figures["measured_peak_kind"] in ("cpu_peak_rss", "cpu_peak_rss_with_load")
    assert report.figures["planned_peak_bytes"] == report.plan.total_bytes
    assert report.figures["measured_peak_bytes"] is None or report.figures["measured_peak_bytes"] >= 0


def test_generate_job_checks_every_setting_before_anything_is_loaded_or_written(tmp_path, monkeypatch):
    from h2o_compress import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    save = tmp_path / "c.safetensors"
    for settings, error, message in (
        ({"temperature": -1.0}, ConfigError, "temperature=-1.0 is invalid"),
        ({"memory_limit": "2GiB", "load_cache": str(tmp_path / "x")}, ConfigError, "cannot be combined"),
        ({"memory_limit": "2GiB", "given": {"budget": 0.5}}, ConfigError, "--budget"),
        ({"threads": 0}, ConfigError, "threads"),
        ({"config": "h2o"}, ConfigError, "config='h2o' is invalid"),
    ):
        with pytest.raises(error, match=message):
            GenerateJob(WORDS, "/no/such/model", save_cache=str(save), **settings)
    with pytest.raises(InputError, match="empty"):
        GenerateJob(" ", save_cache=str(save))
    assert not save.exists() and list(tmp_path.iterdir()) == []


def test_run_ask_answers_each_question_from_one_compressed_context(tiny_model_dir, tmp_path):
    path = tmp_path / "context.safetensors"
    report = run_ask(["w1 w2", "w3"], WORDS * 3, model=tiny_model_dir, max_new_tokens=3, chat=False,
                     save_cache=str(path), load={"device": "cpu"})
    assert [a["question"] for a in report.answers] == ["w1 w2", "w3"]
    assert [a["text"] for a in report.answers] == [r.text for r in report.results]
    assert report.context["config"] == h2o_compress.ASK_DEFAULTS.to_dict() and "compress_s" in report.context
    assert report.context["context_kv_bytes"] < report.context["context_kv_bytes_full_fp16"]
    assert report.to_dict()["answers"] == report.answers and path.is_file()
    document = tmp_path / "doc.txt"
    document.write_text(WORDS * 3)
    job = AskJob("w1 w2", context_file=document, model=tiny_model_dir, max_new_tokens=3, chat=False,
                 load_cache=str(path), load={"device": "cpu"})
    session = job.start()
    assert job.questions == ["w1 w2"] and "cache_load_s" in session.figures
    assert session.answer("w1 w2")["text"] == report.answers[0]["text"]  # the loaded context answers the same


def test_ask_job_checks_every_setting_before_anything_is_loaded_or_written(tmp_path, monkeypatch):
    from h2o_compress import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    save = tmp_path / "c.safetensors"
    with pytest.raises(InputError, match="is empty"):
        AskJob(["Q"], context_file=empty, save_cache=str(save))
    with pytest.raises(ConfigError, match="one of the two"):
        AskJob(["Q"], "text", context_file=empty)
    with pytest.raises(ConfigError, match="cannot be combined"):
        AskJob(["Q"], "text", save_cache=str(save), load_cache=str(tmp_path / "x"))
    with pytest.raises(InputError, match="empty"):
        AskJob(["Q", ""], "text", save_cache=str(save))
    assert not save.exists()


def test_run_profile_checks_the_text_file_and_ray_address_before_making_out(tmp_path):
    settings = ProfileSettings(model="/no/such/model", policies=("h2o",), budgets=(1.0,), kv_bits=(16,),
                               seq_lens=(16,), ppl_tokens=16, agreement_prompts=0,
                               text_file=str(tmp_path / "missing.txt"))
    with pytest.raises(InputError):
        run_profile(settings, tmp_path / "out", show_progress=False)
    settings.text_file = None
    with pytest.raises(ConfigError, match="Ray address .* is empty"):
        run_profile(settings, tmp_path / "out", show_progress=False, ray_address=" ")
    assert not (tmp_path / "out").exists()
