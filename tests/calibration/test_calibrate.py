"""Calibration fitted once per model (issue 46): the fit, the file tied to the model, the lookup a cache makes,
and the refusals, on a tiny random LLaMA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import save_tiny_model_dir, tiny_llama, tiny_opt
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.calibration import calibrate
from h2o_compress.calibration.key_channels import key_channel_statistics
from h2o_compress.calibration.eviction_fit import fit_ridge, kept_shares, read_segment, training_rows
from h2o_compress.cli import app
from h2o_compress.formats.calibrated import CalibratedKeyQuantizer
from h2o_compress.persistence.calibration_file import (
    shipped_calibration_path,
    EVICTION_WEIGHTS, KEY_CHANNEL_MEAN, Calibration, load_calibration, read_calibration, save_calibration,
)
from h2o_compress.policies.calibrated import CalibratedPolicy, feature_matrix, predicted_score, token_prior
from h2o_compress.utils.errors import CacheFileError, ConfigError, InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CharTokenizer:
    """One token per character (ids below the tiny model's vocabulary)."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 100 for c in text]]))


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "calibration.txt"
    path.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 8)
    return str(path)


def test_calibrate_writes_a_file_tied_to_the_model(model, text_file, tmp_path):
    out = tmp_path / "scorer.safetensors"
    calibration = calibrate(model, CharTokenizer(), text_file, tokens=128, segments=3, out=out)
    weights = calibration.tensors[EVICTION_WEIGHTS]
    assert weights.shape == (2, 2, 32 + 4) and bool(torch.isfinite(weights).all())
    assert calibration.details["inputs"] == "score,age" and not weights[..., 2 : 2 + 33].any()  # no value read
    assert bool((weights[..., [0, 1]] != 0).all())
    assert 0 < calibration.details["held_back_kept_share"] <= 1.0 + 1e-6
    loaded = load_calibration(out, model)
    assert torch.equal(loaded.tensors[EVICTION_WEIGHTS], weights)
    with pytest.raises(CacheFileError, match="was fitted on .*allowed: a file calibrated on this model"):
        load_calibration(out, tiny_llama(seed=1))


def test_a_cache_takes_each_layer_s_weights_from_the_file(model, text_file, tmp_path):
    out = tmp_path / "scorer.safetensors"
    calibration = calibrate(model, CharTokenizer(), text_file, tokens=128, segments=2, out=out)
    cache = make_cache(model, CompressionConfig(policy="calibrated", budget=8, calibration=str(out)), max_length=40)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.setting.policy.weights, calibration.tensors[EVICTION_WEIGHTS][i])


def test_refusals_come_before_any_reading(model, text_file, tmp_path):
    taken = tmp_path / "taken.safetensors"
    taken.write_text("mine")
    with pytest.raises(InputError, match="reporting text"):
        calibrate(model, CharTokenizer(), "persuasion", out=tmp_path / "x.safetensors")
    with pytest.raises(CacheFileError, match="exists; allowed"):
        calibrate(model, CharTokenizer(), text_file, tokens=128, segments=2, out=taken)
    assert taken.read_text() == "mine"
    with pytest.raises(InputError, match="inputs='keys' is not an input set"):
        calibrate(model, CharTokenizer(), text_file, inputs="keys")
    with pytest.raises(InputError, match="tokens=8 is invalid"):
        calibrate(model, CharTokenizer(), text_file, tokens=8)
    with pytest.raises(InputError, match="at least 1536 tokens"):
        calibrate(model, CharTokenizer(), text_file, tokens=512, segments=3, out=tmp_path / "y.safetensors")


def test_a_modified_file_is_refused(model, text_file, tmp_path):
    out = tmp_path / "scorer.safetensors"
    calibrate(model, CharTokenizer(), text_file, tokens=128, segments=2, out=out)
    data = bytearray(out.read_bytes())
    data[-3] ^= 0xFF  # a weight's bytes
    out.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="fails its checksum"):
        read_calibration(out)


def test_a_model_without_a_calibration_is_refused_in_one_line(model, real_calibration_lookup):
    with pytest.raises(ConfigError, match="needs a calibration .* run h2o-compress calibrate --model MODEL"):
        make_cache(model, CompressionConfig(policy="calibrated", budget=8), max_length=40)
    make_cache(model, CompressionConfig(policy="calibrated", budget=1.0), max_length=40)  # nothing to evict: no file


