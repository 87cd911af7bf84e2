"""``h2o-compress batch``: answers appended as they finish, a run killed with SIGKILL resumes to the output of an
uninterrupted run, bad lines are answered with their error, bad files are refused before anything runs, and OUTPUT
is never replaced."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from h2o_compress.cli import app
from h2o_compress.jobs.batch_files import AnswerFile

runner = CliRunner()
SETTING = ["--budget", "0.3", "--kv-bits", "4", "--residual", "2", "--max-new-tokens", "24", "--no-chat",
           "--threads", "1"]


def prompts(count: int) -> list[str]:
    """``count`` prompts of 2 to 40 words of the tiny tokenizer's vocabulary (w0 ... w125)."""
    return [" ".join(f"w{(7 * i + j) % 120}" for j in range(2 + (11 * i) % 39)) for i in range(count)]


def write_input(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts(count))))
    return path


def command(tiny_model_dir, source: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "h2o_compress", "batch", str(source), "--output", str(output), "--model",
            tiny_model_dir, "--batch-size", "3", *SETTING, *extra]


def answers(path: Path) -> dict[str, dict]:
    lines = path.read_text().splitlines()
    out = {json.loads(line)["id"]: json.loads(line) for line in lines}
    assert len(out) == len(lines), "an id answered twice"
    return out


def test_sigkill_then_rerun_gives_the_uninterrupted_output(tiny_model_dir, tmp_path):
    source = write_input(tmp_path / "in.jsonl", 60)
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    done = subprocess.run(command(tiny_model_dir, source, whole, "--json"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["prompts"] == 60
    process = subprocess.Popen(command(tiny_model_dir, source, resumed), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not resumed.exists() or resumed.read_text().count("\n") < 4):
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    answered = resumed.read_text().count("\n")
    assert 4 <= answered < 60, "kill it mid-way"
    with resumed.open("ab") as handle:  # a line cut by the kill, as a write interrupted half-way leaves it
        handle.write(b'{"id": "p59", "text": "half')
    again = subprocess.run(command(tiny_model_dir, source, resumed, "--json"), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout)
    assert summary["skipped"] == answered and summary["prompts"] == 60 - answered
    assert answers(resumed) == answers(whole)


def test_bad_lines_are_answered_with_their_error(tiny_model_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([
        json.dumps({"id": "ok", "prompt": "w1 w2 w3"}),
        "{not json",
        "",
        json.dumps({"id": "key", "prompt": "w1", "colour": 1}),
        json.dumps({"id": "long", "prompt": "w1 w2", "max_new_tokens": 10**6}),
        json.dumps(["a list"]),
        json.dumps({"id": "ok", "prompt": "w4"}),
        json.dumps({"id": "blank", "prompt": " "}),
    ]) + "\n")
    output = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", tiny_model_dir, *SETTING])
    assert result.exit_code == 0, result.output
    got = answers(output)
    assert got["ok"]["finish_reason"] in ("stop", "length") and got["ok"]["text"]
    expected = {"2": "not JSON", "3": "empty", "key": "unknown key 'colour'", "long": "context",
                "6": "not an object", "7": "repeats line 1", "blank": "empty"}
    for ident, words in expected.items():
        assert got[ident]["finish_reason"] == "error" and words in got[ident]["error"], got[ident]
    assert "8 prompts (7 errors" in result.output


def test_text_input_one_prompt_per_line(tiny_model_dir, tmp_path):
    source = tmp_path / "prompts.txt"
    source.write_text("w1 w2 w3\nw5 w6\n")
    output = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", tiny_model_dir, *SETTING])
    assert result.exit_code == 0, result.output
    got = answers(output)
    assert set(got) == {"1", "2"} and got["1"]["prompt_tokens"] == 3 and got["2"]["prompt_tokens"] == 2


@pytest.mark.parametrize("case", ["binary", "missing", "empty", "output is input", "output not ours", "output dir",
                                  "batch size", "limit without auto", "no folder"])
def test_bad_files_and_options_are_refused_before_anything_runs(case, tiny_model_dir, tmp_path):
    source = write_input(tmp_path / "in.jsonl", 3)
    output = tmp_path / "out.jsonl"
    extra: list[str] = []
    if case == "binary":
        source.write_bytes(b"\x00\x01\x02binary")
    elif case == "missing":
        source = tmp_path / "nothing.jsonl"
    elif case == "empty":
        source.write_text("\n\n")
    elif case == "output is input":
        output = source
    elif case == "output not ours":
        output.write_text("my notes\n")
    elif case == "output dir":
        output = tmp_path
    elif case == "batch size":
        extra = ["--batch-size", "zero"]
    elif case == "limit without auto":
        extra = ["--memory-limit", "1GiB"]
    elif case == "no folder":
        output = tmp_path / "nowhere" / "out.jsonl"
    before = output.read_bytes() if output.is_file() else None
    result = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", tiny_model_dir, *SETTING,
                                 *extra])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and "Traceback" not in result.output
    assert (output.read_bytes() if output.is_file() else None) == before  # nothing written, nothing replaced


