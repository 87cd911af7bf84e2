"""lm-eval scores in the profile report (``h2o-compress profile --lm-eval-tasks``): a tiny model, the local tasks
of ``tests/data/lm_eval_task`` (multiple choice and rolling loglikelihood), 2 documents each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.tiny_lm import one_thread, save_tiny_lm  # noqa: F401 (fixture)
from typer.testing import CliRunner

lm_eval = pytest.importorskip("lm_eval")  # in the `test` extra; the feature itself is the optional `lm-eval` extra

from lm_eval.tasks import TaskManager  # noqa: E402

from h2o_compress.cli import app  # noqa: E402
from h2o_compress.utils.errors import ConfigError, InputError  # noqa: E402
from h2o_compress.profiling import ProfileSettings  # noqa: E402

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval_task"
CHOICE, TEXT = "h2o_tiny_choice", "h2o_tiny_text"
LIMIT = 2

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """The committed task YAMLs with their data_files made absolute (they are relative to the repository root)."""
    target = tmp_path_factory.mktemp("lm-eval-tasks")
    for yaml in TASK_DIR.glob("*.yaml"):
        (target / yaml.name).write_text(yaml.read_text().replace("tests/data/lm_eval_task/", f"{TASK_DIR}/"))
    return str(target)


@pytest.fixture
def local_tasks_only(monkeypatch):
    """lm-eval's TaskManager without its own ~10k tasks (indexing them takes 15 s); ``include_path`` still counts."""
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path=None: TaskManager(
        include_path=include_path, include_defaults=False))


def profile_args(model_dir, out, task_dir, tasks=f"{CHOICE},{TEXT}"):
    return ["profile", "--out", str(out), "--model", str(model_dir), "--device", "cpu", "--policies", "h2o",
            "--budgets", "0.2", "--kv-bits", "4", "--seq-len", "16", "--decode-tokens", "2", "--ppl-tokens", "24",
            "--chunk-size", "8", "--agreement-prompts", "0", "--no-isolate", "--threads", "1",
            "--lm-eval-tasks", tasks, "--lm-eval-limit", str(LIMIT), "--lm-eval-include-path", task_dir]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-lm"))


def test_profile_report_carries_lm_eval_scores(model_dir, task_dir, tmp_path, local_tasks_only):
    out = tmp_path / "report"
    result = runner.invoke(app, profile_args(model_dir, out, task_dir))
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    reference, compressed = report["results"]
    assert [reference["label"], compressed["label"]] == ["full unquantized", "h2o 0.2 4-bit"]
    assert report["settings"]["lm_eval_tasks"] == [CHOICE, TEXT] and report["settings"]["lm_eval_limit"] == LIMIT

    # the uncompressed row (budget 1.0, 16 bits) scores what lm-eval's own hf model scores on the same model
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},device=cpu", tasks=[CHOICE, TEXT],
                                 limit=LIMIT, task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                                 log_samples=False)["results"]
    ours = reference["lm_eval"]["scores"]
    assert ours[CHOICE]["acc,none"] == hf[CHOICE]["acc,none"]
    assert ours[CHOICE]["acc_norm,none"] == hf[CHOICE]["acc_norm,none"]
    assert ours[TEXT]["word_perplexity,none"] == pytest.approx(hf[TEXT]["word_perplexity,none"], rel=1e-5)
    assert reference["lm_eval"]["vs_reference"][TEXT]["word_perplexity,none"] == {"difference": 0.0, "ratio": 1.0}

    # budget 0.2 + 4 bits evicts, and the rolling perplexity moves; the change is against the reference row
    theirs = compressed["lm_eval"]["scores"]
    change = compressed["lm_eval"]["vs_reference"][TEXT]["word_perplexity,none"]
    assert abs(change["ratio"] - 1) > 1e-3
    assert change["ratio"] == pytest.approx(theirs[TEXT]["word_perplexity,none"] / ours[TEXT]["word_perplexity,none"])
    assert compressed["lm_eval"]["vs_reference"][CHOICE]["acc,none"]["difference"] == pytest.approx(
        theirs[CHOICE]["acc,none"] - ours[CHOICE]["acc,none"])

    md = (out / "report.md").read_text()
    assert "### lm-eval scores" in md
    assert f"| {CHOICE} acc | Δ vs ref |" in md and f"| {TEXT} word_perplexity | vs ref |" in md
    section = md.split("### lm-eval scores", 1)[1].split("###", 1)[0]
    line = next(row for row in section.splitlines() if row.startswith("| h2o 0.2 4-bit |"))
    assert f"| {theirs[TEXT]['word_perplexity,none']:.4f} | {change['ratio']:.3f}x |" in line
    assert "lm-eval scores" in (out / "report.html").read_text()

    # the scores are in the row files: a rerun reuses both rows, scores included
    rows = list((out / "rows").glob("*.json"))
    assert len(rows) == 2 and all(json.loads(p.read_text())["record"]["lm_eval"]["scores"] for p in rows)
    again = runner.invoke(app, profile_args(model_dir, tmp_path / "report", task_dir))
    assert again.exit_code == 0, again.output
    assert "2 reused" in again.output
    assert json.loads((out / "report.json").read_text())["results"][1]["lm_eval"]["scores"] == theirs


def test_a_bad_task_name_is_one_error_before_anything_runs(task_dir, tmp_path, local_tasks_only):
    out = tmp_path / "never"
    result = runner.invoke(app, profile_args("/no/such/model", out, task_dir, tasks=f"{CHOICE},no_such_task_17"))
    assert result.exit_code == 2, result.output
    assert "unknown lm-eval task(s) 'no_such_task_17'" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()  # nothing written, no model loaded (the model directory does not even exist)


@pytest.mark.parametrize("bad,error,message", [
    (dict(lm_eval_limit=0), ConfigError, "names no task"),
    (dict(lm_eval_tasks=(CHOICE,), lm_eval_limit=0), ConfigError, "limit=0 is invalid"),
    (dict(lm_eval_tasks=(CHOICE,), lm_eval_include_path="/no/such/dir"), InputError, "is not a directory"),
    (dict(lm_eval_tasks=(" ",)), ConfigError, "names no task"),
])
def test_bad_lm_eval_settings(bad, error, message):
    with pytest.raises(error, match=message):
        ProfileSettings(model="tiny", **bad)
