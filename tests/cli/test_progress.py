"""Issue 45 (progress and small things): the long steps report their progress (a first-run model conversion,
ask's scoring pass and compressed prefill) to a callback, which the CLI draws as a bar on a terminal's stderr only
(never under --json, never when stderr is not a terminal); the library prints nothing on its own. Usage lines name
their arguments without braces; profile prints its report's path without a doubled slash."""

from __future__ import annotations

import json

import pytest
from helpers.tiny_lm import save_tiny_lm, tiny_lm
from typer.testing import CliRunner

from h2o_compress.cli import app, click_app
from h2o_compress.runtime.ask import PREFILL_STAGE, compress
from h2o_compress.runtime.context_scores import RECONSTRUCTION_STAGE
from h2o_compress.evaluation import default_corpus
from h2o_compress.utils.progress import report, report_progress

CONTEXT = default_corpus()[:1500]
QUIET_TERMINAL = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")


@pytest.fixture(scope="module")
def ask_args(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    (root / "doc.txt").write_text(CONTEXT[:600])
    return ["ask", "--model", save_tiny_lm(root / "model"), "--no-chat", "--context-file", str(root / "doc.txt"),
            "--max-new-tokens", "2", "--question", "Who?", "--threads", "1"]


def test_ask_draws_its_steps_on_a_terminal_stderr(ask_args, monkeypatch):
    for name in QUIET_TERMINAL:
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(app, ask_args, env={"FORCE_COLOR": "1"})  # rich: stderr is a terminal
    assert result.exit_code == 0, result.output
    assert RECONSTRUCTION_STAGE in result.stderr and PREFILL_STAGE in result.stderr
    assert "[context:" in result.stderr and "Q: Who?" in result.stdout  # the bar is gone before the answer


@pytest.mark.parametrize("extra, env", [([], {}), (["--json"], {"FORCE_COLOR": "1"})])
def test_ask_draws_no_bar_off_a_terminal_or_under_json(ask_args, monkeypatch, extra, env):
    for name in QUIET_TERMINAL:
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(app, ask_args + extra, env=env)
    assert result.exit_code == 0, result.output
    assert "scoring the context" not in result.stderr and PREFILL_STAGE not in result.stderr
    if extra:
        assert json.loads(result.stdout)["answers"][0]["question"] == "Who?"


def test_compress_reports_each_chunk_and_layer_to_its_callback_and_prints_nothing(monkeypatch, capfd):
    from h2o_compress.runtime import context_scores

    monkeypatch.setattr(context_scores, "ATTENTION_FLOATS", 2**15)  # chunks of a few tokens: several reports
    model, tokenizer = tiny_lm()
    calls = []
    compress(model, tokenizer, CONTEXT[:400], chat=False, on_progress=lambda *call: calls.append(call))
    scoring = [(done, total) for stage, done, total in calls if stage == RECONSTRUCTION_STAGE]
    total = scoring[0][1]
    assert len(scoring) > 3 and scoring[0] == (0, total) and scoring[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(scoring, scoring[1:]))  # once per chunk, forward only
    layers = model.config.num_hidden_layers
    assert [call for call in calls if call[0] == PREFILL_STAGE] == [(PREFILL_STAGE, i, layers) for i in range(layers + 1)]
    assert {call[0] for call in calls} == {RECONSTRUCTION_STAGE, PREFILL_STAGE}
    compress(model, tokenizer, CONTEXT[:400], chat=False)  # nobody asked: nothing reported, nothing printed
    assert capfd.readouterr() == ("", "")
    with report_progress(None):
        report("anything", 0, 1)  # silenced: no callback to call


def test_the_first_run_conversion_reports_its_parts_instead_of_transformers_bar(tmp_path, monkeypatch, capfd):
    import gguf
    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from h2o_compress.models import loading

    model, tokenizer = tiny_lm()
    original_tqdm = gguf_utils.tqdm

    def load_weights(*args, **kwargs):  # transformers' GGUF reader walks its tensors through tqdm
        assert [t for t in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")] == [0, 1, 2]
        return model, {}

    class Header:  # gguf's reader of the file: the weights stage counts its tensors from the start
        def __init__(self, path, mode="r"):
            self.tensors = ["a", "b", "c"]

    monkeypatch.setattr(gguf, "GGUFReader", Header)
    monkeypatch.setattr(loading, "check_cache_root", lambda *a, **k: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_weights)
    calls = []
    with report_progress(lambda *call: calls.append(call)):
        loading._convert_gguf(tmp_path / "model.gguf", tmp_path / "converted", "tiny")
    stage = loading.CONVERSION_STAGE.format
    assert calls == [
        (stage("tiny", "tokenizer"), 0, None), (stage("tiny", "tokenizer"), 1, 1),
        (stage("tiny", "weights"), 0, 3), (stage("tiny", "weights"), 1, 3), (stage("tiny", "weights"), 2, 3),
        (stage("tiny", "weights"), 3, 3),
        (stage("tiny", "saving"), 0, None), (stage("tiny", "saving"), 1, 1),
    ]
    assert (tmp_path / "converted" / "model.safetensors").is_file()
    assert gguf_utils.tqdm is original_tqdm and gguf.GGUFReader is Header  # restored after the conversion
    assert "Converting and de-quantizing" not in capfd.readouterr().err


def _commands(command, path=()):
    """``(words after h2o-compress, command)`` of every command under ``command``, groups left out."""
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        yield list(path), command
        return
    for name, sub in subcommands.items():
        yield from _commands(sub, (*path, name))


def test_no_usage_line_shows_a_brace():
    """typer writes a required argument as ``{prompt}``; the usage lines write ``PROMPT`` as click does."""
    usages = {}
    for words, _ in _commands(click_app):
        result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        usages[" ".join(words)] = next(line.strip() for line in result.output.splitlines() if "Usage:" in line)
    assert len(usages) >= 9, usages
    assert not {words: usage for words, usage in usages.items() if "{" in usage or "}" in usage}
    assert usages["generate"].endswith(" generate [OPTIONS] [PROMPT]")  # or --prompt-file
    assert usages["batch"].endswith(" batch [OPTIONS] INPUT")


def test_profile_prints_its_report_paths_without_a_doubled_slash(tmp_path, monkeypatch):
    from h2o_compress.cli import profile as profile_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(profile_cli, "run_profile", lambda *a, **k: {"rows_reused": 2, "results": [{}, {}]})
    monkeypatch.setattr(profile_cli, "write_report", lambda report, out: {"report.md": None})
    monkeypatch.setattr(profile_cli, "load_report", lambda path: {})
    result = CliRunner().invoke(app, ["profile", "--out", "prof/"])
    assert result.exit_code == 0, result.output
    assert "wrote prof/report.json," in result.stdout and "reused from prof/rows" in result.stdout
    assert "//" not in result.stdout
    rendered = CliRunner().invoke(app, ["profile", "--out", "prof//", "--render", "prof/report.json"])
    assert rendered.exit_code == 0, rendered.output
    assert rendered.stdout.strip() == "wrote report.md in prof"


def test_batch_shows_the_library_steps_above_its_bar_and_removes_them_when_done(monkeypatch, tmp_path):
    from h2o_compress.cli.batch import BatchProgress
    from h2o_compress.jobs.batch import BatchJob

    seen = []

    def fake_run(self, on_result=None, on_step=None, on_start=None, on_plan=None):
        report("converting tiny: weights", 0, 2)  # what a first run's conversion reports from inside the job
        seen.append([t.description for t in progress_of[0].tasks])
        report("converting tiny: weights", 2, 2)
        seen.append([t.description for t in progress_of[0].tasks])
        report("converting tiny: weights", 2, 2)  # a late report of a finished step is ignored
        raise SystemExit(0)

    progress_of = []
    original_enter = BatchProgress.__enter__
    monkeypatch.setattr(BatchProgress, "__enter__", lambda self: progress_of.append(self) or original_enter(self))
    monkeypatch.setattr(BatchJob, "run", fake_run)
    (tmp_path / "in.txt").write_text("hello\n")
    CliRunner().invoke(app, ["batch", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.jsonl"),
                             "--model", save_tiny_lm(tmp_path / "m")])
    assert seen == [["converting tiny: weights"], []]
