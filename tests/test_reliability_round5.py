"""Writes killed outright or refused by a full disk, and lm-eval / ``--threads`` values refused before anything runs.

1. Staging left by a killed write: a conversion, a saved cache and a profile report killed at any point (SIGKILL,
   SIGTERM) leave nothing that the next run does not remove; only this user's staging that no running write holds is
   removed (`h2o_compress.utils.files.remove_stale`).
2. A full disk: every write (conversion, ``save_cache``, ``calibrate --out``, ``batch --output``, ``profile --out``)
   gives one line naming the path and the bytes it needs, and leaves what was there before as it was.
3. lm-eval ``model_args`` and ``--threads`` refused in one line before the model loads.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from helpers.tiny_lm import tiny_lm

from h2o_compress import CompressionConfig, make_cache, save_cache
from h2o_compress.runtime.prefill import prefill
from h2o_compress.utils.errors import CacheFileError, ConfigError, InputError, ModelLoadError

REPO = Path(__file__).resolve().parents[1]
NO_SPACE = 'Error while serializing: I/O error: No space left on device (os error 28) at path "{}/.tmpAbC123"'
"""What safetensors 0.8 raises when the disk is full (before 0.8: ``IoError(Os { code: 28, ... })``)."""


def _dead_pid() -> int:
    """The PID of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _one_line(message: str, path, nbytes: int | None = None) -> None:
    assert "\n" not in message and str(path) in message and "No space left on device" in message
    if nbytes is not None:
        assert f"({nbytes} bytes)" in message and f"free at least {nbytes} bytes" in message


def _fake_loading(monkeypatch, model, tokenizer) -> None:
    """Reading the GGUF replaced by the tiny model (the conversion then saves it as it would SmolLM2)."""
    from h2o_compress.models import loading

    monkeypatch.setattr(loading, "_read_gguf", lambda *a, **k: (tokenizer, model))


# -- 1. staging that killed writes leave ---------------------------------------------------------------------------
CONVERT = """
import sys, time
from pathlib import Path
sys.path[:0] = [{repo!r}, {tests!r}]
import safetensors.torch
from helpers.tiny_lm import tiny_lm
from h2o_compress.models import loading

model, tokenizer = tiny_lm()
loading._read_gguf = lambda *a, **k: (tokenizer, model)
save = safetensors.torch.save_model

def save_then_hang(*args, **kwargs):  # the weights are written (a 538 MB file for SmolLM2): killed here
    save(*args, **kwargs)
    print("saving", flush=True)
    time.sleep(120)

safetensors.torch.save_model = save_then_hang
loading._convert_gguf(Path("model.gguf"), Path({target!r}), "tiny")
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_conversion_killed_while_saving_is_followed_by_one_that_leaves_one_copy(tmp_path, monkeypatch, signum):
    from h2o_compress.models import loading

    target = tmp_path / "smollm2-converted"
    script = CONVERT.format(repo=str(REPO), tests=str(REPO / "tests"), target=str(target))
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "saving"
        assert [p.name.startswith(".converting-") for p in tmp_path.iterdir()] == [True]
    finally:
        process.send_signal(signum)
        assert process.wait(timeout=60) == -signum  # SIGTERM: the staging is removed, then the process ends by it
    left = list(tmp_path.iterdir())
    assert len(left) == (1 if signum == signal.SIGKILL else 0)  # SIGKILL: no handler runs, the staging stays
    _fake_loading(monkeypatch, *tiny_lm())
    loading._convert_gguf(tmp_path / "model.gguf", target, "tiny")  # the next first run
    assert list(tmp_path.iterdir()) == [target]  # one copy, the killed run's staging removed
    assert (target / "model.safetensors").is_file() and not (target / ".lock").exists()


def test_the_next_conversion_removes_only_this_users_staging_that_no_live_writer_holds(tmp_path, monkeypatch):
    from h2o_compress.models import loading

    dead, root = _dead_pid(), tmp_path / "cache"
    root.mkdir()

    def staging(name: str, lock: bool = True, age: float = 0.0) -> Path:
        path = root / name
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half a model")
        if lock:
            (path / ".lock").touch()
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    gone = [staging(f".converting-{dead}-abcdefgh"), staging(".converting-oldoldol", lock=False, age=7200),
            staging(f".converting-{os.getpid()}-reusedpi", age=7200)]  # a PID alive again, but hours old
    kept = [staging(f".converting-{os.getpid()}-livelive"), staging(f".converting-{dead}-heldheld"),
            staging(".converting-newnewne", lock=False), staging(f".converting-{dead}-short")]
    held = [os.open(root / name / ".lock", os.O_RDONLY) for name in (kept[0].name, kept[1].name)]
    for fd in held:  # a conversion in progress (its PID may be of another PID namespace: the lock decides)
        fcntl.flock(fd, fcntl.LOCK_EX)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    (root / f".converting-{dead}-linklink").symlink_to(elsewhere)
    (root / f".converting-{dead}-filefile").write_text("a file, not a staging directory")
    others = staging(f".converting-{dead}-otheruse")
    if os.getuid() == 0:
        os.chown(others, 12345, 12345)
        kept.append(others)
    else:
        gone.append(others)
    _fake_loading(monkeypatch, *tiny_lm())
    try:
        loading._convert_gguf(tmp_path / "model.gguf", root / "converted", "tiny")
    finally:
        for fd in held:
            os.close(fd)
    assert not any(path.exists() for path in gone)
    assert all(path.is_dir() and (path / "model.safetensors").exists() for path in kept)
    assert (root / f".converting-{dead}-linklink").is_symlink() and (elsewhere / "keep").read_text() == "mine"
    assert (root / f".converting-{dead}-filefile").is_file() and (root / "converted" / "model.safetensors").is_file()


SAVE = """
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from h2o_compress.persistence.file_format import _atomic_write

