"""``batch --ray``: Ray Data actors answer the same prompts as the local run, each once, and the output resumes; the
address is checked before anything loads; a Ray instance started for the run keeps Ray's messages off stderr; the
summary has the figures of a local run (the actors' decode rate, KV bytes and peak)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from h2o_compress.cli import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
SETTING = ["--budget", "0.3", "--kv-bits", "4", "--residual", "2", "--max-new-tokens", "10", "--no-chat",
           "--threads", "1", "--batch-size", "3"]


def write_prompts(path: Path, count: int = 8) -> Path:
    lines = [{"id": f"p{i}", "prompt": " ".join(f"w{(5 * i + j) % 120}" for j in range(3 + 4 * i))}
             for i in range(count)]
    lines.append({"id": "bad", "prompt": ""})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def answers(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows), "an id answered twice"
    return {r["id"]: r for r in rows}


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: what is checked must be checked before."""
    from h2o_compress import models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the Ray address was checked")

    monkeypatch.setattr(models, "load_model", refuse)


@pytest.mark.parametrize("address", ["auto", "127.0.0.1:1", "ray://127.0.0.1:1", "nonsense"])
def test_a_bad_ray_address_is_one_line_before_anything_loads(address, tiny_model_dir, tmp_path, monkeypatch,
                                                            no_model_load):
    pytest.importorskip("ray.data")
    import ray._private.services as services

    def no_cluster(*args, **kwargs):  # as on a machine where no Ray runs (other tests may run one here)
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(services, "get_ray_address_from_environment", no_cluster)
    output = tmp_path / "out.jsonl"
    done = runner.invoke(app, ["batch", str(write_prompts(tmp_path / "in.jsonl")), "-o", str(output), "--model",
                               tiny_model_dir, *SETTING, "--ray", address])
    assert done.exit_code == 2, done.output
    assert done.output.startswith("error: ") and done.output.count("\n") == 1 and "Traceback" not in done.output
    expected = {"auto": "none is; allowed: start one (ray start --head)", "nonsense": "'nonsense' is not HOST:PORT"}
    assert expected.get(address, "no Ray cluster answers at 127.0.0.1:1") in done.output
    assert not output.exists()  # nothing written


def test_a_ray_instance_started_for_the_run_is_quiet_and_measures(tiny_model_dir, tmp_path):
    """``--ray`` alone, as a user runs it: a local instance started (and stopped) by the command. Before: Ray's
    INFO blocks on stderr, and ``decode 0.0 tok/s, KV 0 B`` in the summary."""
    pytest.importorskip("ray.data")
    source, output = write_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "h2o_compress", "batch", str(source), "-o", str(output), "--model",
                           tiny_model_dir, *SETTING, "--json", "--ray"], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    assert figures["prompts"] == 9 and figures["errors"] == 1 and figures["ray_actors"] >= 1
    assert figures["decode_tokens_per_s"] > 0 and figures["decode_s"] > 0 and figures["row_steps"] > 0
    assert figures["kv_bytes_per_sequence"] > 0 and figures["peak_bytes"] > 0
    # Ray's log records, progress and warnings stay off stderr, and so do its core's lines (issue 47: an
    # error-level core_worker.cc line in every run)
    noise = [line for line in done.stderr.splitlines()
             if re.search(r"\bINFO\b|\bWARNING\b|Running Dataset|Token authentication|Warning|\.cc:\d+:", line)]
    assert noise == [], "\n".join(noise[:5])
    assert len(answers(output)) == 9


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    from h2o_compress.integrations.ray_sweep import runtime_env

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 * 2**20,
             configure_logging=False, runtime_env=runtime_env())  # the workers import this checkout's package
    yield ray
    ray.shutdown()


