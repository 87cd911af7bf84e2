"""Budgets spread over the layers under the same total (``layer_budgets="pyramid"``, PyramidKV)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from h2o_compress.persistence import load_cache, save_cache
from h2o_compress import CompressionConfig, ConfigError, make_cache
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes


@pytest.mark.parametrize("capacity,layers", [(20, 30), (64, 4), (7, 12), (100, 2)])
@pytest.mark.parametrize("policy", ["h2o", "sink", "local", "tova"])
def test_pyramid_keeps_the_total_and_slopes_down(capacity, layers, policy):
    config = CompressionConfig(policy=policy, budget=capacity, layer_budgets="pyramid")
    caps = config.layer_capacities(capacity, layers)
    assert sum(caps) == capacity * layers
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-1]
    assert all(config.layer_capacities(c, 1) == [c] for c in caps)
    from h2o_compress.policies import make_policy

    rule = make_policy(policy, config.heavy_ratio, config.sinks)
    assert all(rule.recent_window(c) >= 1 for c in caps)  # every layer keeps a recent window


def test_uniform_and_unbounded_are_unchanged():
    assert CompressionConfig(budget=20).layer_capacities(20, 5) == [20] * 5
    assert CompressionConfig(layer_budgets="pyramid").layer_capacities(None, 5) == [None] * 5
    with pytest.raises(ConfigError, match="layer_budgets='cone'"):
        CompressionConfig(layer_budgets="cone")


def test_pyramid_cache_holds_each_layer_budget_and_frees_the_memory():
    model = tiny_llama(layers=4)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(0))
    caches = {}
    for budgets in ("uniform", "pyramid"):
        config = CompressionConfig(budget=0.25, kv_bits=4, layer_budgets=budgets)
        cache = caches[budgets] = make_cache(model, config, max_length=100)
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache)
            for i in range(20):
                model(input_ids=ids[:, i : i + 1], past_key_values=cache)
        cache.check()
        assert [cache.kept_length(i) for i in range(4)] == cache.capacities
        dims = model_dims(model.config)
        predicted = cache_bytes(dims, config, batch=1, prompt_len=80, decode_steps=20, max_length=100,
                                kv_dtype=torch.float32)
        assert predicted.total == cache.nbytes()  # the planner counts each layer's own storage
        assert cache.storage_nbytes() == cache.nbytes()
    pyramid, uniform = caches["pyramid"], caches["uniform"]
    assert pyramid.capacities[0] > uniform.capacities[0] > pyramid.capacities[-1]
    assert sum(pyramid.capacities) == sum(uniform.capacities) == 4 * 25
    first, last = pyramid.layers[0].nbytes(), pyramid.layers[-1].nbytes()
    assert last < uniform.layers[-1].nbytes() < first  # the small layers really hold less
    assert abs(pyramid.nbytes() - uniform.nbytes()) <= 0.05 * uniform.nbytes()  # same total bytes


def test_pyramid_cache_saves_and_loads(tmp_path):
    model = tiny_llama(layers=4)
    config = CompressionConfig(budget=0.25, kv_bits=4, layer_budgets="pyramid")
    cache = make_cache(model, config, max_length=100)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors", model)
    assert loaded.capacities == cache.capacities and loaded.capacity == cache.capacity == 25
    for mine, theirs in zip(cache.layers, loaded.layers):
        assert torch.equal(mine.positions(), theirs.positions())
