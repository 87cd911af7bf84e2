"""CompressionConfig composes its parts (issue 48): the storage (`h2o_compress.formats.storage.StorageSpec`) and the
layout (`h2o_compress.layout.LayoutSpec`) are specs of their own that check their own fields, and the config stays
the one flat entry (same fields, same ``to_dict``, same errors)."""

from __future__ import annotations

import pickle
import re
from dataclasses import FrozenInstanceError, fields, replace

import pytest

from h2o_compress.attention.runtime_spec import RuntimeSpec
from h2o_compress.config import SETTING_DEFAULTS, CompressionConfig
from h2o_compress.formats import FORMATS
from h2o_compress.formats.storage import ALLOWED_BITS, StorageSpec
from h2o_compress.layout import LayoutSpec
from h2o_compress.policies.spec import EvictionSpec
from h2o_compress.utils.errors import ConfigError


def test_the_config_builds_its_specs_from_its_flat_fields():
    config = CompressionConfig(policy="h2o", budget=0.2, kv_bits=4, k_bits=8, quant="int", group_size=64, residual=5,
                               rotate=False, high_bits_fraction=0.25, layer_budgets=[1, 2, 3], head_budgets="adaptive")
    assert config.storage == StorageSpec(kv_bits=4, k_bits=8, quant="int", group_size=64, residual=5, rotate=False,
                                         high_bits_fraction=0.25)
    assert config.layout == LayoutSpec(layer_budgets=(1.0, 2.0, 3.0), head_budgets="adaptive")
    assert config.layer_budgets == (1.0, 2.0, 3.0)  # the weights read once, into the config's field too
    assert (config.key_bits, config.value_bits, config.quantized, config.compilable) == (8, 4, True, True)
    assert config.format is FORMATS["int"] is config.storage.format
    assert {f.name for f in fields(StorageSpec)} | {f.name for f in fields(LayoutSpec)} <= set(SETTING_DEFAULTS)


def test_to_dict_and_equality_do_not_see_the_specs():
    config = CompressionConfig(kv_bits=4)
    assert config.storage.quantized and config.layout.layer_budgets == "uniform"
    assert "storage" not in config.to_dict() and "_specs" not in config.to_dict()
    assert config == CompressionConfig(kv_bits=4) and repr(config) == repr(CompressionConfig(kv_bits=4))
    assert pickle.loads(pickle.dumps(config)) == config
    assert replace(config, kv_bits=8).storage.key_bits == 8


def test_the_config_and_its_specs_are_frozen_and_a_replaced_field_makes_new_specs():
    config = CompressionConfig(kv_bits=4)
    first = config.storage
    assert config.storage is first and first == CompressionConfig(kv_bits=4).storage  # a part: made once
    with pytest.raises(FrozenInstanceError):
        config.kv_bits = 8  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        config.storage.kv_bits = 4  # type: ignore[misc]
    changed = replace(config, kv_bits=8)
    assert changed.storage.key_bits == 8 and changed.key_bits == 8 and config.key_bits == 4
    assert {config: "four", changed: "eight"}[CompressionConfig(kv_bits=4)] == "four"  # hashable: equal configs alike
    assert hash(CompressionConfig(policy="a2sf", forgetting_factor=0.5)) == hash(
        CompressionConfig(policy="a2sf", policy_options={"forgetting_factor": 0.5}))


def test_the_spec_cache_keeps_equal_values_of_other_types_apart():
    assert CompressionConfig(kv_bits=4, high_bits_fraction=0).storage.high_bits_fraction == 0
    with pytest.raises(ConfigError, match="high_bits_fraction"):
        CompressionConfig(kv_bits=4, high_bits_fraction=False)  # a bool, equal to the 0 cached just before


@pytest.mark.parametrize("name, value, policy", [
    ("forgetting_factor", 0.5, "a2sf"), ("lookahead_request", "Which names?", "lookahead"),
    ("evict_chat_header", True, "kvzip")])
def test_the_options_that_were_fields_are_policy_options_taken_by_their_old_keyword(name, value, policy):
    config = CompressionConfig(policy=policy, **{name: value})
    assert config.policy_options == {name: value} == config.options()
    assert config == CompressionConfig(policy=policy, policy_options={name: value})
    assert name not in {f.name for f in fields(CompressionConfig)}
    assert config.to_dict()[name] == value and "policy_options" not in config.to_dict()  # as earlier versions wrote
    assert CompressionConfig(**config.to_dict()) == config == replace(config)
    assert CompressionConfig().to_dict() | {name: value, "policy": policy} == config.to_dict()