def test_ray_answers_the_same_prompts_as_the_local_run(ray_instance, tiny_model_dir, tmp_path):
    source = write_prompts(tmp_path / "in.jsonl")
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    done = runner.invoke(app, ["batch", str(source), "-o", str(local), "--model", tiny_model_dir, *SETTING, "--json"])
    assert done.exit_code == 0, done.output
    here = json.loads(done.output.strip().splitlines()[-1])
    remote.write_text(local.read_text().splitlines(keepends=True)[0])  # one answered already: the rest resume
    done = runner.invoke(app, ["batch", str(source), "-o", str(remote), "--model", tiny_model_dir, *SETTING,
                               "--ray", "--json"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.output.strip().splitlines()[-1])
    assert summary["skipped"] == 1 and summary["prompts"] == 8
    assert summary["kv_bytes_per_sequence"] == here["kv_bytes_per_sequence"]  # the same setting, the same bytes
    assert summary["capacity"] == here["capacity"] and summary["decode_tokens_per_s"] > 0
    assert answers(remote) == answers(local) and len(answers(local)) == 9


BATCH_GUIDE = REPO / "docs" / "guide" / "batch.md"


def readme_batch_commands() -> tuple[str, list[str], list[str]]:
    """The batch guide's prompts file (its ``printf`` line) and its two ``batch`` commands: local, then ``--ray``
    (the README's example until the README pointed to the guide)."""
    text = BATCH_GUIDE.read_text().replace("\\\n", " ")
    printf = next(line for line in text.splitlines() if line.startswith("printf ") and "prompts.jsonl" in line)
    commands = [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("h2o-compress batch ")]
    local = next(c for c in commands if "--ray" not in c)
    remote = next(c for c in commands if "--ray" in c)
    return printf, local, remote


def test_readme_ray_command_runs_and_answers_as_the_local_one():
    """The README's two commands as written: distinct outputs, the same options but the batch, so the same
    answers (before: the same output file, and 128 new tokens instead of the local example's 24)."""
    _, local, remote = readme_batch_commands()
    option = lambda command, name: command[command.index(name) + 1] if name in command else None  # noqa: E731
    assert option(local, "--output") != option(remote, "--output")
    for name in ("--budget", "--kv-bits", "--max-new-tokens", "--policy", "--temperature", "--model"):
        assert option(local, name) == option(remote, name), name
    assert remote[-1] == "--ray" or option(remote, "--ray") in ("local", "auto")


@pytest.mark.integration
def test_readme_ray_example_answers_as_the_local_one(ray_instance, tmp_path, monkeypatch):
    """The README's local and Ray commands, on the real model: the same answers.

    They run inside this test process, which holds every earlier test's models: on a CPU the commands'
    ``--memory-limit`` bounds the whole process (`PeakMemory.held`: its resident set), which in a long session is
    already above the README's 2 GiB. Here the limit counts the model's own weights, as it does in the README's
    fresh process (about 1 GiB in all with SmolLM2: `benchmarks/results/memory_limit_cpu.md`)."""
    from h2o_compress.utils.memory import PeakMemory

    monkeypatch.setattr(PeakMemory, "held", lambda self, model=None: None)
    printf, local, remote = readme_batch_commands()
    monkeypatch.chdir(tmp_path)
    subprocess.run(["bash", "-c", printf], check=True)
    for command in (local, remote):
        done = runner.invoke(app, command)
        assert done.exit_code == 0, done.output
    outputs = [tmp_path / command[command.index("--output") + 1] for command in (local, remote)]
    assert outputs[0] != outputs[1]  # else the Ray run skips every prompt, as already answered
    assert answers(outputs[1]) == answers(outputs[0]) and len(answers(outputs[0])) == 3


def test_a_failed_ray_job_is_one_line():
    """A worker's own error is raised as it was (Ray Data wraps an actor's failure in its traceback text); Ray's
    own failure is one line saying that the same command resumes."""
    pytest.importorskip("ray")
    from h2o_compress.integrations.ray_batch import RayJobError, ray_failure
    from h2o_compress.utils.errors import ModelLoadError

    class ActorDied(Exception):
        pass

    wrapped = ActorDied("The actor died because of an error raised in its creation task\n  File \"x.py\", line 1\n"
                        "h2o_compress.utils.errors.ModelLoadError: cannot load model '/m': not a local directory")
    error = ray_failure(wrapped)
    assert type(error) is ModelLoadError and str(error) == "cannot load model '/m': not a local directory"
    error = ray_failure(ActorDied("The actor died unexpectedly\n\tpid: 12\nOwner's node has crashed."))
    assert isinstance(error, RayJobError) and "\n" not in str(error)
    assert "ActorDied: \"Owner's node has crashed.\"" not in str(error) and "Owner's node has crashed." in str(error)
    assert "rerun the same command, which resumes" in str(error)


# Under pytest -n 2 every Ray test runs on one worker, one Ray instance at a time (two at once oversubscribe 2 cores).
pytestmark = pytest.mark.xdist_group("ray")
