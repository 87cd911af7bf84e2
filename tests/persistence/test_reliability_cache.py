"""Issue 34, the cache classes: a cache used beyond the length it was made for, by another model of the same shapes,
or as no cache at all; a crafted file asking for a huge capacity; temporary files a killed save left; a loaded
prompt cache with another text. Each is refused up front with one clean H2OCompressError (or cleaned up)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from conftest import tiny_llama
from helpers.tiny_lm import tiny_lm
from safetensors.torch import save_file

from h2o_compress import CacheFileError, CacheStateError, CompressionConfig, InputError, generate, make_cache
from h2o_compress.cache.layer import CompressedLayer
from h2o_compress.persistence import load_cache, save_cache
from h2o_compress.persistence.file_format import _checksum, read_cache_file
from h2o_compress.runtime.ask import CompressedContext, ask
from h2o_compress.runtime.generation import encode_prompt
from h2o_compress.runtime.prefill import prefill
from h2o_compress.runtime.prompt_cache import prepare_prompt_cache

SHORT = "It was"  # 4 tokens of the tiny BPE tokenizer
TEXT = "It was a bright cold day in April, and the clocks were striking thirteen."


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return tiny_lm()


# 1. a cache made for max_length=10 used for 30+ tokens


def test_generate_refuses_a_cache_too_short_before_any_step(lm, monkeypatch):
    model, tokenizer = lm
    from h2o_compress.runtime import decode_loop

    steps = []
    real = decode_loop.decode_steps
    monkeypatch.setattr(decode_loop, "decode_steps", lambda *a, **k: steps.append(1) or real(*a, **k))
    for config in (CompressionConfig(budget=8), CompressionConfig(budget=1.0), CompressionConfig(budget=0.5, kv_bits=4)):
        cache = make_cache(model, config, max_length=10)
        prompt_tokens = encode_prompt(tokenizer, SHORT, False).shape[1]
        with pytest.raises(InputError, match=rf"prompt of {prompt_tokens} tokens \+ max_new_tokens=30 exceeds the "
                                             rf"cache's max_length of 10 tokens.*at most {10 - prompt_tokens}"):
            generate(model, tokenizer, SHORT, max_new_tokens=30, chat=False, cache=cache)
        assert cache.seen_tokens() == 0 and steps == []  # refused before the prefill, not after the steps
        result = generate(model, tokenizer, SHORT, max_new_tokens=10 - prompt_tokens, chat=False, cache=cache)
        assert result.new_tokens == 10 - prompt_tokens  # what fits still runs
        assert steps or result.new_tokens <= 1  # the counted loop is the one generate decodes through
        steps.clear()


def test_a_prefill_beyond_max_length_is_refused(lm):
    model, tokenizer = lm
    cache = make_cache(model, CompressionConfig(budget=8), max_length=10)
    with pytest.raises(InputError, match="exceeds the cache's max_length of 10"):
        generate(model, tokenizer, TEXT, max_new_tokens=2, chat=False, cache=cache)
    with torch.no_grad(), pytest.raises(InputError, match="brings the cache to 20 tokens .* max_length=10"):
        model(input_ids=torch.randint(0, 128, (1, 20)), past_key_values=cache)
    assert cache.seen_tokens() == 0


# 2. a cache filled by one model, used by another of the same shapes


def test_a_cache_of_another_model_with_the_same_shapes_is_refused(lm):
    model, tokenizer = lm
    other = tiny_llama(seed=5)  # same architecture and shapes, other weights
    make_cache(other)  # switched to the h2o_compress attention too: only the fingerprint tells them apart
    cache = make_cache(model, CompressionConfig(budget=16))
    with torch.inference_mode():
        prefill(model, encode_prompt(tokenizer, TEXT, False), cache)
    held = cache.seen_tokens()
    with pytest.raises(CacheStateError, match="belongs to another model"):
        generate(other, tokenizer, TEXT + " And", max_new_tokens=3, chat=False, cache=cache)
    with torch.inference_mode(), pytest.raises(CacheStateError, match="belongs to another model"):
        prefill(other, encode_prompt(tokenizer, TEXT + " And", False), cache)
    assert cache.seen_tokens() == held  # nothing was fed
    fresh = make_cache(model, CompressionConfig(budget=16))
    with pytest.raises(CacheStateError, match="belongs to another model"):
        generate(other, tokenizer, TEXT, max_new_tokens=3, chat=False, cache=fresh)
    assert fresh.seen_tokens() == 0
    generate(model, tokenizer, TEXT + " And", max_new_tokens=3, chat=False, cache=cache)  # its own model continues


# 3. ask() / generate() with something that is not a CompressedCache


@pytest.mark.parametrize("bad", [None, "cache", 3])
def test_ask_and_generate_refuse_what_is_not_a_compressed_cache(lm, bad):
    model, tokenizer = lm
    with pytest.raises(CacheStateError, match=r"context\.cache=.* holds no compressed context"):
        ask(model, tokenizer, CompressedContext(bad, "A context."), "A question?", max_new_tokens=2)
    with pytest.raises(CacheStateError, match="is not a CompressedCache"):
        generate(model, tokenizer, SHORT, max_new_tokens=2, chat=False, cache=bad if bad is not None else "x")
    with pytest.raises(CacheStateError, match=r"needs a CompressedContext .*not context="):
        ask(model, tokenizer, bad, "A question?", max_new_tokens=2)


# 4. a crafted file asking for a capacity of tens of millions of tokens


def _crafted(path, model, config, max_length, huge, tmp_path):
    cache = make_cache(model, config, max_length=max_length)
    with torch.no_grad():
        prefill(model, torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0)), cache)
    save_cache(cache, tmp_path / "honest.safetensors", model=model)
    metadata, tensors = read_cache_file(tmp_path / "honest.safetensors")
    layers = json.loads(metadata["layers"])
    for layer in layers:
        layer["capacity"] = None if layer["capacity"] is None else huge
        layer["max_tokens"] = None if layer["max_tokens"] is None else huge
    metadata["layers"] = json.dumps(layers)
    if json.loads(metadata["capacity"]) is not None:
        metadata["capacity"] = json.dumps(huge)
        fields = json.loads(metadata["config"])
        if fields["budget"] > 1:
            fields["budget"] = huge
        metadata["config"] = json.dumps(fields, sort_keys=True)
    metadata = {k: v for k, v in metadata.items() if k != "checksum"}
    metadata["checksum"] = _checksum(metadata, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("huge", [30_000_000, 100_000_000])
@pytest.mark.parametrize("config", [CompressionConfig(budget=10, kv_bits=4, residual=2), CompressionConfig(budget=1.0),
                                    CompressionConfig(budget=0.5, kv_bits=8, head_budgets="adaptive")],
                         ids=["bounded-int4", "unbounded-max-tokens", "adaptive-int8"])
def test_a_file_asking_for_a_huge_capacity_is_refused_before_allocating(tmp_path, monkeypatch, config, huge):
    model = tiny_llama()
    path = _crafted(tmp_path / "huge.safetensors", model, config, 40, huge, tmp_path)
    allocated = []
    real = CompressedLayer.lazy_initialization

    def watched(self, key_states, value_states):
        if key_states.device.type != "meta":  # real buffers: the file's sizes must have been checked by now
            allocated.append(self.store.slots if getattr(self, "store", None) else self.setting.slots_per_head())
            raise AssertionError(f"allocated {allocated[-1]} slots before the sizes were checked")
        return real(self, key_states, value_states)

    monkeypatch.setattr(CompressedLayer, "lazy_initialization", watched)
    start = time.perf_counter()
    with pytest.raises(CacheFileError, match=r"layer 0 .*implies .*allowed: the sizes of the saved tensors"):
        load_cache(path, model)
    assert allocated == [] and time.perf_counter() - start < 5


# 5. a temporary file left by a save killed outright (SIGKILL)


@pytest.mark.skipif(os.name != "posix", reason="flock")
def test_the_next_save_removes_only_that_targets_orphaned_partial_files(tmp_path):
    import fcntl

    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=8))
    with torch.no_grad():
        prefill(model, torch.randint(0, 128, (1, 10)), cache)
    target = tmp_path / "a.safetensors"
    orphan = tmp_path / ".a.safetensors.abc123.partial"
    orphan.write_bytes(b"half a cache")
    outside = tmp_path / "elsewhere"
    outside.write_text("keep me")
    keep = [tmp_path / ".b.safetensors.x.partial", tmp_path / "a.safetensors.abc.partial",
            tmp_path / ".a.safetensors.abc123.partial.bak", tmp_path / ".a.safetensors..partial"]
    for path in keep:
        path.write_bytes(b"not ours to remove")
    link = tmp_path / ".a.safetensors.link99.partial"
    link.symlink_to(outside)
    folder = tmp_path / ".a.safetensors.dir1.partial"
    folder.mkdir()
    live = tmp_path / ".a.safetensors.live42.partial"  # a save in progress holds its lock
    live.write_bytes(b"being written")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        save_cache(cache, target, model=model)
    assert not orphan.exists()
    assert all(path.exists() for path in keep) and link.is_symlink() and outside.read_text() == "keep me"
    assert folder.is_dir() and live.exists()
    load_cache(target, model)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".partial") and "a.safetensors" in p.name
                  and p.name.startswith(".a.")) == sorted([link.name, folder.name, live.name, keep[3].name])


# 6. a loaded prompt cache whose prompt is not the start of the new one


def test_a_loaded_prompt_cache_of_another_text_is_refused(lm, tmp_path):
    model, tokenizer = lm
    path = tmp_path / "prompt.safetensors"
    config = CompressionConfig(budget=16, kv_bits=8)
    prepare_prompt_cache(model, tokenizer, TEXT, config, 4, chat=False, save=path)
    for other in ("Call me Ishmael. Some years ago, never mind how long precisely.",  # another text
                  TEXT.replace("thirteen", "twelve, said Winston")):  # the same start, then another text
        with pytest.raises(InputError, match="does not start with the .* tokens the cache holds"):
            prepare_prompt_cache(model, tokenizer, other, None, 4, chat=False, load=path)
    cache = prepare_prompt_cache(model, tokenizer, TEXT + " He walked on.", None, 4, chat=False, load=path)
    assert cache.seen_tokens() == encode_prompt(tokenizer, TEXT + " He walked on.", False).shape[1]
