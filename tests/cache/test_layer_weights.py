"""Per-layer budget weights (``layer_budgets=[w_0, ...]`` or ``--layer-budgets FILE``): each layer gets its weight's
share of the uniform total (the same tokens, counted by the planner to the byte), and bad weights are refused by
name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_MODELS
from helpers.tiny_lm import save_tiny_lm, tiny_lm
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, ConfigError, make_cache
from h2o_compress.cli import app
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes


def test_each_layer_gets_its_weights_share_of_the_uniform_total(tmp_path):
    config = CompressionConfig(policy="h2o", budget=0.1, heavy_ratio=0.5, layer_budgets=[1] * 15 + [3] * 15)
    assert config.layer_budgets == (1.0,) * 15 + (3.0,) * 15
    assert config.layer_capacities(52, 30) == [26] * 15 + [78] * 15
    path = tmp_path / "weights.json"
    path.write_text(json.dumps({"weights": [2, 1, 1]}))
    from_file = CompressionConfig(policy="tova", budget=0.1, layer_budgets=str(path))
    assert from_file.layer_budgets == (2.0, 1.0, 1.0)
    assert from_file.layer_capacities(10, 3) == [16, 7, 7]  # 15 / 7.5 / 7.5, the heaviest takes the rounding
    tiny = CompressionConfig(policy="h2o", budget=0.1, sink_tokens=2, layer_budgets=[100, 1, 1])
    assert tiny.layer_capacities(10, 3) == [24, 3, 3]  # the floor: the 2 sinks and a recent window of one token
    assert CompressionConfig(**json.loads(json.dumps(from_file.to_dict()))) == from_file  # survives JSON


@pytest.mark.parametrize("value, message", [
    ("missing.json", "layer_budgets='missing.json' is not supported (no such file); allowed: uniform, pyramid, global"),
    ([0, 1], "layer_budgets holds [0, 1], not per-layer weights"),
    ([], "layer_budgets holds [], not per-layer weights"),
    ([True, 1], "not per-layer weights"),
    ([1, float("nan")], "not per-layer weights"),
    ({"weights": [1]}, "not per-layer weights"),
])
def test_bad_weights_are_refused_by_name(value, message):
    with pytest.raises(ConfigError) as error:
        CompressionConfig(budget=0.1, layer_budgets=value)
    assert message in str(error.value)


def test_a_bad_file_and_the_wrong_layer_count_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"is not supported \(a directory, not a file\)"):
        CompressionConfig(budget=0.1, layer_budgets=str(tmp_path))
    path = tmp_path / "w.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        CompressionConfig(budget=0.1, layer_budgets=str(path))
    path.write_text(json.dumps({"weights": "many"}))
    with pytest.raises(ConfigError, match="holds 'many', not per-layer weights"):
        CompressionConfig(budget=0.1, layer_budgets=str(path))
    model, _ = tiny_lm()
    layers = model_dims(model.config).num_layers
    with pytest.raises(ConfigError, match=f"gives {layers + 1} layer weights but the model has {layers} layers"):
        make_cache(model, CompressionConfig(budget=0.5, layer_budgets=[1] * (layers + 1)), max_length=40)


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_weighted_layers_hold_their_capacity_in_uniforms_bytes(arch):
    """Every architecture: the cache's layers take the weighted capacities and keep that many tokens, its bytes are
    the planner's to the byte (and about uniform's: the same tokens); at budget 1.0 it equals the full cache."""
    model = TINY_MODELS[arch]()
    layers = model_dims(model.config).num_layers
    weights = [1 + 2 * (i % 2) for i in range(layers)]
    config = CompressionConfig(policy="h2o", budget=0.5, kv_bits=4, layer_budgets=weights)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = make_cache(model, config, max_length=40)
        model(input_ids=ids, past_key_values=cache)
        uniform = make_cache(model, CompressionConfig(**{**config.to_dict(), "layer_budgets": "uniform"}), max_length=40)
        model(input_ids=ids, past_key_values=uniform)
    assert cache.capacities == config.layer_capacities(20, layers) and len(set(cache.capacities)) == 2
    assert [layer.kept_length() for layer in cache.layers] == cache.capacities
    assert abs(cache.nbytes() - uniform.nbytes()) < 0.05 * uniform.nbytes()  # the same tokens (full-precision rings differ)
    planned = cache_bytes(model_dims(model.config), config, batch=1, prompt_len=40, max_length=40,
                          kv_dtype=torch.float32)
    assert planned.total == cache.nbytes()
    with torch.inference_mode():
        full = model(input_ids=ids, past_key_values=make_cache(model, CompressionConfig(policy="full"))).logits
        ours = model(input_ids=ids, past_key_values=make_cache(
            model, CompressionConfig(policy="h2o", budget=1.0, layer_budgets=weights), max_length=40)).logits
    torch.testing.assert_close(ours, full, atol=1e-5, rtol=1e-5)


def test_cli_takes_a_weights_file(tmp_path):
    model_dir = save_tiny_lm(tmp_path / "model")
    layers = json.loads((tmp_path / "model" / "config.json").read_text())["num_hidden_layers"]
    weights = tmp_path / "layers.json"
    weights.write_text(json.dumps([3] + [1] * (layers - 1)))
    flags = ["--model", model_dir, "--policy", "h2o", "--budget", "0.25", "--layer-budgets", str(weights)]
    result = CliRunner().invoke(app, ["eval", "perplexity", *flags, "--max-tokens", "40", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["layer_budgets"] == [3.0] + [1.0] * (layers - 1)
    refused = CliRunner().invoke(app, ["eval", "perplexity", *flags[:-1], str(tmp_path / "nope.json")])
    assert refused.exit_code == 2 and "no such file" in refused.output