@pytest.mark.parametrize("spec, values, message", [
    (StorageSpec, {"kv_bits": 3}, "kv_bits=3 is not supported; allowed: 4, 8, 16"),
    (StorageSpec, {"kv_bits": 4, "quant": "int8-blockwise"}, "quant='int8-blockwise' is an 8-bit format, not 4-bit"),
    (StorageSpec, {"residual": 5000}, "residual=5000 is too large"),
    (StorageSpec, {"high_bits_fraction": 0.5}, "high_bits_fraction=0.5 keeps some 4-bit tokens at 8 bits"),
    (StorageSpec, {"key_offsets": "calibrated"}, "key_offsets='calibrated' stores 4- or 8-bit int keys"),
    (LayoutSpec, {"head_budgets": "pooled"}, "head_budgets='pooled' is not supported; allowed: uniform, adaptive"),
    (LayoutSpec, {"layer_budgets": [0, 1]}, "layer_budgets holds"),
    (RuntimeSpec, {"score_chunk_size": 0}, "score_chunk_size=0 is invalid; allowed: an integer >= 1"),
    (RuntimeSpec, {"prefill_chunk_size": -1}, "prefill_chunk_size=-1 is invalid; allowed: an integer from 1 to"),
    (RuntimeSpec, {"attention_kernel": "cuda"}, "attention_kernel='cuda' is not supported; allowed: auto, torch, triton"),
    (EvictionSpec, {"policy": "nope"}, "unknown policy 'nope'; allowed:"),
    (EvictionSpec, {"heavy_ratio": 2}, "heavy_ratio=2 is out of range; allowed: [0, 1]"),
    (EvictionSpec, {"sink_tokens": True}, "sink_tokens=True is invalid; allowed: an integer >= 0"),
    (EvictionSpec, {"policy": "h2o", "policy_options": {"forgetting_factor": 0.5}},
     "forgetting_factor is set but policy='h2o'"),
    (EvictionSpec, {"policy": "a2sf", "policy_options": {"forgetting_factor": 2}}, "forgetting_factor=2 is out of range"),
])
def test_each_spec_checks_its_own_fields_with_the_configs_messages(spec, values, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as on_spec:
        spec(**values)
    with pytest.raises(ConfigError) as on_config:
        CompressionConfig(**values)
    assert str(on_config.value) == str(on_spec.value)


def test_the_checks_that_combine_parts_stay_with_the_config():
    LayoutSpec(head_budgets="adaptive")  # alone: fine
    with pytest.raises(ConfigError, match="head_budgets='adaptive' with policy='local'"):
        CompressionConfig(policy="local", head_budgets="adaptive")
    StorageSpec(kv_bits=4, high_bits_fraction=0.5)
    with pytest.raises(ConfigError, match="runs the torch decode step"):
        CompressionConfig(kv_bits=4, high_bits_fraction=0.5, attention_kernel="triton")
    StorageSpec(kv_bits=4, key_offsets="calibrated")
    with pytest.raises(ConfigError, match="but head_budgets='adaptive'"):
        CompressionConfig(kv_bits=4, key_offsets="calibrated", head_budgets="adaptive")


def test_the_bits_are_declared_by_the_formats():
    assert ALLOWED_BITS == tuple(sorted({16}.union(*(f.supported_bits for f in FORMATS.values())))) == (4, 8, 16)


def test_the_layout_spreads_with_the_floor_it_is_given():
    layout = LayoutSpec(layer_budgets="pyramid")
    assert sum(layout.layer_capacities(100, 4, lambda capacity: 5)) == 400
    assert LayoutSpec().layer_capacities(100, 4, lambda capacity: 1 / 0) == [100] * 4  # uniform: no floor asked
    config = CompressionConfig(budget=100, layer_budgets="pyramid")
    assert config.layer_capacities(100, 4) == layout.layer_capacities(100, 4, config.min_layer_capacity)


@pytest.mark.parametrize("values, message", [
    ({"policy": "h2o", "head_budgets": "adaptive"}, "the Triton op reads per-head slots"),
    ({"kv_bits": 4, "high_bits_fraction": 0.5}, "the Triton op does not read the 8-bit tokens' low planes"),
    ({"kv_bits": 4, "key_offsets": "calibrated"}, "but attention_kernel='triton' (the op does not read the offsets)"),
])
def test_each_part_the_triton_op_does_not_read_is_refused_with_it_and_fine_without(values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        CompressionConfig(**values, attention_kernel="triton")
    CompressionConfig(**values, attention_kernel="auto")


def test_the_legacy_options_read_as_the_fields_they_were():
    """Code that read ``config.forgetting_factor`` (a field in earlier versions) reads the policy option."""
    from h2o_compress import CompressionConfig

    config = CompressionConfig(policy="a2sf", budget=0.5, forgetting_factor=0.5)
    assert (config.forgetting_factor, config.lookahead_request, config.evict_chat_header) == (0.5, None, False)
    with pytest.raises(AttributeError, match="no attribute 'not_a_field'"):
        config.not_a_field
