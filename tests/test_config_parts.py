"""CompressionConfig composed of its parts: a few fields (the eviction, storage, layout and runtime parts, the budget,
its floor and the calibration), each part checking its own values, and every flat setting of earlier versions still
a keyword, a ``dataclasses.replace`` name, an attribute, a ``to_dict`` key (same keys, same order) and a config file
key."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError, fields, replace
from pathlib import Path

import pytest

import h2o_compress.config as config_module
from h2o_compress.attention.runtime_spec import RuntimeSpec
from h2o_compress.config import LEGACY_OPTIONS, SETTING_DEFAULTS, CompressionConfig
from h2o_compress.config_file import load_config
from h2o_compress.formats.storage import StorageSpec
from h2o_compress.layout import LayoutSpec
from h2o_compress.policies import POLICY_OPTIONS
from h2o_compress.policies.spec import EvictionSpec
from h2o_compress.utils.errors import ConfigError

#: ``CompressionConfig().to_dict()`` as the flat config of earlier versions wrote it (keys in this order).
EARLIER_DEFAULT = {
    "policy": "h2o", "budget": 1.0, "min_capacity": None, "heavy_ratio": 0.5, "sink_tokens": None, "kv_bits": 16,
    "k_bits": None, "v_bits": None, "quant": "int", "group_size": 32, "residual": 3, "rotate": True,
    "score_chunk_size": 64, "prefill_chunk_size": 512, "attention_kernel": "auto", "layer_budgets": "uniform",
    "high_bits_fraction": 0.0, "head_budgets": "uniform", "lookahead_request": None, "forgetting_factor": None,
    "evict_chat_header": False, "calibration": None, "key_offsets": "none",
}
#: (keywords given, what the flat config of earlier versions wrote for them, over `EARLIER_DEFAULT`).
EARLIER_WRITTEN = [
    ({}, {}),
    ({"policy": "h2o", "budget": 0.2, "kv_bits": 4}, {"budget": 0.2, "kv_bits": 4}),
    ({"policy": "a2sf", "budget": 0.1, "kv_bits": 4, "forgetting_factor": 0.5, "min_capacity": 0},
     {"policy": "a2sf", "budget": 0.1, "min_capacity": 0, "kv_bits": 4, "forgetting_factor": 0.5}),
    ({"policy": "lookahead", "budget": 64, "lookahead_request": "Which names?", "evict_chat_header": True,
      "layer_budgets": "global", "sink_tokens": 4, "heavy_ratio": 1.0},
     {"policy": "lookahead", "budget": 64, "heavy_ratio": 1.0, "sink_tokens": 4, "layer_budgets": "global",
      "lookahead_request": "Which names?", "evict_chat_header": True}),
    ({"policy": "snapkv", "budget": 0.25, "k_bits": 8, "v_bits": 4, "group_size": 64, "residual": 0, "rotate": False,
      "high_bits_fraction": 0.25, "head_budgets": "adaptive", "layer_budgets": [1, 2, 3]},
     {"policy": "snapkv", "budget": 0.25, "k_bits": 8, "v_bits": 4, "group_size": 64, "residual": 0, "rotate": False,
      "layer_budgets": (1.0, 2.0, 3.0), "high_bits_fraction": 0.25, "head_budgets": "adaptive"}),
    ({"policy": "sink", "budget": 100, "kv_bits": 8, "quant": "int8-blockwise", "rotate": False,
      "score_chunk_size": 16, "prefill_chunk_size": 0, "attention_kernel": "torch", "layer_budgets": "pyramid"},
     {"policy": "sink", "budget": 100, "kv_bits": 8, "quant": "int8-blockwise", "rotate": False,
      "score_chunk_size": 16, "prefill_chunk_size": 0, "attention_kernel": "torch", "layer_budgets": "pyramid"}),
    ({"policy": "h2o", "kv_bits": 4, "key_offsets": "calibrated", "calibration": "calib.json"},
     {"kv_bits": 4, "calibration": "calib.json", "key_offsets": "calibrated"}),
    ({"policy": "kvzip", "budget": 0.5, "heavy_ratio": 1.0, "sink_tokens": 4, "quant": "nf4", "kv_bits": 4},
     {"policy": "kvzip", "budget": 0.5, "heavy_ratio": 1.0, "sink_tokens": 4, "kv_bits": 4, "quant": "nf4"}),
]


def test_the_config_is_a_few_parts_and_no_policy_option_is_a_field():
    names = [f.name for f in fields(CompressionConfig)]
    assert names == ["eviction", "budget", "min_capacity", "storage", "layout", "runtime", "calibration"]
    assert not set(names) & set(POLICY_OPTIONS) and not set(names) & set(LEGACY_OPTIONS)
    assert len(Path(config_module.__file__).read_text().splitlines()) < 300


@pytest.mark.parametrize(("given", "written"), EARLIER_WRITTEN)
def test_a_dict_written_by_the_flat_config_round_trips(given, written):
    expected = EARLIER_DEFAULT | written
    config = CompressionConfig(**given)
    assert config.to_dict() == expected and list(config.to_dict()) == list(expected)  # same keys, same order
    assert CompressionConfig(**expected) == config == CompressionConfig.from_values(expected)
    as_saved = json.loads(json.dumps(expected, sort_keys=True))  # a saved cache's metadata (lists, sorted keys)
    assert CompressionConfig(**as_saved) == config and hash(CompressionConfig(**as_saved)) == hash(config)


def test_flat_keywords_fill_the_parts_and_read_back():
    config = CompressionConfig(policy="a2sf", budget=0.2, heavy_ratio=0.25, sink_tokens=2, kv_bits=4, k_bits=8,
                               group_size=64, residual=5, rotate=False, score_chunk_size=16, prefill_chunk_size=0,
                               attention_kernel="torch", layer_budgets=[1, 3], high_bits_fraction=0.5,
                               forgetting_factor=0.5)
    assert config.eviction == EvictionSpec("a2sf", 0.25, 2, {"forgetting_factor": 0.5})
    assert config.storage == StorageSpec(kv_bits=4, k_bits=8, group_size=64, residual=5, rotate=False,
                                         high_bits_fraction=0.5)
    assert config.layout == LayoutSpec(layer_budgets=(1.0, 3.0)) and config.runtime == RuntimeSpec(16, 0, "torch")
    assert (config.policy, config.heavy_ratio, config.sinks, config.forgetting_factor) == ("a2sf", 0.25, 2, 0.5)
    assert (config.kv_bits, config.key_bits, config.value_bits, config.layer_budgets) == (4, 8, 4, (1.0, 3.0))
    assert config == CompressionConfig(eviction=config.eviction, budget=0.2, storage=config.storage,
                                       layout=config.layout, runtime=config.runtime)
    assert {name: getattr(CompressionConfig(), name) for name in SETTING_DEFAULTS} == dict(SETTING_DEFAULTS)
    assert (CompressionConfig.kv_bits, CompressionConfig.residual, CompressionConfig.forgetting_factor) == (16, 3, None)


def test_replace_takes_flat_names_over_the_part_it_passes_along():
    config = CompressionConfig(policy="a2sf", budget=0.2, kv_bits=4, forgetting_factor=0.5)
    changed = replace(config, kv_bits=8, heavy_ratio=0.75, forgetting_factor=0.25, attention_kernel="torch")
    assert (changed.kv_bits, changed.heavy_ratio, changed.forgetting_factor, changed.attention_kernel) == (
        8, 0.75, 0.25, "torch")
    assert (config.kv_bits, config.heavy_ratio, config.forgetting_factor) == (4, 0.5, 0.5)  # frozen: unchanged
    assert replace(config, storage=StorageSpec(kv_bits=8)).kv_bits == 8 and replace(config) == config
    with pytest.raises(ConfigError, match="forgetting_factor is set but policy='h2o'"):
        replace(config, policy="h2o")
    with pytest.raises(FrozenInstanceError):
        config.kv_bits = 8  # type: ignore[misc]


def test_a_part_of_another_type_is_refused():
    with pytest.raises(ConfigError, match=r"storage=4 is invalid; allowed: a part of type StorageSpec"):
        CompressionConfig(storage=4)
    with pytest.raises(ConfigError, match=r"eviction='h2o' is invalid; allowed: a part of type EvictionSpec"):
        CompressionConfig(eviction="h2o", kv_bits=4)


def test_a_config_file_of_flat_settings_loads(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"policy": "a2sf", "budget": 0.2, "kv_bits": 4, "forgetting_factor": 0.5}))
    assert load_config(path) == CompressionConfig(policy="a2sf", budget=0.2, kv_bits=4, forgetting_factor=0.5)
