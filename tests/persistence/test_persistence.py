"""Persisted compressed caches: exact round trip, same continuation as the live cache, refusal of another model
or config, detection of truncated / tampered files, atomic writes, and the CLI's --save-cache / --load-cache."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_llama
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from helpers.strategies import cached_llama, configs, fuzz, llama_shapes
from typer.testing import CliRunner

from h2o_compress.persistence import load_cache
from h2o_compress import CompressedCache, CompressionConfig, make_cache
from h2o_compress.attention import withdraw
from h2o_compress.cache import build_layers
from h2o_compress.cli import app
from h2o_compress.utils.errors import CacheFileError, CacheStateError, ConfigError, InputError
from h2o_compress.models.identity import model_fingerprint
from h2o_compress.persistence import read_cache_file, save_cache
from h2o_compress.runtime.prefill import prefill

CONFIGS = {
    "16bit-full": CompressionConfig(),
    "h2o-int4": CompressionConfig(budget=10, kv_bits=4, residual=2),
    "local-k8-v4-nf4": CompressionConfig(policy="local", budget=12, k_bits=8, v_bits=4, quant="nf4"),
    "sink-int8-blockwise": CompressionConfig(policy="sink", budget=12, kv_bits=8, quant="int8-blockwise"),
    "h2o-fraction-int8-norotate": CompressionConfig(budget=0.5, kv_bits=8, rotate=False, residual=3),
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def prompt_ids(batch=2, length=20, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model, cache, logits, steps):
    """``steps`` greedy tokens from ``logits`` ``[batch, vocab]``; returns (tokens ``[batch, steps]``, logits list)."""
    tokens, seen = [], []
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        seen.append(logits)
    return torch.cat(tokens, 1) if tokens else torch.empty(logits.shape[0], 0, dtype=torch.long), seen


def layer_state(cache):
    """Every tensor and counter the cache holds, for exact comparison."""
    state = []
    for layer in cache.layers:
        state.append({k: v.clone() for k, v in layer.tensors().items()})
        state.append((int(layer.counters.seen), layer.setting.capacity, layer.setting.residual, layer.geometry.dtype, layer.geometry.residual_dtype))
    return state


def assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_round_trip_is_exact_and_continues_identically(model, tmp_path, name):
    config = CONFIGS[name]
    cache = make_cache(model, config, max_length=40)
    ids = prompt_ids()
    logits = prefill(model, ids, cache)
    greedy(model, cache, logits, 3)  # some decode steps: quantized blocks, evictions, grown scores
    path = tmp_path / "cache.safetensors"
    save_cache(cache, path, model=model)
    loaded = load_cache(path, model)
    assert loaded.config == config
    assert loaded.capacity == cache.capacity
    assert loaded.get_seq_length() == cache.get_seq_length() == 23
    assert loaded.nbytes() == cache.nbytes()
    assert_same_state(layer_state(loaded), layer_state(cache))
    nxt = torch.randint(0, 128, (2, 1))
    live = model(input_ids=nxt, past_key_values=cache).logits[:, -1]
    resumed = model(input_ids=nxt, past_key_values=loaded).logits[:, -1]
    assert torch.equal(live, resumed)
    assert torch.equal(greedy(model, cache, live, 5)[0], greedy(model, loaded, resumed, 5)[0])
    assert_same_state(layer_state(loaded), layer_state(cache))


@st.composite
def persisted_cases(draw):
    head_dim = draw(st.sampled_from([32, 64]))
    budget = draw(st.one_of(st.sampled_from([0.2, 0.5, 1.0]), st.integers(1, 24)))
    return dict(
        config=CompressionConfig(budget=budget, **draw(configs(head_dim))),
        model=draw(llama_shapes(head_dim)),
        batch=draw(st.integers(1, 3)),
        prompt=draw(st.integers(1, 24)),
        steps_before=draw(st.integers(0, 6)),
        seed=draw(st.integers(0, 2**16)),
    )


@fuzz(10)
@given(case=persisted_cases())
@torch.no_grad()
def test_round_trip_for_random_configs_and_shapes(tmp_path_factory, case):
    model = cached_llama(*case["model"])
    ids = prompt_ids(case["batch"], case["prompt"], case["seed"])
    cache = make_cache(model, case["config"], max_length=case["prompt"] + case["steps_before"] + 4)
    logits = prefill(model, ids, cache)
    greedy(model, cache, logits, case["steps_before"])
    path = tmp_path_factory.mktemp("fuzz") / "cache.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path, model, config=case["config"])
    assert_same_state(layer_state(loaded), layer_state(cache))
    token = torch.randint(0, 128, (case["batch"], 1), generator=torch.Generator().manual_seed(case["seed"]))
    live, _ = greedy(model, cache, model(input_ids=token, past_key_values=cache).logits[:, -1], 3)
    resumed, _ = greedy(model, loaded, model(input_ids=token, past_key_values=loaded).logits[:, -1], 3)
    assert torch.equal(live, resumed)
    assert_same_state(layer_state(loaded), layer_state(cache))


@torch.no_grad()
def test_left_padded_batch_round_trip(model, tmp_path):
    config = CompressionConfig(budget=18, kv_bits=4, residual=2, sink_tokens=2)  # pads survive the prefill
    ids, mask = prompt_ids(batch=3, length=16), torch.ones(3, 16, dtype=torch.long)
    mask[0, :5], mask[2, :2] = 0, 0
    cache = make_cache(model, config)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.layers[0].counters.first_real.tolist() == [5, 0, 2]  # padding is never held: sinks count from here
    save_cache(cache, tmp_path / "padded.safetensors", model=model)
    loaded = load_cache(tmp_path / "padded.safetensors", model)
    assert_same_state(layer_state(loaded), layer_state(cache))
    token = torch.randint(0, 128, (3, 1))
    for step in range(8):  # evictions with pads held
        mask = torch.cat((mask, torch.ones(3, 1, dtype=torch.long)), 1)
        live = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1]
        resumed = model(input_ids=token, attention_mask=mask, past_key_values=loaded).logits[:, -1]
        assert torch.equal(live, resumed), step
        token = live.argmax(-1, keepdim=True)


def test_every_layer_tensor_is_persisted(model):
    """Tripwire: a tensor the core adds to CompressedLayer must be saved (or declared derived) in persistence."""
    from h2o_compress.persistence import DERIVED_LAYER_TENSORS

    cache = make_cache(model, CompressionConfig(budget=16, kv_bits=4, residual=1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        model(input_ids=prompt_ids(length=12), attention_mask=mask, past_key_values=cache)
    layer = cache.layers[0]
    holders = [vars(layer), vars(layer.store), vars(layer.ring), vars(layer.counters), vars(layer.geometry),
               vars(layer.backend)]
    held = {id(v) for holder in holders for v in holder.values() if isinstance(v, torch.Tensor)}
    held |= {id(t) for holder in (layer.store.keys, layer.store.values) for t in holder.parts.values()}
    declared = {id(t) for t in layer.tensors().values()}
    derived = {id(getattr(layer.geometry, name)) for name in DERIVED_LAYER_TENSORS}
    transient = {id(getattr(layer.backend, "valid", None))}
    assert held - declared - derived - transient == set()
    assert {"store.positions", "store.scores", "ring.keys", "ring.positions", "first_real", "seen"} <= set(layer.tensors())


@torch.no_grad()
def test_saved_prompt_cache_gives_the_live_continuation(model, tmp_path):
    config = CompressionConfig(budget=0.4, kv_bits=4, residual=2)
    ids = prompt_ids(batch=1, length=24, seed=3)
    live_cache = make_cache(model, config, max_length=24 + 12)
    live_logits = prefill(model, ids, live_cache)
    path = save_cache(live_cache, tmp_path / "prompt.safetensors")  # prefill recorded the model fingerprint
    live_tokens, _ = greedy(model, live_cache, live_logits, 12)

    loaded = load_cache(path, model)
    assert torch.equal(loaded.prompt_state.token_ids, ids)
    logits = prefill(model, ids, loaded)  # the whole prompt is cached: no forward pass, stored logits
    assert loaded.get_seq_length() == 24
    assert torch.equal(logits, live_logits)
    assert torch.equal(greedy(model, loaded, logits, 12)[0], live_tokens)


@torch.no_grad()
def test_loaded_prompt_cache_extends_to_a_longer_prompt(model, tmp_path):
    config = CompressionConfig(budget=16, kv_bits=8, residual=2)
    prefix, full = prompt_ids(batch=2, length=12, seed=4), None
    full = torch.cat((prefix, prompt_ids(batch=2, length=7, seed=5)), 1)
    live = make_cache(model, config)
    prefill(model, prefix, live)
    save_cache(live, tmp_path / "prefix.safetensors")
    live_logits = prefill(model, full, live)  # feeds only the 7 new tokens
    loaded = load_cache(tmp_path / "prefix.safetensors", model)
    assert torch.equal(prefill(model, full, loaded), live_logits)
    assert loaded.get_seq_length() == 19
    assert_same_state(layer_state(loaded), layer_state(live))


@torch.no_grad()
def test_prompt_that_does_not_extend_the_cached_one_is_refused(model, tmp_path):
    cache = make_cache(model, CompressionConfig(budget=8))
    ids = prompt_ids(batch=1, length=10)
    prefill(model, ids, cache)
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % 128
    with pytest.raises(InputError, match="does not start with the 10 tokens the cache holds"):
        prefill(model, other, cache)
    with pytest.raises(InputError, match="does not start with"):
        prefill(model, ids[:, :5], cache)  # shorter than what the cache holds
    assert cache.get_seq_length() == 10  # nothing was fed


@torch.no_grad()
def test_cache_without_prompt_ids_cannot_be_prefilled(model):
    cache = make_cache(model)
    model(input_ids=prompt_ids(batch=1, length=5), past_key_values=cache)
    with pytest.raises(CacheStateError, match="holds 5 tokens but not their ids"):
        prefill(model, prompt_ids(batch=1, length=8), cache)


@torch.no_grad()
def saved_file(model, tmp_path, config=None, name="cache.safetensors"):
    cache = make_cache(model, config or CompressionConfig(budget=10, kv_bits=4, residual=2))
    prefill(model, prompt_ids(), cache)
    return save_cache(cache, tmp_path / name)


def test_loading_into_another_model_is_refused(model, tmp_path):
    path = saved_file(model, tmp_path)
    same_shape_other_weights = tiny_llama(seed=1)
    with pytest.raises(CacheStateError, match="was saved for model 'llama:2x2x32'.*not this one"):
        load_cache(path, same_shape_other_weights)
    with pytest.raises(CacheStateError, match="not this one \\(llama:2x4x32"):
        load_cache(path, tiny_llama(seed=0, kv_heads=4))
    for seed in (0, 1):  # the same weights or others (the fingerprint cannot tell), in another dtype
        with pytest.raises(CacheStateError, match=r"was saved from 'llama:2x2x32' in float32, and this model is "
                           r"float16 \(the fingerprints differ\); allowed: the model that saved it, in the dtype it "
                           r"was saved with \(--dtype float32"):
            load_cache(path, tiny_llama(seed=seed).to(torch.float16))


def test_loading_with_another_config_is_refused(model, tmp_path):
    path = saved_file(model, tmp_path)
    with pytest.raises(CacheStateError, match=r"different config: budget=20 \(file: 10\)"):
        load_cache(path, model, config=CompressionConfig(budget=20, kv_bits=4, residual=2))
    with pytest.raises(CacheStateError, match=r"kv_bits=8 \(file: 4\)"):
        load_cache(path, model, config={"kv_bits": 8})
    with pytest.raises(ConfigError, match="unknown config field"):
        load_cache(path, model, config={"bits": 8})
    assert load_cache(path, model, config={"kv_bits": 4, "budget": 10}).config.kv_bits == 4


def test_fingerprint_is_stable_and_discriminating(model):
    base = model_fingerprint(model)
    assert model_fingerprint(tiny_llama(seed=0)) == base  # same weights, another object
    make_cache(model)  # switching the attention implementation does not change the model
    assert model_fingerprint(model) == base
    assert model_fingerprint(tiny_llama(seed=1)) != base
    assert model_fingerprint(tiny_llama(seed=0, head_dim=64)) != base
    assert model_fingerprint(tiny_llama(seed=0).to(torch.bfloat16)) != base


def test_missing_or_not_a_cache_file(model, tmp_path):
    with pytest.raises(CacheFileError, match="does not exist"):
        load_cache(tmp_path / "nope.safetensors", model)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(300))
    with pytest.raises(CacheFileError, match="truncated or not a safetensors file"):
        load_cache(junk, model)
    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(3)}, str(other))
    with pytest.raises(CacheFileError, match="is not an h2o-compress cache file"):
        load_cache(other, model)


@pytest.mark.parametrize("cut", [1, 100, 2000])
def test_truncated_file_is_detected(model, tmp_path, cut):
    path = saved_file(model, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut])
    with pytest.raises(CacheFileError, match="truncated"):
        load_cache(path, model)


def rewrite(path, edit_metadata=None, edit_tensors=None):
    """Rewrite a saved file with edited metadata / tensors, keeping the stored checksum."""
    with safe_open(str(path), "pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    (edit_metadata or (lambda m: None))(metadata)
    (edit_tensors or (lambda t: None))(tensors)
    save_file(tensors, str(path), metadata=metadata)


def test_tampered_data_is_detected(model, tmp_path):
    path = saved_file(model, tmp_path)
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    raw[8 + header + 50] ^= 0x01  # one bit of tensor data
    path.write_bytes(bytes(raw))
    with pytest.raises(CacheFileError, match="fails its checksum"):
        load_cache(path, model)


@pytest.mark.parametrize(
    "edit_metadata,edit_tensors",
    [
        (lambda m: m.update(tokens="21"), None),
        (lambda m: m.update(config=m["config"].replace('"budget": 10', '"budget": 11')), None),
        (None, lambda t: t["layers.0.store.scores"].mul_(2)),
        (None, lambda t: t.pop("layers.1.ring.values")),
    ],
    ids=["token-count", "config", "scores", "missing-tensor"],
)
def test_edited_file_is_detected(model, tmp_path, edit_metadata, edit_tensors):
    path = saved_file(model, tmp_path)
    rewrite(path, edit_metadata, edit_tensors)
    with pytest.raises(CacheFileError, match="fails its checksum"):
        load_cache(path, model)


def test_unknown_format_version_is_refused(model, tmp_path):
    path = saved_file(model, tmp_path)
    rewrite(path, lambda m: m.update(format_version="99"))
    with pytest.raises(CacheFileError, match="format version '99'; allowed: 3"):
        load_cache(path, model)


def test_file_records_metadata(model, tmp_path):
    path = saved_file(model, tmp_path, CompressionConfig(budget=10, kv_bits=4, residual=2))
    metadata, tensors = read_cache_file(path)
    assert metadata["format_version"] == "3"
    assert metadata["tokens"] == "20"
    assert metadata["model_fingerprint"] == model_fingerprint(model)
    assert json.loads(metadata["config"]) == CompressionConfig(budget=10, kv_bits=4, residual=2).to_dict()
    assert json.loads(metadata["capacity"]) == 10
    assert tensors["prompt.token_ids"].shape == (2, 20)
    assert tensors["layers.0.store.keys.data"].dtype == torch.uint8  # stored compressed, not dequantized


def test_interrupted_save_keeps_the_old_file(model, tmp_path, monkeypatch):
    path = saved_file(model, tmp_path)
    before = path.read_bytes()
    from h2o_compress.persistence import file_format

    real_save = file_format.save_file

    def save_then_die(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as handle:
            handle.truncate(os.path.getsize(filename) // 2)  # half written when the process is interrupted
        raise KeyboardInterrupt

    monkeypatch.setattr(file_format, "save_file", save_then_die)
    cache = make_cache(model, CompressionConfig(budget=6))
    prefill(model, prompt_ids(batch=1, length=9), cache)
    with pytest.raises(KeyboardInterrupt):
        save_cache(cache, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left behind
    load_cache(path, model)


def test_failed_rename_leaves_no_partial_file(model, tmp_path, monkeypatch):
    target = tmp_path / "new.safetensors"
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(CacheFileError, match="cannot write cache file .*disk full"):  # one line, no traceback
        saved_file(model, tmp_path, name="new.safetensors")
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_unsaveable_caches_are_refused(model, tmp_path):
    with pytest.raises(CacheStateError, match="empty cache"):
        save_cache(make_cache(model), tmp_path / "a", model=model)
    with pytest.raises(CacheStateError, match="allowed: a CompressedCache"):
        save_cache(object(), tmp_path / "a", model=model)
    cache = CompressedCache(build_layers(CompressionConfig(), 2, 32, None), CompressionConfig())  # built by hand
    with torch.no_grad():
        model(input_ids=prompt_ids(batch=1, length=4), past_key_values=cache)
    with pytest.raises(CacheStateError, match="pass model="):
        save_cache(cache, tmp_path / "a")  # no fingerprint recorded and no model given
    with pytest.raises(CacheFileError, match="does not exist; allowed: a path in an existing directory"):
        save_cache(cache, tmp_path / "missing-dir" / "a", model=model)
    with pytest.raises(CacheFileError, match="cache path 3 is of type int; allowed: a file path"):
        save_cache(cache, 3, model=model)
    cache.model_fingerprint = model_fingerprint(model)
    with pytest.raises(CacheStateError, match="model= is not the model this cache was filled with"):
        save_cache(cache, tmp_path / "a", model=tiny_llama(seed=2))
    layer = cache.layers[1]
    layer.update(torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32))  # mid-step: attention has not run yet
    with pytest.raises(CacheStateError, match="middle of a forward pass"):
        save_cache(cache, tmp_path / "a", model=model)
    withdraw(1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("max_length", [None, 8])
@torch.no_grad()
def test_save_without_model_after_make_cache(model, tmp_path, max_length):
    """The forward pass records the model's fingerprint, so ``save_cache`` needs no ``model``; the file loads back
    for that model as the same cache and continues as the live one."""
    cache = make_cache(model, max_length=max_length)
    model(input_ids=prompt_ids(batch=1, length=4), past_key_values=cache)
    path = save_cache(cache, tmp_path / "a.safetensors")
    loaded = load_cache(path, model)
    assert loaded.get_seq_length() == cache.get_seq_length() == 4
    for mine, theirs in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(mine.positions(), theirs.positions())
        assert mine.tensors().keys() == theirs.tensors().keys()
        assert all(torch.equal(t, theirs.tensors()[name]) for name, t in mine.tensors().items())
    token = prompt_ids(batch=1, length=1, seed=1)
    torch.testing.assert_close(model(input_ids=token, past_key_values=loaded).logits,
                               model(input_ids=token, past_key_values=cache).logits, atol=0, rtol=0)


# -- CLI ---------------------------------------------------------------------------------------------------
runner = CliRunner()
WORDS = " ".join(f"w{i}" for i in range(3, 40, 2))


def cli(*args):
    return runner.invoke(app, ["generate", "--no-chat", "--device", "cpu", *args])


def test_cli_saved_cache_gives_the_live_text(tiny_model_dir, tmp_path):
    # h2o: a saved prompt is prefilled chunk by chunk (so that a follow-up prompt can extend it), where the
    # commands' default reads a live prompt whole
    flags = ["--model", tiny_model_dir, "--policy", "h2o", "--budget", "0.5", "--kv-bits", "4", "--max-new-tokens",
             "10", "--json"]
    live = cli(*flags, WORDS)
    assert live.exit_code == 0, live.output
    saved = cli(*flags, "--save-cache", str(tmp_path / "p.safetensors"), WORDS)
    assert saved.exit_code == 0, saved.output
    loaded = cli("--model", tiny_model_dir, "--max-new-tokens", "10", "--json", "--load-cache",
                 str(tmp_path / "p.safetensors"), WORDS)
    assert loaded.exit_code == 0, loaded.output
    texts = [json.loads(r.stdout)["text"] for r in (live, saved, loaded)]
    assert texts[0] == texts[1] == texts[2]
    assert json.loads(loaded.stdout)["config"]["kv_bits"] == 4  # the file's config applies


def test_cli_refuses_bad_cache_files(tiny_model_dir, tmp_path):
    base = ["--model", tiny_model_dir, "--max-new-tokens", "4"]
    missing = cli(*base, "--load-cache", str(tmp_path / "missing.safetensors"), WORDS)
    assert missing.exit_code == 2 and "does not exist" in missing.output
    no_dir = cli(*base, "--save-cache", str(tmp_path / "no" / "dir.safetensors"), WORDS)
    assert no_dir.exit_code == 2 and "does not exist; allowed: a path in an existing directory" in no_dir.output
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    bad = cli(*base, "--load-cache", str(junk), WORDS)
    assert bad.exit_code == 2 and "truncated or not a safetensors file" in bad.output
    for result in (missing, no_dir, bad):
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["truncated", "another-file"])
def test_cli_refuses_a_damaged_cache_file_before_loading_the_model(tiny_model_dir, tmp_path, monkeypatch, damage):
    """The header is read with the other options: a truncated cache file, or a safetensors file that is not a
    cache, is refused before the model loads (it used to load first)."""
    from safetensors.torch import save_file

    import h2o_compress.models as models

    saved = cli("--model", tiny_model_dir, "--max-new-tokens", "2", "--save-cache", str(tmp_path / "p.safetensors"),
                WORDS)
    assert saved.exit_code == 0, saved.output
    path = tmp_path / "p.safetensors"
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 100])
    else:
        save_file({"x": torch.zeros(2)}, str(path), metadata={"format": "pt"})

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    result = cli("--model", tiny_model_dir, "--max-new-tokens", "2", "--load-cache", str(path), WORDS)
    expected = "truncated or not a safetensors file" if damage == "truncated" else "is not an h2o-compress cache file"
    assert result.exit_code == 2 and expected in result.output, result.output


def test_cli_refuses_a_cache_with_other_settings(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = saved_file(model, tmp_path)  # budget 10, kv_bits 4
    other = cli("--model", tiny_model_dir, "--budget", "12", "--load-cache", str(path), WORDS)
    assert other.exit_code == 2, other.output
    assert "different config: budget=12 (file: 10)" in other.output
    another_model = tmp_path / "other-model"
    from conftest import save_tiny_model_dir

    save_tiny_model_dir(another_model, seed=7)
    wrong = cli("--model", str(another_model), "--load-cache", str(path), WORDS)
    assert wrong.exit_code == 2 and "was saved for model" in wrong.output


def test_fingerprint_of_an_offloaded_model_reads_no_meta_weights():
    """accelerate's offloading leaves meta-device placeholders in the model: they count by shape and dtype."""
    from h2o_compress.models.identity import model_fingerprint

    model = tiny_llama()
    before = model_fingerprint(model)
    model.model.layers[1].mlp.to("meta")
    after = model_fingerprint(model)
    assert len(after) == 32 and after != before


def test_cache_save_replaces_a_foreign_file_only_with_overwrite(model, tmp_path):
    from h2o_compress import CacheFileError

    cache = make_cache(model, CompressionConfig(budget=10, kv_bits=4))
    with torch.no_grad():
        model(input_ids=prompt_ids(), past_key_values=cache)
    target = tmp_path / "notes.txt"
    target.write_text("a user's file")
    with pytest.raises(CacheFileError):
        save_cache(cache, target, model=model)
    assert target.read_text() == "a user's file"
    save_cache(cache, target, model=model, overwrite=True)
    assert load_cache(target, model).seen_tokens() == 20
