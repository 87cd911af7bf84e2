"""SIGTERM with ``--ray`` (issue 47, item 12): ``ray.init`` installed its own SIGTERM handlers (a Python one and,
in C, its core worker's failure handler), so SIGTERM during ``batch --ray`` or ``profile --ray`` printed a stack
dump and aborted the process (exit status -6, a core file) instead of ending the run; and Ray's core printed an
error-level ``core_worker.cc`` line on stderr in every ``batch --ray`` run.

Now SIGTERM (and SIGHUP) during ``batch``, with or without ``--ray``, ends the run as Ctrl-C does (OUTPUT closed,
Ray shut down, the one ``interrupted:`` line) and then ends the process by that signal (exit status -15, as
without this handling); ``profile --ray`` keeps its finished rows and ends by the signal; a normal run prints no
line of Ray's core.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETTING = ["--budget", "0.3", "--kv-bits", "4", "--residual", "2", "--max-new-tokens", "10", "--no-chat",
           "--threads", "1", "--batch-size", "3"]
#: What Ray printed on SIGTERM or in a normal run before: its core's log lines and its failure handler's dump.
RAY_NOISE = ("core_worker", "logging.cc", "SIGTERM received", "PC: @", "Traceback")


def environment() -> dict:
    """This checkout's package first on the path (the workers Ray starts import it too)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def write_prompts(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": " ".join(f"w{(5 * i + j) % 120}"
                                                                           for j in range(3 + i % 9))}) + "\n"
                            for i in range(count)))
    return path


def batch_command(model: str, source: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "h2o_compress", "batch", str(source), "-o", str(output), "--model", model,
            *SETTING, *extra]


def _default_hangup() -> None:
    """In the child: SIGHUP's default action, whatever the test runner inherited (under ``nohup`` it is ignored, and
    the batch rightly leaves an ignored signal ignored)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def terminate_after(command: list[str], output: Path, lines: int, cwd: Path, signum=signal.SIGTERM):
    """Run ``command``, send ``signum`` once ``output`` holds ``lines`` lines; returns ``(exit status, stderr,
    seconds from the signal to the exit, the processes it had started then)``."""
    psutil = pytest.importorskip("psutil")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
                               cwd=cwd, start_new_session=True, preexec_fn=_default_hangup)
    started = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < lines):
            assert process.poll() is None, process.communicate()[1][-3000:]
            time.sleep(0.05)
        started = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signum)
        sent = time.monotonic()
        _, err = process.communicate(timeout=120)
        return process.returncode, err, time.monotonic() - sent, started
    finally:
        for child in [*started, process]:  # what this test started, should the run not end by itself
            try:
                child.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        process.wait()


def alive(processes) -> list[str]:
    """The command lines of ``processes`` still running (not zombies), after a few seconds' grace."""
    psutil = pytest.importorskip("psutil")
    _, left = psutil.wait_procs(processes, timeout=10)
    return [" ".join(p.cmdline())[:120] for p in left if p.status() != psutil.STATUS_ZOMBIE]


