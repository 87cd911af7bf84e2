"""Issue 47 (10, 11), cache files: crafted metadata (re-checksummed, as anyone can) that used to raise a RecursionError
or load silently, and caches of another model of the same shapes. Each is refused in one line (CacheFileError, or
CacheStateError for the model) naming the bad value."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import save_file

from h2o_compress import CacheFileError, CacheStateError, CompressionConfig, make_cache
from h2o_compress.persistence import load_cache, read_cache_file, save_cache
from h2o_compress.persistence.file_format import _checksum
from h2o_compress.runtime.prefill import prefill

MODEL = tiny_llama(seed=0)
IDS = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
CONFIG = CompressionConfig(budget=0.5, kv_bits=4, residual=2, min_capacity=0)


def saved_file(path, model=MODEL, config=CONFIG):
    cache = make_cache(model, config, max_length=40)
    prefill(model, IDS, cache)
    save_cache(cache, path, model=model)
    return read_cache_file(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_file(tmp_path_factory.mktemp("saved") / "cache.safetensors")


def rewrite(path, metadata: dict, tensors: dict):
    """Write ``metadata`` and ``tensors`` to ``path`` with a recomputed checksum (a deliberate edit)."""
    metadata = {k: v for k, v in metadata.items() if k != "checksum"}
    metadata["checksum"] = _checksum(metadata, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def refused(path, model=MODEL, error=CacheFileError) -> str:
    with pytest.raises(error) as caught:
        load_cache(path, model)
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("field", ["layers", "config", "capacity"])
def test_metadata_nested_50000_deep_is_refused_not_a_recursion_error(saved, tmp_path, field):
    metadata = dict(saved[0]) | {field: "[" * 50_000 + "]" * 50_000}
    message = refused(rewrite(tmp_path / "c.safetensors", metadata, saved[1]))
    assert f"metadata '{field}' is not usable JSON (nested too deeply)" in message


@pytest.mark.parametrize("tokens", ["٢٠", "２０", " 20", "2_0", "20.0"])
def test_a_token_count_in_other_than_ascii_digits_is_refused(saved, tmp_path, tokens):
    message = refused(rewrite(tmp_path / "c.safetensors", dict(saved[0]) | {"tokens": tokens}, saved[1]))
    assert f"metadata tokens={tokens!r}; allowed: a count of tokens in ASCII digits" in message


def test_infinite_numbers_anywhere_in_the_metadata_are_refused(saved, tmp_path):
    layers = json.loads(saved[0]["layers"])
    layers[0]["scale"] = float("inf")  # json.dumps writes Infinity, which json.loads reads back
    message = refused(rewrite(tmp_path / "c.safetensors", dict(saved[0]) | {"layers": json.dumps(layers)}, saved[1]))
    assert "metadata 'layers' holds Infinity, which is not a finite number" in message
    layers[0]["scale"] = 2.0  # a finite field save_cache never writes
    message = refused(rewrite(tmp_path / "c.safetensors", dict(saved[0]) | {"layers": json.dumps(layers)}, saved[1]))
    assert "layer 0 has field(s) 'scale'; allowed: batch, capacity" in message
    config = saved[0]["config"].replace('"heavy_ratio": 0.5', '"heavy_ratio": 1e400')
    message = refused(rewrite(tmp_path / "c.safetensors", dict(saved[0]) | {"config": config}, saved[1]))
    assert "metadata 'config' holds the number 1e400, which is not finite as a float" in message


def test_a_stored_scale_that_overflows_the_models_dtype_is_refused(tmp_path):
    """A finite fp16 scale of 65504 on a 4-bit code dequantizes to Inf in an fp16 model: NaN logits from the first
    step; no live cache holds one (its scales come from finite keys)."""
    model = tiny_llama(seed=0).half()
    metadata, tensors = saved_file(tmp_path / "half.safetensors", model)
    tensors = dict(tensors) | {"layers.1.store.keys.scale_zero": tensors["layers.1.store.keys.scale_zero"].clone().fill_(65504)}
    message = refused(rewrite(tmp_path / "c.safetensors", metadata, tensors), model)
    assert "layer 1: its stored keys dequantize to NaN or Inf in float16" in message


def test_a_null_max_tokens_or_a_capacity_the_config_cannot_give_is_refused(saved, tmp_path):
    layers = json.loads(saved[0]["layers"])
    for layer in layers:
        layer["max_tokens"] = None
    message = refused(rewrite(tmp_path / "c.safetensors", dict(saved[0]) | {"layers": json.dumps(layers)}, saved[1]))
    assert "max_tokens=null with the fractional budget 0.5, which needs the length the cache was made for" in message
    config = saved[0]["config"].replace('"budget": 0.5', '"budget": 0.6')  # 0.6 x 40 keeps 24, not the file's 20
    message = refused(rewrite(tmp_path / "c.safetensors", dict(saved[0]) | {"config": config}, saved[1]))
    assert "capacity=20 but budget 0.6 of max_tokens=40 keeps more; allowed: 24 to 40" in message


def test_a_cache_made_for_one_model_and_filled_by_another_is_not_saved(tmp_path):
    other = tiny_llama(seed=1)
    cache = make_cache(MODEL, CONFIG, max_length=40)
    make_cache(other, CONFIG, max_length=40)  # the other model runs the h2o_compress attention too
    with torch.no_grad():
        other(input_ids=IDS, past_key_values=cache)  # its keys, under MODEL's fingerprint
    for model in (None, MODEL):
        with pytest.raises(CacheStateError, match="layer 0 of this cache was filled by another model than the one it "
                                                  "was made for") as caught:
            save_cache(cache, tmp_path / "c.safetensors", model=model)
        assert "\n" not in str(caught.value)
    assert not (tmp_path / "c.safetensors").exists()


def test_a_file_of_another_model_of_the_same_shapes_is_refused_even_where_the_first_and_last_values_agree(tmp_path):
    """Weights that differ everywhere but in the first and last 4 values of each parameter (what the fingerprint
    sampled before) are another model."""
    other = tiny_llama(seed=0)
    with torch.no_grad():
        for param in other.parameters():
            if param.numel() > 8:
                param.view(-1)[4:-4] += 0.5
    saved_file(tmp_path / "other.safetensors", other)
    assert "allowed: the model that saved it" in refused(tmp_path / "other.safetensors", MODEL, CacheStateError)
