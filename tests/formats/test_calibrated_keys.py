"""Keys stored around a calibrated pre-RoPE mean (formats/calibrated.py, calibration/key_channels.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.calibration.key_channels import key_channel_statistics, use_key_calibration
from h2o_compress.formats import IntQuantizer
from h2o_compress.formats.calibrated import CalibratedKeyQuantizer
from h2o_compress.persistence.cache_state import save_cache
from h2o_compress.utils.errors import CacheStateError, ConfigError, UnsupportedModelError
from tests.conftest import tiny_llama, tiny_neox, tiny_opt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, HEADS = 64, 3
INV_FREQ = 1 / (1e4 ** (torch.arange(0, D, 2) / D))


def post_rope(pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``pre [b, h, n, D]`` rotated by the half-split RoPE at ``positions [b, h, n]`` (transformers' Llama form)."""
    angles = positions.unsqueeze(-1).float() * INV_FREQ
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    return pre * cos + rotate_half(pre) * sin


def biased_keys(mean: torch.Tensor, tokens: int = 40, seed: int = 0):
    """Post-RoPE keys with a per-channel bias ``mean [HEADS, D]`` pre-RoPE, in the Hadamard basis, and positions."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(tokens).view(1, 1, -1).expand(2, HEADS, -1)
    pre = torch.randn(2, HEADS, tokens, D, generator=generator) + mean[None, :, None]
    basis = IntQuantizer(4, 32, D).rotation(torch.device("cpu"))
    return post_rope(pre, positions) @ basis, positions


def round_trip(quantizer: CalibratedKeyQuantizer, x: torch.Tensor, positions: torch.Tensor):
    stored = quantizer.quantize_at(x, positions)
    out = torch.empty_like(x)
    quantizer.dequantize_at(stored, out, positions)
    return stored, out


def test_offset_is_the_mean_rotated_to_each_position():
    mean = torch.randn(HEADS, D, generator=torch.Generator().manual_seed(1))
    quantizer = CalibratedKeyQuantizer(4, 32, D, mean, INV_FREQ)
    positions = torch.tensor([0, 1, 7, 300, 4000]).view(1, 1, -1).expand(2, HEADS, -1)
    expected = post_rope(mean[None, :, None].expand(2, HEADS, 5, D), positions) @ quantizer.rotation(torch.device("cpu"))
    assert torch.allclose(quantizer.offset(positions), expected, atol=1e-4)


def test_a_zero_mean_stores_and_reads_exactly_the_int_format():
    x, positions = biased_keys(torch.zeros(HEADS, D))
    quantizer = CalibratedKeyQuantizer(4, 32, D, torch.zeros(HEADS, D), INV_FREQ)
    plain = IntQuantizer(4, 32, D)
    stored, out = round_trip(quantizer, x, positions)
    reference = plain.quantize(x)
    for name in ("data", "scale_zero"):
        assert torch.equal(stored.parts[name], reference.parts[name])
    assert torch.equal(out, plain.dequantize(reference, torch.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_channel_bias_error_is_bounded_and_smaller_than_without(bits):
    mean = torch.zeros(HEADS, D)
    mean[:, [3, 20, 40, 60]] = torch.tensor([8.0, -6.0, 5.0, 9.0])  # outlier channels, as keys have
    x, positions = biased_keys(mean)
    quantizer = CalibratedKeyQuantizer(bits, 32, D, mean, INV_FREQ)
    stored, out = round_trip(quantizer, x, positions)
    shifted = stored.parts["scale_zero"][..., 0, 0] < 0
    assert shifted.float().mean() > 0.9  # the biased keys take the offset
    difference = torch.where(shifted.unsqueeze(-1), x - quantizer.offset(positions), x).unflatten(-1, (2, 32))
    step = (difference.amax(-1) - difference.amin(-1)) / (2**bits - 1)
    bound = step / 2 * 1.01 + difference.abs().amax(-1) * 2**-10  # half a step + fp16 rounding of scale/zero
    assert ((out - x).abs().unflatten(-1, (2, 32)).amax(-1) <= bound).all()
    plain = IntQuantizer(bits, 32, D)
    plain_error = (plain.dequantize(plain.quantize(x), torch.float32) - x).norm()
    assert (out - x).norm() < 0.6 * plain_error


def test_a_key_far_from_the_mean_is_stored_as_without_calibration():
    mean = torch.full((HEADS, D), 4.0)
    x, positions = biased_keys(mean)
    x[:, :, 0] = -x[:, :, 0]  # a sink-like key: subtracting the mean would widen it
    quantizer = CalibratedKeyQuantizer(4, 32, D, mean, INV_FREQ)
    stored, out = round_trip(quantizer, x, positions)
    assert not (stored.parts["scale_zero"][:, :, 0, :, 0] < 0).any()
    plain = IntQuantizer(4, 32, D)
    assert torch.equal(out[:, :, 0], plain.dequantize(plain.quantize(x[:, :, :1]), torch.float32)[:, :, 0])


def test_wrong_shapes_are_refused():
    with pytest.raises(ConfigError, match="does not fit head_dim"):
        CalibratedKeyQuantizer(4, 32, D, torch.zeros(HEADS, D + 2), INV_FREQ)


def biased_llama():
    """A tiny Llama whose keys have a channel bias (a k_proj bias), as real models' keys do."""
    model = tiny_llama(seed=0)
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.k_proj.bias = torch.nn.Parameter(torch.zeros(attention.k_proj.out_features))
        attention.k_proj.bias.data[::7] = 6.0
    return model


