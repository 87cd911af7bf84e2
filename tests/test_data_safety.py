"""Nothing is lost: saves never replace what is not a cache file, keep the replaced file's mode, leave no partial
file on SIGTERM/SIGHUP; a saved prompt cache is the prefix a follow-up prompt shares (with and without the chat
template); ``--load-cache`` reports its load time as such."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import save_tiny_model_dir
from typer.testing import CliRunner

from h2o_compress.persistence import save_cache, load_cache
from h2o_compress.cli import app
from h2o_compress.utils.errors import CacheFileError
from h2o_compress.persistence.file_format import _atomic_write, check_save_target, is_cache_file

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
CHAT_TEMPLATE = (
    "{% for m in messages %}w120 {{ m['content'] }} w121{% endfor %}{% if add_generation_prompt %} w122 w123{% endif %}"
)
DOC = " ".join(f"w{i}" for i in range(1, 25))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny LLaMA whose word-level tokenizer has a chat template (user turn, then an assistant header)."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-chat"), chat_template=CHAT_TEMPLATE)


def _generate(model_dir, *args):
    result = runner.invoke(app, ["generate", "--model", model_dir, "--max-new-tokens", "3", "--budget", "0.5",
                                 "--kv-bits", "4", *args])
    return result


# -- what a save may replace ------------------------------------------------------------------------------------------
def test_save_refuses_a_user_file_but_overwrite_replaces_it_keeping_its_mode(chat_dir, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    notes.chmod(0o640)
    refused = _generate(chat_dir, "--no-chat", "--save-cache", str(notes), DOC)
    assert refused.exit_code == 2 and "is not an h2o-compress cache file" in refused.output
    assert notes.read_text() == "mine"
    replaced = _generate(chat_dir, "--no-chat", "--save-cache", str(notes), "--overwrite", DOC)
    assert replaced.exit_code == 0, replaced.output
    assert is_cache_file(notes) and stat.S_IMODE(notes.stat().st_mode) == 0o640


def test_a_cache_file_is_replaced_without_overwrite(chat_dir, tmp_path):
    target = tmp_path / "doc.safetensors"
    assert _generate(chat_dir, "--no-chat", "--save-cache", str(target), DOC).exit_code == 0
    target.chmod(0o604)
    again = _generate(chat_dir, "--no-chat", "--save-cache", str(target), DOC + " w30")
    assert again.exit_code == 0, again.output
    assert stat.S_IMODE(target.stat().st_mode) == 0o604


def test_new_files_get_the_umask_mode_not_0600(tmp_path):
    _atomic_write(lambda tmp: Path(tmp).write_bytes(b"x"), tmp_path / "new")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink"])
def test_only_regular_files_are_replaced(tmp_path, kind):
    target = tmp_path / "t"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    else:
        (tmp_path / "real").write_text("x")
        target.symlink_to(tmp_path / "real")
    with pytest.raises(CacheFileError, match="is not a regular file"):
        check_save_target(target, overwrite=True)


# -- SIGTERM / SIGHUP during a save -----------------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_save_removes_the_partial_file(tmp_path, signum):
    script = textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from h2o_compress.persistence.file_format import _atomic_write

        signal.signal({int(signum)}, signal.SIG_DFL)  # default disposition (nohup, for one, starts with SIGHUP ignored)

        def write(tmp):
            Path(tmp).write_bytes(b"x" * 1_000_000)
            print("writing", flush=True)
            time.sleep(60)

        _atomic_write(write, Path({str(tmp_path / 'doc.safetensors')!r}))
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "writing"
    assert any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    process.send_signal(signum)
    assert process.wait(timeout=30) == -signum  # still ends the way the signal says
    assert list(tmp_path.iterdir()) == []


# -- the saved prefix and the follow-up ---------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", ["--chat", "--no-chat"])
def test_save_then_load_with_a_follow_up_prompt(chat_dir, tmp_path, chat):
    saved = tmp_path / "doc.safetensors"
    first = _generate(chat_dir, chat, "--save-cache", str(saved), "--json", DOC)
    assert first.exit_code == 0, first.output
    follow_up = _generate(chat_dir, chat, "--load-cache", str(saved), "--json", DOC + " w40 w41")
    assert follow_up.exit_code == 0, follow_up.output
    figures = json.loads(follow_up.stdout)
    assert figures["cache_load_s"] == figures["prefill_s"] > 0


def test_chat_save_holds_the_context_without_the_assistant_header(chat_dir, tmp_path):
    from safetensors import safe_open

    saved = tmp_path / "doc.safetensors"
    assert _generate(chat_dir, "--chat", "--save-cache", str(saved), DOC).exit_code == 0
    with safe_open(str(saved), framework="pt") as handle:
        ids = handle.get_tensor("prompt.token_ids")[0].tolist()
    assert ids == [120] + list(range(1, 25))  # "w120 <doc>": no "w121 w122 w123" (end of turn, assistant header)


def test_load_cache_reports_load_time_not_prefill(chat_dir, tmp_path):
    saved = tmp_path / "doc.safetensors"
    assert _generate(chat_dir, "--no-chat", "--save-cache", str(saved), DOC).exit_code == 0
    loaded = _generate(chat_dir, "--no-chat", "--load-cache", str(saved), DOC + " w40")
    assert loaded.exit_code == 0, loaded.output
    assert "cache load + prompt" in loaded.stderr and "| prefill " not in loaded.stderr


def test_summary_names_the_real_kv_dtype(chat_dir):
    result = _generate(chat_dir, "--no-chat", "--budget", "1.0", "--kv-bits", "16", DOC)
    assert result.exit_code == 0, result.output
    # an uncompressed fp32 cache is 100% of itself, like with like (positions and free slots apart), not "204% of
    # an fp16 cache" nor "101.4%"
    share = re.search(r"= ([0-9.]+)% of the uncompressed cache \(float32, the model's dtype\) \+ ", result.stderr)
    assert share is not None, result.stderr
    assert float(share[1]) == 100.0 and "fp16" not in result.stderr


def test_rejected_option_leaves_a_good_cache_file_alone(chat_dir, tmp_path):
    saved = tmp_path / "doc.safetensors"
    assert _generate(chat_dir, "--no-chat", "--save-cache", str(saved), DOC).exit_code == 0
    before = (saved.read_bytes(), saved.stat().st_mtime_ns)
    time.sleep(0.01)
    for bad in (["--temperature", "-1"], ["--max-new-tokens", "0"], ["--seed", "-5"]):
        result = runner.invoke(app, ["generate", "--model", chat_dir, "--no-chat", "--save-cache", str(saved), *bad,
                                     DOC + " w50"])
        assert result.exit_code == 2, result.output
    assert (saved.read_bytes(), saved.stat().st_mtime_ns) == before


def test_load_without_a_model_is_a_clear_error(tmp_path):
    import torch
    from conftest import tiny_llama

    from h2o_compress import CacheStateError, CompressionConfig, make_cache
    from h2o_compress.runtime.prefill import prefill

    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=8))
    prefill(model, torch.arange(1, 12).unsqueeze(0), cache)
    save_cache(cache, tmp_path / "c.safetensors")
    with pytest.raises(CacheStateError, match="model=None is not a transformers model; allowed: the model the cache"):
        load_cache(tmp_path / "c.safetensors", None)


@pytest.mark.integration
@pytest.mark.parametrize("chat", ["--chat", "--no-chat"])
def test_real_model_save_then_follow_up(tmp_path, chat):
    doc = "The lighthouse keeper counted the ships that passed each night and wrote their names in a book."
    saved = tmp_path / "doc.safetensors"
    base = ["generate", "--max-new-tokens", "2", "--budget", "0.5", "--kv-bits", "4", "--threads", "2", chat]
    first = runner.invoke(app, [*base, "--save-cache", str(saved), doc])
    assert first.exit_code == 0, first.output
    follow_up = runner.invoke(app, [*base, "--load-cache", str(saved), "--json", doc + " What did he count?"])
    assert follow_up.exit_code == 0, follow_up.output
    assert json.loads(follow_up.stdout)["cache_load_s"] > 0
