"""``batch --ray``: Ray Data actors answer the same prompts as the local run, each once, and the output resumes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from h2o_compress.cli import app

runner = CliRunner()
SETTING = ["--budget", "0.3", "--kv-bits", "4", "--residual", "2", "--max-new-tokens", "10", "--no-chat",
           "--threads", "1", "--batch-size", "3"]


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
    source = tmp_path / "in.jsonl"
    lines = [{"id": f"p{i}", "prompt": " ".join(f"w{(5 * i + j) % 120}" for j in range(3 + 4 * i))} for i in range(8)]
    lines.append({"id": "bad", "prompt": ""})
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    done = runner.invoke(app, ["batch", str(source), "-o", str(local), "--model", tiny_model_dir, *SETTING])
    assert done.exit_code == 0, done.output
    remote.write_text(local.read_text().splitlines(keepends=True)[0])  # one answered already: the rest resume
    done = runner.invoke(app, ["batch", str(source), "-o", str(remote), "--model", tiny_model_dir, *SETTING,
                               "--ray", "--json"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.output.strip().splitlines()[-1])
    assert summary["skipped"] == 1 and summary["prompts"] == 8

    def answers(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len({r["id"] for r in rows}) == len(rows) == 9
        return {r["id"]: r for r in rows}

    assert answers(remote) == answers(local)