@torch.inference_mode()
def stream_error(model, statistics, ids) -> tuple[float, "torch.nn.Module"]:
    """Largest logit error of ``ids`` read token by token through a cache of 4-bit keys and 16-bit values (the
    keys' error alone; with ``statistics``, or not)."""
    reference = model(input_ids=ids).logits[0]
    cache = make_cache(model, CompressionConfig(k_bits=4, v_bits=16), max_length=ids.shape[1])
    if statistics is not None:
        use_key_calibration(cache, model, statistics)
    logits = torch.cat([model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0]
                        for t in range(ids.shape[1])])
    return float((logits - reference).abs().max()), cache


def test_statistics_shapes_and_the_cache_reads_closer_with_them():
    model = biased_llama()
    calibration_ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    statistics = key_channel_statistics(model, calibration_ids)
    assert statistics["key_channel_mean"].shape == statistics["key_channel_scale"].shape == (2, 2, 32)
    assert statistics["key_channel_mean"].dtype == torch.float32
    assert (statistics["key_channel_mean"].reshape(2, -1)[:, ::7] > 5).all()  # the bias, pre-RoPE
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    plain, plain_cache = stream_error(model, None, ids)
    calibrated, cache = stream_error(model, statistics, ids)
    assert type(plain_cache.layers[0].setting.key_quantizer) is IntQuantizer  # no calibration: the format as it was
    assert isinstance(cache.layers[0].setting.key_quantizer, CalibratedKeyQuantizer)
    assert cache.layers[0].backend.name == "torch"
    assert calibrated < 0.3 * plain  # 0.0017 against 0.018 when written


def test_models_and_caches_it_cannot_take_are_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="k_proj"):
        key_channel_statistics(tiny_neox(), torch.zeros(1, 8, dtype=torch.long))
    opt = tiny_opt()
    statistics = key_channel_statistics(opt, torch.randint(0, 128, (1, 16)))
    with pytest.raises(UnsupportedModelError, match="rotary embedding"):
        use_key_calibration(make_cache(opt, CompressionConfig(kv_bits=4), max_length=16), opt, statistics)
    model = tiny_llama()
    statistics = key_channel_statistics(model, torch.randint(0, 128, (1, 16)))
    with pytest.raises(ConfigError, match="int keys"):
        use_key_calibration(make_cache(model, CompressionConfig(), max_length=16), model, statistics)
    with pytest.raises(ConfigError, match="key_channel_mean"):
        use_key_calibration(make_cache(model, CompressionConfig(kv_bits=4), max_length=16), model,
                            {"key_channel_mean": statistics["key_channel_mean"][:1]})
    cache = make_cache(model, CompressionConfig(kv_bits=4), max_length=16)
    use_key_calibration(cache, model, statistics)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache, use_cache=True)
    with pytest.raises(ConfigError, match="fresh cache"):
        use_key_calibration(cache, model, statistics)
    with pytest.raises(CacheStateError, match="key calibration"):
        save_cache(cache, tmp_path / "cache.safetensors", model=model)


def test_compiled_decode_matches_eager_and_keeps_its_buffers():
    """The torch decode step with calibrated keys traces whole (fullgraph), allocates no new buffers, and gives the
    eager step's logits, on a left-padded batch with evictions (h2o, capacity 12 of 44 tokens)."""
    import torch._dynamo
    import torch._dynamo.testing

    from h2o_compress.runtime.compiled import decode_step
    from tests.helpers.decode_steps import PROMPT, STEPS, run, setting

    model = biased_llama()
    statistics = key_channel_statistics(model, torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0)))
    caches = []
    for _ in range(2):
        caches.append(make_cache(model, setting("h2o", 4), max_length=PROMPT + STEPS))
        use_key_calibration(caches[-1], model, statistics)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(decode_step, fullgraph=True, backend=counter)
    with torch.inference_mode(), torch._dynamo.config.patch(capture_scalar_outputs=False):
        eager, _, _, _ = run(model, None, decode_step, cache=caches[0])
        ours, cache, before, after = run(model, None, compiled, cache=caches[1])
    assert counter.frame_count <= 2
    assert before == after
    assert {layer.backend.name for layer in cache.layers} == {"torch"}
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)


# -- key_offsets="calibrated": the setting reads the model's calibration file (conftest's fitted_calibrations) ------

@torch.inference_mode()
def streamed(model, config, ids) -> tuple[torch.Tensor, "torch.nn.Module"]:
    """Logits of ``ids`` read token by token through ``make_cache(model, config)``, and the cache."""
    cache = make_cache(model, config, max_length=ids.shape[1])
    logits = torch.cat([model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0]
                        for t in range(ids.shape[1])])
    return logits, cache