def write(tmp):  # as safetensors 0.8 writes: its own .tmpXXXXXX in the file's folder, renamed onto the file
    own = Path(tmp).parent / ".tmpAbC123"
    own.write_bytes(b"x" * 100_000)
    print("writing", flush=True)
    time.sleep(120)

_atomic_write(write, Path({target!r}))
"""


def test_a_save_killed_outright_leaves_nothing_the_next_save_does_not_remove(tmp_path):
    from h2o_compress.persistence.file_format import _atomic_write

    target = tmp_path / "doc.safetensors"
    target.write_bytes(b"the earlier cache")
    process = subprocess.Popen([sys.executable, "-c", SAVE.format(repo=str(REPO), target=str(target))],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "writing"
    finally:
        process.kill()
        process.wait(timeout=60)
    assert target.read_bytes() == b"the earlier cache"
    assert not (tmp_path / ".tmpAbC123").exists()  # safetensors' own file lies in the save's staging directory
    _atomic_write(lambda tmp: Path(tmp).write_bytes(b"the new cache"), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name] and target.read_bytes() == b"the new cache"


def test_profile_writes_remove_the_staging_files_killed_runs_left(tmp_path):
    from h2o_compress.profiling.rows import RowStore
    from h2o_compress.utils.outputs import OutputDir

    out, dead = tmp_path / "out", _dead_pid()
    (out / "rows").mkdir(parents=True)
    gone = [out / f".h2o-{dead}-abcdefgh.tmp", out / "rows" / f".row-{dead}-abcdefgh.tmp", out / ".h2o-legacy_1.tmp"]
    kept = [out / f".h2o-{os.getpid()}-livelive.tmp", out / f".h2o-{dead}-heldheld.tmp", out / ".h2o-x.tmp",
            out / "rows" / f".row-{os.getpid()}-livelive.tmp", out / "notes.tmp"]
    for path in gone + kept:
        path.write_bytes(b"half a report")
    os.utime(gone[2], (time.time() - 7200, time.time() - 7200))  # made before staging names carried a PID
    held = os.open(kept[1], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        OutputDir(out).write("report.md", "# profile\n")
        RowStore(out).save({"k": 1}, "h2o 0.5", {"label": "x"})
    finally:
        os.close(held)
    assert not any(path.exists() for path in gone) and all(path.exists() for path in kept)
    assert (out / "report.md").read_text() == "# profile\n"


# -- 2. a full disk -------------------------------------------------------------------------------------------------
def test_conversion_on_a_full_disk_with_safetensors_08_text_is_one_line(tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    from h2o_compress.models import loading

    model, tokenizer = tiny_lm()
    _fake_loading(monkeypatch, model, tokenizer)

    def full(model, path, *args, **kwargs):
        raise SafetensorError(NO_SPACE.format(Path(path).parent))

    monkeypatch.setattr(safetensors.torch, "save_model", full)
    target = tmp_path / "smollm2-converted"
    with pytest.raises(ModelLoadError) as err:
        loading._convert_gguf(tmp_path / "model.gguf", target, "tiny")
    _one_line(str(err.value), target, sum(t.numel() * t.element_size() for t in model.state_dict().values()))
    assert list(tmp_path.iterdir()) == []  # no staging, no half a model


@pytest.fixture(scope="module")
def filled_cache():
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=8))
    with torch.no_grad():
        prefill(model, torch.randint(0, 128, (1, 10)), cache)
    return model, cache


@pytest.mark.parametrize("error", ["safetensors", "oserror"])
def test_save_cache_on_a_full_disk_names_the_bytes_and_keeps_the_earlier_file(tmp_path, monkeypatch, filled_cache,
                                                                              error):
    from safetensors import SafetensorError

    from h2o_compress.persistence import file_format

    model, cache = filled_cache
    target = save_cache(cache, tmp_path / "a.safetensors", model=model)
    before = target.read_bytes()

    def full(tensors, tmp, metadata=None):
        Path(tmp).write_bytes(b"half")
        if error == "oserror":
            _no_space()
        raise SafetensorError(NO_SPACE.format(Path(tmp).parent))

    monkeypatch.setattr(file_format, "save_file", full)
    with pytest.raises(CacheFileError) as err:
        save_cache(cache, target, model=model)
    message = str(err.value)
    _one_line(message, target)
    assert message.startswith(f"cannot write cache file {str(target)!r} (") and "bytes): " in message
    assert abs(int(message.split(" (")[1].split(" bytes")[0]) - len(before)) < 256  # the file's size
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_calibrate_out_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    from h2o_compress.persistence import file_format
    from h2o_compress.persistence.calibration_file import Calibration, save_calibration

    calibration = Calibration({"eviction_weights": torch.zeros(2, 2, 36)}, "fingerprint", "tiny", {})
    monkeypatch.setattr(file_format, "save_file", _no_space)
    target = tmp_path / "calibration.safetensors"
    with pytest.raises(CacheFileError) as err:
        save_calibration(target, calibration)
    message = str(err.value)
    _one_line(message, target)
    assert message.startswith(f"cannot write calibration file {str(target)!r} (")
    assert int(message.split(" (")[1].split(" bytes")[0]) > 2 * 2 * 36 * 4  # the tensors' bytes and the header's
    assert list(tmp_path.iterdir()) == []


def test_batch_output_on_a_full_disk_keeps_the_earlier_answers(tmp_path, monkeypatch):
    from h2o_compress.jobs import batch_files
    from h2o_compress.runtime.batch_requests import BatchResult

    output = tmp_path / "out.jsonl"
    with batch_files.AnswerFile(output) as answers:
        answers.write(BatchResult(id="0", index=0, text="first"))
    before = output.read_bytes()
    write, calls = os.write, []

    def part_then_full(fd, data):  # some bytes go out, then the disk is full
        calls.append(len(data))
        if len(calls) == 1:
            return write(fd, bytes(data[:7]))
        _no_space()

    with batch_files.AnswerFile(output) as answers:
        monkeypatch.setattr(batch_files.os, "write", part_then_full)
        with pytest.raises(InputError) as err:
            answers.write(BatchResult(id="1", index=1, text="second"))
        monkeypatch.undo()
    line = json.dumps(BatchResult(id="1", index=1, text="second").to_dict(), ensure_ascii=False) + "\n"
    _one_line(str(err.value), output, len(line.encode()))
    assert str(err.value).startswith("cannot write output") and output.read_bytes() == before  # no half line


def test_profile_out_on_a_full_disk_leaves_the_report_and_its_manifest_as_they_were(tmp_path, monkeypatch):
    from h2o_compress.utils import outputs

    out = outputs.OutputDir(tmp_path / "out")
    out.write("report.md", "# first\n")
    before = {p.name: p.read_bytes() for p in out.path.iterdir()}
    write, calls = outputs.write_all, []

    def manifest_on_a_full_disk(fd, data):  # the report fits, its manifest does not
        calls.append(data)
        if len(calls) == 2:
            _no_space()
        write(fd, data)

    monkeypatch.setattr(outputs, "write_all", manifest_on_a_full_disk)
    with pytest.raises(InputError) as err:
        out.write("report.md", "# second, longer\n")
    _one_line(str(err.value), out.path / "report.md")
    assert f"({len(calls[0]) + len(calls[1])} bytes)" in str(err.value)
    assert {p.name: p.read_bytes() for p in out.path.iterdir()} == before
    monkeypatch.undo()
    out.write("report.md", "# second\n")  # still this package's file: replaced
    assert (out.path / "report.md").read_text() == "# second\n"


# -- 3. lm-eval model_args and --threads -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, error, message", [
    ({"device": "tpu9"}, ConfigError, "unknown device 'tpu9'; allowed: auto, cpu, cuda, cuda:N"),
    ({"dtype": "int3"}, ConfigError, "unknown dtype 'int3'; allowed: float32"),
    ({"trust_remote_code": "maybe"}, ConfigError, "trust_remote_code='maybe' is invalid; allowed: True or False"),
    ({"pretrained": ""}, ModelLoadError, "model name '' is empty or not a text; allowed: an alias"),
    ({"pretrained": "  "}, ModelLoadError, "model name '  ' is empty or not a text"),
    ({"policy": "calibrated", "calibration": "/no/such/calibration.safetensors"}, CacheFileError,
     "calibration file '/no/such/calibration.safetensors' does not exist; make one with: h2o-compress calibrate"),
])
def test_lm_eval_model_args_are_refused_before_the_tasks_are_read(args, error, message):
    pytest.importorskip("lm_eval")
    from h2o_compress.integrations.lm_eval_model import check_model_args

    with pytest.raises(error) as err:
        check_model_args({"pretrained": "smollm2-135m", **args})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_lm_eval_model_checks_its_loading_arguments_before_loading(monkeypatch):
    pytest.importorskip("lm_eval")
    from h2o_compress.integrations import lm_eval_model

    monkeypatch.setattr(lm_eval_model, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="unknown device 'tpu9'"):
        lm_eval_model.H2OCompressLM(device="tpu9")
    assert lm_eval_model.check_model_args({"pretrained": "smollm2-135m", "dtype": "auto", "device": "cpu"})


def test_threads_are_bounded_by_the_cpus(monkeypatch):
    from h2o_compress.cli.common import set_threads
    from h2o_compress.utils import checks

    monkeypatch.setattr(checks.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert checks.max_threads() == 2 * checks.THREADS_PER_CPU
    assert checks.check_threads(8) == 8 and checks.check_threads(4096, here=False) == 4096  # a Ray cluster's
    for call in (checks.check_threads, set_threads):
        with pytest.raises(ConfigError, match=r"threads=4096 is invalid; allowed: an integer >= 1 \(threads; 4 per "
                                              r"CPU here\), at most 8"):
            call(4096)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) > 64,
                    reason="4096 threads must be past the bound here")
def test_threads_4096_under_an_address_space_limit_is_one_line_not_a_memory_error(tmp_path):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))

    command = [sys.executable, "-m", "h2o_compress", "generate", "hi", "--max-new-tokens", "1", "--threads", "4096"]
    env = {**os.environ, "H2O_COMPRESS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, check=False, capture_output=True, text=True, preexec_fn=limit, timeout=300,
                            cwd=tmp_path, env=env)
    assert result.returncode == 2 and "MemoryError" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: threads=4096 is invalid")
