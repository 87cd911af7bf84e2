"""Hostile cache files (hypothesis): a saved cache file is mutated (metadata fields removed, retyped or set to odd
values; tensors dropped, added, reshaped, retyped or given bad values) and re-checksummed, so only the structural
and invariant checks stand between it and the cache. Loading must end in an ``H2OCompressError`` or give a cache
that passes every invariant and decodes finite logits: never a traceback from inside torch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from helpers.strategies import fuzz

from h2o_compress.persistence import save_cache, load_cache
from h2o_compress import CompressionConfig, H2OCompressError, make_cache
from h2o_compress.persistence.file_format import _checksum, read_cache_file

MODEL = tiny_llama()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "cache.safetensors"
    cache = make_cache(MODEL, CompressionConfig(budget=10, kv_bits=4, residual=2, sink_tokens=1), max_length=40)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from h2o_compress.runtime.prefill import prefill

        prefill(MODEL, ids, cache)
        save_cache(cache, path, model=MODEL)
    return read_cache_file(path)


ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(
        ["drop-meta", "odd-meta", "odd-layer-field", "drop-layer-field", "drop-tensor", "extra-tensor",
         "reshape", "retype", "values"]
    ))
    return kind, draw(st.integers(0, 10**6)), draw(ODD_VALUES), draw(st.floats(-1e3, 1e3) | st.just(float("nan")))


def mutate(metadata: dict, tensors: dict, mutation) -> None:
    kind, pick, odd, number = mutation
    names = sorted(tensors)
    name = names[pick % len(names)]
    keys = sorted(k for k in metadata if k != "checksum")
    if kind == "drop-meta":
        metadata.pop(keys[pick % len(keys)])
    elif kind == "odd-meta":
        metadata[keys[pick % len(keys)]] = json.dumps(odd)
    elif kind in ("odd-layer-field", "drop-layer-field"):
        layers = json.loads(metadata["layers"])
        layer = layers[pick % len(layers)]
        field = sorted(layer)[pick % len(layer)]
        if kind == "drop-layer-field":
            layer.pop(field)
        else:
            layer[field] = odd
        metadata["layers"] = json.dumps(layers)
    elif kind == "drop-tensor":
        tensors.pop(name)
    elif kind == "extra-tensor":
        tensors[f"layers.0.extra{pick % 3}"] = torch.zeros(2)
    elif kind == "reshape":
        t = tensors[name]
        tensors[name] = t.reshape(-1)[: max(t.numel() - 1, 0)].clone() if pick % 2 else torch.cat((t.reshape(-1), t.reshape(-1)))
    elif kind == "retype":
        tensors[name] = tensors[name].to([torch.float16, torch.int32, torch.uint8, torch.float64][pick % 4])
    else:  # values
        t = tensors[name].clone()
        flat = t.reshape(-1)
        if flat.numel():
            index = pick % flat.numel()
            value = number if t.is_floating_point() else int(number) if number == number else -5
            flat[index] = torch.tensor(value).to(t.dtype)  # integer dtypes wrap, as a hostile byte would
        tensors[name] = t


@fuzz(60)
@given(mutation=mutations())
def test_hostile_cache_files_load_cleanly_or_not_at_all(saved, tmp_path_factory, mutation):
    metadata, tensors = dict(saved[0]), {k: v.clone() for k, v in saved[1].items()}
    mutate(metadata, tensors, mutation)
    metadata = {k: v for k, v in metadata.items() if k != "checksum"}
    metadata["checksum"] = _checksum(metadata, tensors)
    path = tmp_path_factory.mktemp("hostile") / "cache.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    try:
        cache = load_cache(path, MODEL)
    except H2OCompressError:
        return
    cache.check()
    token = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        logits = MODEL(input_ids=token, past_key_values=cache).logits
    assert torch.isfinite(logits).all()
    cache.check()
    for layer in cache.layers:
        assert layer.kept_length() <= layer.setting.capacity