def test_the_setting_stores_keys_around_the_calibrated_mean_with_bounded_error():
    model = biased_llama()
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits[0]
    plain_logits, plain = streamed(model, CompressionConfig(budget=1.0, kv_bits=4), ids)
    ours_logits, ours = streamed(model, CompressionConfig(budget=1.0, kv_bits=4, key_offsets="calibrated"), ids)
    assert type(plain.layers[0].setting.key_quantizer) is IntQuantizer
    assert all(isinstance(layer.setting.key_quantizer, CalibratedKeyQuantizer) for layer in ours.layers)
    assert ours.layers[0].backend.name == "torch"
    stored = [(a.store.keys.parts["data"], b.store.keys.parts["data"]) for a, b in zip(plain.layers, ours.layers)]
    assert any(not torch.equal(a, b) for a, b in stored)  # the keys are stored otherwise
    assert torch.equal(plain.layers[0].store.values.parts["data"], ours.layers[0].store.values.parts["data"])
    plain_error = float((plain_logits - reference).abs().max())
    ours_error = float((ours_logits - reference).abs().max())
    assert ours_error < plain_error and ours_error < 0.05 * float(reference.abs().max())  # 0.041, 0.047 written
    keys_only = [float((streamed(model, CompressionConfig(k_bits=4, v_bits=16, key_offsets=offsets), ids)[0]
                        - reference).abs().max()) for offsets in ("none", "calibrated")]
    assert keys_only[1] < 0.3 * keys_only[0]  # the keys' own error


def test_sixteen_bits_refuse_the_setting_and_stay_bit_exact(tmp_path):
    with pytest.raises(ConfigError, match="^key_offsets='calibrated' .* keys are 16-bit"):
        CompressionConfig(key_offsets="calibrated")
    model = biased_llama()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        full = model(input_ids=ids).logits
        cache = make_cache(model, CompressionConfig(policy="calibrated"), max_length=24)  # the file read, keys 16-bit
        ours = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    assert torch.equal(ours, full)


@pytest.mark.parametrize("fields, message", [
    ({"key_offsets": "yes"}, "key_offsets='yes' is not supported; allowed: none, calibrated"),
    ({"key_offsets": True}, "key_offsets=True is not supported; allowed: none, calibrated"),
    ({"key_offsets": "calibrated", "kv_bits": 4, "quant": "nf4"}, "keys are 4-bit with quant='nf4'"),
    ({"key_offsets": "calibrated", "k_bits": 16, "v_bits": 4}, "keys are 16-bit"),
    ({"key_offsets": "calibrated", "kv_bits": 4, "head_budgets": "adaptive"}, "head_budgets='adaptive'; allowed: "
     "head_budgets 'uniform'"),
    ({"key_offsets": "calibrated", "kv_bits": 4, "high_bits_fraction": 0.1}, "high_bits_fraction=0.1; allowed: "
     "high_bits_fraction 0"),
    ({"key_offsets": "calibrated", "kv_bits": 4, "attention_kernel": "triton"}, "attention_kernel='triton'"),
])
def test_bad_values_and_conflicts_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError) as error:
        CompressionConfig(**fields)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_eight_bit_keys_and_four_bit_values_take_the_setting():
    config = CompressionConfig(k_bits=8, v_bits=4, key_offsets="calibrated")
    cache = make_cache(biased_llama(), config, max_length=16)
    assert {layer.setting.key_quantizer.bits for layer in cache.layers} == {8}
    assert all(isinstance(layer.setting.key_quantizer, CalibratedKeyQuantizer) for layer in cache.layers)


def test_a_cache_with_the_setting_is_not_saved(tmp_path):
    model = biased_llama()
    cache = make_cache(model, CompressionConfig(kv_bits=4, key_offsets="calibrated"), max_length=16)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache, use_cache=True)
    with pytest.raises(CacheStateError, match="key_offsets='none'"):
        save_cache(cache, tmp_path / "cache.safetensors", model=model)


def test_a_cache_file_naming_calibrated_keys_is_refused(tmp_path):
    """No saved cache holds calibrated keys (save_cache refuses them), so a file whose config names them was made by
    hand: load_cache refuses it rather than read its keys without the offsets."""
    import json

    from h2o_compress.persistence.cache_state import load_cache
    from h2o_compress.persistence.file_format import read_cache_file, write_cache_file
    from h2o_compress.utils.errors import CacheFileError

    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(kv_bits=4), max_length=16)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache, use_cache=True)
    path = save_cache(cache, tmp_path / "cache.safetensors", model=model)
    metadata, tensors = read_cache_file(path)
    config = json.loads(metadata["config"]) | {"key_offsets": "calibrated"}
    fields = {k: v for k, v in metadata.items() if k not in ("format", "format_version", "library_version", "checksum")}
    write_cache_file(path, fields | {"config": json.dumps(config, sort_keys=True)}, tensors)
    with pytest.raises(CacheFileError, match="names key_offsets 'calibrated', which no cache file holds"):
        load_cache(path, model)