def test_the_cli_refuses_a_reporting_text_before_loading():
    result = CliRunner().invoke(app, ["calibrate", "--text-file", "python_code"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: calibration text 'python_code' is a reporting text, which nothing may be tuned on; allowed: the "
        "tuning text (default) or a text file of your own"]


def test_the_ridge_fit_recovers_a_linear_law():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(2, 500, 3, generator=generator)
    truth = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, 1.0, -1.0]])
    labels = (inputs @ truth[:, :3, None])[..., 0] + truth[:, 3:]
    assert torch.allclose(fit_ridge(inputs, labels, ridge=0.0), truth, atol=1e-4)


def test_the_predicted_score_is_the_fitted_linear_form():
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(2, 8 + 4, generator=generator)
    scores, ages = torch.rand(1, 2, 5, generator=generator), torch.arange(1, 6).expand(1, 2, 5)
    values = torch.randn(1, 2, 5, 8, generator=generator)
    features = feature_matrix(scores, ages, values)  # [1, 2, 5, 8 + 3]
    expected = (features @ weights[:, :-1, None].unsqueeze(0))[..., 0] + weights[None, :, -1:]
    got = predicted_score(scores, ages, token_prior(values, weights), weights)
    assert torch.allclose(got, expected, atol=1e-5)


def test_labels_are_the_mean_attention_to_come(model):
    read = read_segment(model, torch.randint(0, 100, (1, 48), generator=torch.Generator().manual_seed(2)))
    layer = read[0]
    inputs, labels = training_rows(layer, recent=4, stride=8)
    n = 4 + 8  # the first decision time: tokens 0 .. n - recent - 1 are ranked
    expected = torch.log(layer.attention[:, n:, : n - 4].mean(1) + 1e-4)
    assert torch.allclose(labels[:, : n - 4], expected, atol=1e-5)
    fitted, h2o = kept_shares(layer, torch.zeros(2, 32 + 4), recent=4, heavy=4)
    assert fitted <= 1.0 + 1e-6 and h2o <= 1.0 + 1e-6


def test_weights_without_a_calibration_refuse_to_rank():
    policy = CalibratedPolicy()
    with pytest.raises(ConfigError, match="no weights"):
        policy.rank(torch.zeros(1, 1, 3), torch.arange(3).view(1, 1, 3), 3)
    with pytest.raises(ConfigError, match="NaN or Inf"):
        CalibratedPolicy(weights=torch.full((1, 8), float("nan")))


def test_calibrate_writes_the_mean_pre_rope_keys_of_the_fitted_segments(model, text_file, tmp_path):
    out = tmp_path / "scorer.safetensors"
    calibration = calibrate(model, CharTokenizer(), text_file, tokens=128, segments=3, out=out)
    mean = calibration.key_channel_mean()
    assert mean.shape == (2, 2, 32) and mean.dtype == torch.float32 and bool(torch.isfinite(mean).all())
    ids = CharTokenizer()(open(text_file).read()).input_ids[:, : 3 * 128]
    fitted = [key_channel_statistics(model, ids[:, i * 128 : (i + 1) * 128])["key_channel_mean"] for i in (1, 2)]
    assert torch.allclose(mean, (fitted[0] + fitted[1]) / 2, atol=1e-6)  # the held-back segment not counted
    held_back = key_channel_statistics(model, ids[:, :128])["key_channel_mean"]
    assert not torch.allclose(mean, (held_back + fitted[0]) / 2, atol=1e-6)
    assert calibration.details["key_statistics"].startswith("mean pre-RoPE key")
    loaded = load_calibration(out, model)
    assert torch.equal(loaded.key_channel_mean(), mean) and loaded.tensors[KEY_CHANNEL_MEAN].dtype == torch.float32
    assert torch.equal(loaded.tensors[EVICTION_WEIGHTS], calibration.tensors[EVICTION_WEIGHTS])


def test_a_model_without_a_fixed_rope_calibrates_without_key_statistics(tmp_path):
    opt = tiny_opt()
    out = tmp_path / "opt.safetensors"
    calibration = calibrate(opt, CharTokenizer(), None, tokens=64, segments=2, out=out)
    assert calibration.key_channel_mean() is None and set(read_calibration(out).tensors) == {EVICTION_WEIGHTS}
    assert calibration.details["key_statistics"].startswith("none: key calibration needs one fixed rotary embedding")
    with pytest.raises(ConfigError, match="^key_offsets='calibrated' needs the mean pre-RoPE keys .* and its "
                                          "calibration file has none .*rerun h2o-compress calibrate --model MODEL"):
        make_cache(opt, CompressionConfig(kv_bits=4, key_offsets="calibrated", calibration=str(out)), max_length=16)