def test_a_second_run_on_the_same_output_is_refused(tiny_model_dir, tmp_path):
    source = write_input(tmp_path / "in.jsonl", 2)
    output = tmp_path / "out.jsonl"
    with AnswerFile(output, source):
        result = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", tiny_model_dir, *SETTING])
    assert result.exit_code == 2 and "another run" in result.output


def test_auto_batch_size_takes_the_planners_largest(tiny_model_dir, tmp_path, monkeypatch):
    from h2o_compress import CompressionConfig, load_model
    from h2o_compress.planner import fit_batch
    from h2o_compress.utils.memory import PeakMemory

    # what loading held is measured (the process's RSS): taken as nothing here, so the job's plan is fit_batch's
    # on the weights' own bytes (the measured case: tests/test_reliability_round4.py)
    monkeypatch.setattr(PeakMemory, "held", lambda self, model: 0)

    source = write_input(tmp_path / "in.jsonl", 40)
    output = tmp_path / "out.jsonl"
    model, tokenizer = load_model(tiny_model_dir, device="cpu")
    from h2o_compress.runtime.batch import row_config

    config = row_config(CompressionConfig(budget=0.3, kv_bits=4, residual=2), 40 + 24)  # the longest: 40 words + 24
    limit = fit_batch(model, config, 2**40, 40, 24).total_bytes  # weights + one sequence
    while fit_batch(model, config, limit, 40, 24).max_batch < 4:
        limit = int(limit * 1.1)
    expected = fit_batch(model, config, limit, 40, 24).max_batch
    assert 1 < expected < 40
    result = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", tiny_model_dir, *SETTING,
                                 "--batch-size", "auto", "--memory-limit", f"{limit}B", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["batch_size"] == expected and f"batch size {expected} (auto)" in summary["batch_reason"]
    # the plan of the batch that ran, beside the peak it is compared with
    assert summary["planned_peak_bytes"] == fit_batch(model, config, limit, 40, 24, batch=expected).total_bytes
    too_small = runner.invoke(app, ["batch", str(source), "-o", str(tmp_path / "o2.jsonl"), "--model",
                                    tiny_model_dir, *SETTING, "--batch-size", "auto", "--memory-limit", "1KiB"])
    assert too_small.exit_code == 2 and "not even one sequence" in too_small.output


def test_ctrl_c_says_what_the_output_keeps_and_that_rerunning_resumes(tiny_model_dir, tmp_path):
    source = write_input(tmp_path / "in.jsonl", 400)
    output = tmp_path / "out.jsonl"
    # the default SIGINT disposition in the child: a background shell job inherits SIGINT ignored
    process = subprocess.Popen(command(tiny_model_dir, source, output), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < 3):
        assert process.poll() is None, process.communicate()[1][-2000:]
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    kept = output.read_text().count("\n")
    assert process.returncode == 130, err[-2000:]
    assert 3 <= kept < 400, "interrupt it mid-way"
    assert err.strip().splitlines()[-1] == (f"interrupted: {output} keeps {kept} answers; rerun the same command to "
                                            f"resume ({400 - kept} prompts left)")
    assert "Traceback" not in err
    again = subprocess.run(command(tiny_model_dir, source, output, "--max-new-tokens", "2", "--json"),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["skipped"] == kept and len(answers(output)) == 400


def test_messages_say_one_prompt_not_one_prompts(tiny_model_dir, tmp_path):
    source = write_input(tmp_path / "in.jsonl", 1)
    output = tmp_path / "out.jsonl"
    setting = [*SETTING, "--max-new-tokens", "1"]
    first = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", tiny_model_dir, *setting])
    assert first.exit_code == 0, first.output
    assert "[1 prompt (0 errors, 0 already answered) |" in first.output and "+ 1 new token |" in first.output
    again = runner.invoke(app, ["batch", str(source), "-o", str(output), "--model", tiny_model_dir, *setting])
    assert "resuming: 1 prompt already answered in the output" in again.output
    assert "[0 prompts (0 errors, 1 already answered) |" in again.output