def check_interrupted(status: int, err: str, output: Path, total: int, signum=signal.SIGTERM) -> int:
    """The run ended by ``signum`` after the one ``interrupted:`` line, OUTPUT holding complete answers; returns
    how many."""
    kept = output.read_text().count("\n")
    assert status == -signum, err[-3000:]
    assert 3 <= kept < total, "signal it mid-way"
    assert err.strip().splitlines()[-1] == (f"interrupted: {output} keeps {kept} answers; rerun the same command to "
                                            f"resume ({total - kept} prompts left)"), err[-3000:]
    assert [word for word in RAY_NOISE if word in err] == [], err[-3000:]
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len({row["id"] for row in rows}) == kept and all(row["finish_reason"] != "error" for row in rows)
    return kept


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_signal_during_a_local_batch_says_what_is_kept_then_ends_by_it(tiny_model_dir, tmp_path, signame):
    """Without ``--ray``: before, the process ended where it stood, with no line (exit status -15 as now)."""
    signum = getattr(signal, signame)
    source, output = write_prompts(tmp_path / "in.jsonl", 60), tmp_path / "out.jsonl"
    status, err, _, _ = terminate_after(batch_command(tiny_model_dir, source, output), output, 3, tmp_path, signum)
    kept = check_interrupted(status, err, output, 60, signum)
    again = subprocess.run(batch_command(tiny_model_dir, source, output, "--max-new-tokens", "1", "--json"),
                           capture_output=True, text=True, timeout=600, env=environment(), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["skipped"] == kept and output.read_text().count("\n") == 60


def test_sigterm_during_a_ray_batch_ends_it_as_without_ray(tiny_model_dir, tmp_path):
    """``batch --ray`` (a local Ray instance for the run): before, exit status -6 with Ray's dump on stderr and
    no ``interrupted:`` line. Now the line, Ray shut down (no Ray process of the run left), exit status -15; the
    answers written are kept and the same command resumes."""
    pytest.importorskip("ray.data")
    source, output = write_prompts(tmp_path / "in.jsonl", 60), tmp_path / "out.jsonl"
    status, err, seconds, started = terminate_after(batch_command(tiny_model_dir, source, output, "--ray"), output,
                                                    3, tmp_path)
    kept = check_interrupted(status, err, output, 60)
    assert seconds < 60, f"{seconds:.0f} s from SIGTERM to the exit"
    assert started and alive(started) == []  # the local instance's GCS, raylet, workers: stopped by ray.shutdown
    again = subprocess.run(batch_command(tiny_model_dir, source, output, "--json"), capture_output=True, text=True,
                           timeout=600, env=environment(), cwd=tmp_path)  # resumed here: faster than on Ray
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["skipped"] == kept and output.read_text().count("\n") == 60


def test_sigterm_during_a_ray_profile_keeps_its_rows_and_ends_by_it(tiny_model_dir, tmp_path):
    """``profile --ray``: before, exit status -6 with Ray's dump; now its finished rows are kept and it ends by
    the signal, as the local sweep does."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "h2o_compress", "profile", "--model", tiny_model_dir, "--out", str(out),
               "--device", "cpu", "--threads", "1", "--policies", "h2o,local", "--budgets", "1,0.5,0.25,0.125",
               "--kv-bits", "16", "--seq-len", "16", "--decode-tokens", "1", "--ppl-tokens", "16",
               "--agreement-prompts", "0", "--ray"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
                               cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list(out.glob("rows/*.json")):
            assert process.poll() is None, process.communicate()[1][-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGTERM, err[-3000:]
    assert [word for word in RAY_NOISE if word in err] == [], err[-3000:]
    rows = sorted((out / "rows").glob("*.json"))
    assert 0 < len(rows) < 8
    assert all(json.loads(row.read_text())["record"]["perplexity"]["perplexity"] > 0 for row in rows)


def process_env(name: str) -> str | None:
    """``name`` in this process's environment as C code (Ray's core) reads it (``getenv``), not ``os.environ``."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    value = libc.getenv(name.encode())
    return None if value is None else value.decode()


class FakeRay:
    """``ray`` as `connect` uses it; ``init`` does what Ray's does to this process: a SIGTERM handler of its own,
    a line of its core on stderr (fd 2), and reads the core's log level."""

    def __init__(self):
        self.level = None

    @staticmethod
    def is_initialized() -> bool:
        return False

    def init(self, **options) -> None:
        signal.signal(signal.SIGTERM, lambda *args: sys.exit(15))
        self.level = process_env("RAY_BACKEND_LOG_LEVEL")
        os.write(2, b"[2026-11-27 08:09:28,711 E 12424 12424] core_worker.cc:2465: Actor with class name: ...\n")
        os.write(2, b"not Ray's core\n")


def test_connect_gives_back_the_sigterm_handler_and_quiets_rays_core(capfd, monkeypatch):
    from h2o_compress.integrations import ray_sweep

    monkeypatch.delenv("RAY_BACKEND_LOG_LEVEL", raising=False)
    ray, before = FakeRay(), signal.getsignal(signal.SIGTERM)
    try:
        assert ray_sweep.connect(ray, "local") is True
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capfd.readouterr().err
    assert ray.level == "fatal"  # set while connecting, for this process only (never in os.environ)
    assert "RAY_BACKEND_LOG_LEVEL" not in os.environ and process_env("RAY_BACKEND_LOG_LEVEL") is None
    assert "core_worker" not in err and "not Ray's core" in err
    ray = FakeRay()
    ray_sweep.connect(ray, "local", verbose=True)  # --verbose: Ray's core as Ray sets it, its lines shown
    signal.signal(signal.SIGTERM, before)
    assert ray.level is None and "core_worker" in capfd.readouterr().err


# Under pytest -n 2 every Ray test runs on one worker, one Ray instance at a time (two at once oversubscribe 2 cores).
pytestmark = pytest.mark.xdist_group("ray")