def test_a_file_without_key_statistics_is_refused_in_one_line(model, tmp_path):
    old = tmp_path / "old.safetensors"  # a file written before the keys were measured
    weights = torch.zeros(2, 2, 32 + 4)
    from h2o_compress.models.identity import model_fingerprint, model_identity

    save_calibration(old, Calibration({EVICTION_WEIGHTS: weights}, model_fingerprint(model), model_identity(model)))
    make_cache(model, CompressionConfig(kv_bits=4, policy="calibrated", calibration=str(old)), max_length=16)  # fine
    with pytest.raises(ConfigError) as error:
        make_cache(model, CompressionConfig(kv_bits=4, key_offsets="calibrated", calibration=str(old)), max_length=16)
    assert "\n" not in str(error.value) and "h2o-compress calibrate --model MODEL" in str(error.value)


def test_key_offsets_without_any_calibration_name_the_command(model, real_calibration_lookup):
    with pytest.raises(ConfigError, match="^key_offsets='calibrated' needs a calibration .* run h2o-compress "
                                          "calibrate --model MODEL"):
        make_cache(model, CompressionConfig(kv_bits=4, key_offsets="calibrated"), max_length=40)


def test_the_cli_calibrates_and_generates_with_calibrated_keys(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{(i * 7) % 120}" for i in range(200)))
    out = tmp_path / "tiny.safetensors"
    runner = CliRunner()
    result = runner.invoke(app, ["calibrate", "--model", model_dir, "--text-file", str(text), "--tokens", "64",
                                 "--segments", "2", "--out", str(out), "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "key statistics (mean pre-RoPE keys, for --key-offsets calibrated): measured" in result.output
    assert f"and with 4- or 8-bit keys: --key-offsets calibrated --calibration {out}" in result.output
    assert read_calibration(out).key_channel_mean().shape == (2, 2, 32)
    base = ["generate", "--model", model_dir, "--kv-bits", "4", "--max-new-tokens", "4", "--threads", "1",
            "--calibration", str(out), "--json", "w1 w2 w3 w4 w5 w6 w7 w8"]
    result = runner.invoke(app, [*base, "--key-offsets", "calibrated"])
    assert result.exit_code == 0, result.output
    assert '"key_offsets": "calibrated"' in result.output and '"decode_kernel": "torch"' in result.output
    missing = str(tmp_path / "no-such-model")
    for flags, message in (
            (["--key-offsets", "maybe"], "error: key_offsets='maybe' is not supported; allowed: none, calibrated"),
            (["--key-offsets", "calibrated", "--kv-bits", "16"], "error: key_offsets='calibrated' stores 4- or 8-bit "
             "int keys around a calibrated mean, but keys are 16-bit with quant='int'; allowed: kv_bits (or k_bits) "
             "4 or 8 with quant 'int', or key_offsets 'none'")):
        result = runner.invoke(app, ["generate", "--model", missing, "--kv-bits", "4", *flags, "w1"])
        assert result.exit_code == 2 and result.output.strip().splitlines() == [message]  # before the model loads


SHIPPED = "h2o_compress/data/calibration/e3677f1f504b020f7e23e978be3ee473.safetensors"  # SmolLM2-135M's


def test_the_shipped_smollm2_calibration_holds_the_key_statistics():
    from pathlib import Path

    shipped = read_calibration(Path(__file__).resolve().parents[2] / SHIPPED)
    assert shipped.tensors[EVICTION_WEIGHTS].shape == (30, 3, 64 + 4)
    mean = shipped.key_channel_mean()
    assert mean.shape == (30, 3, 64) and bool(torch.isfinite(mean).all())
    assert shipped.details["key_statistics"] == "mean pre-RoPE key over the fitted segments"
    assert (shipped.details["text"], shipped.details["tokens"], shipped.details["segments"]) == ("sherlock", 1024, 4)


@pytest.mark.integration
def test_smollm2_takes_the_shipped_key_statistics(smollm2_fp32, smollm2, real_calibration_lookup):
    """A calibration is shipped for each way the embedded model loads on CPU, keyed by its fingerprint: the int8
    default's (fitted on the int8 model) and the fp32 weights' (``weights_bits=16``); each model takes its own."""
    for model, _ in (smollm2, smollm2_fp32):
        cache = make_cache(model, CompressionConfig(kv_bits=4, key_offsets="calibrated"), max_length=64)
        assert all(isinstance(layer.setting.key_quantizer, CalibratedKeyQuantizer) for layer in cache.layers)
    shipped = {shipped_calibration_path(m[0]) for m in (smollm2, smollm2_fp32)}
    assert len(shipped) == 2 and None not in shipped
