"""A calibration file is checked against the model it is used with before any cache is built (layers, KV heads,
columns, dtypes, finite and bounded values, metadata size and depth), whatever its checksum says; and the
calibration API refuses bad arguments with one-line H2OCompressErrors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import save_file

from h2o_compress import CompressionConfig, H2OCompressError, make_cache
from h2o_compress.calibration import calibrate
from h2o_compress.models.identity import model_fingerprint, model_identity
from h2o_compress.persistence.calibration_file import (
    EVICTION_WEIGHTS, FORMAT, FORMAT_VERSION, KEY_CHANNEL_MEAN, Calibration, load_calibration, save_calibration,
)
from h2o_compress.persistence.file_format import _checksum
from h2o_compress.policies.calibrated import CalibratedPolicy
from h2o_compress.utils.errors import CacheFileError, ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYERS, HEADS, HEAD_DIM = 2, 2, 32  # tiny_llama's


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def good_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {EVICTION_WEIGHTS: torch.randn(LAYERS, HEADS, HEAD_DIM + 4, generator=generator),
            KEY_CHANNEL_MEAN: torch.randn(LAYERS, HEADS, HEAD_DIM, generator=generator)}


def forged(path, model, tensors: dict[str, torch.Tensor], details: str = "{}") -> str:
    """A file with ``tensors`` as given (any dtype) and a checksum that matches: what anyone who can write the
    file can make."""
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "library_version": "0",
                "model_fingerprint": model_fingerprint(model), "model_id": model_identity(model), "details": details}
    metadata["checksum"] = _checksum(metadata, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return str(path)


def refused(path, model) -> str:
    """The one-line message ``load_calibration`` and ``make_cache`` refuse ``path`` with (the same from both)."""
    with pytest.raises(CacheFileError) as error:
        load_calibration(path, model)
    message = str(error.value)
    assert "\n" not in message and path.split("/")[-1] in message
    config = CompressionConfig(policy="calibrated", budget=8, calibration=path)
    with pytest.raises(CacheFileError, match="^calibration file "):
        make_cache(model, config, max_length=40)
    return message


def test_a_well_formed_file_loads(model, tmp_path):
    calibration = load_calibration(forged(tmp_path / "ok.safetensors", model, good_tensors()), model)
    assert calibration.layer_heads == [HEADS] * LAYERS
    assert calibration.eviction_weights(1).shape == (HEADS, HEAD_DIM + 4)


@pytest.mark.parametrize("shape, differs", [
    ((LAYERS, 3 * HEADS, HEAD_DIM + 4), "6 KV heads (this model: 2)"),  # crashed at the first eviction
    ((LAYERS, HEADS, 4 + 1), "5 columns (this model: 36)"),  # crashed at the first eviction
    ((3 * LAYERS, HEADS, HEAD_DIM + 4), "6 layers (this model: 2)"),  # accepted
    ((LAYERS, HEADS, 2 * (HEAD_DIM + 4)), "72 columns (this model: 36)"),  # accepted
    ((LAYERS, HEADS * (HEAD_DIM + 4)), "a tensor of shape [2, 72], not [layers, KV heads, columns]"),
])
def test_eviction_weights_of_another_shape_are_refused_naming_what_differs(model, tmp_path, shape, differs):
    tensors = {**good_tensors(), EVICTION_WEIGHTS: torch.zeros(shape)}
    message = refused(forged(tmp_path / "w.safetensors", model, tensors), model)
    assert f"its {EVICTION_WEIGHTS} have {differs}" in message and "h2o-compress calibrate --model MODEL" in message


def test_key_means_of_another_shape_are_refused(model, tmp_path):
    tensors = {**good_tensors(), KEY_CHANNEL_MEAN: torch.zeros(LAYERS, 3 * HEADS, HEAD_DIM)}
    assert f"its {KEY_CHANNEL_MEAN} have 6 KV heads (this model: 2)" in refused(
        forged(tmp_path / "k.safetensors", model, tensors), model)


def test_a_file_without_eviction_weights_is_refused(model, tmp_path):
    tensors = {KEY_CHANNEL_MEAN: good_tensors()[KEY_CHANNEL_MEAN]}
    assert f"holds no {EVICTION_WEIGHTS}" in refused(forged(tmp_path / "n.safetensors", model, tensors), model)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64])
def test_weights_that_are_not_floating_point_are_refused(model, tmp_path, dtype):
    tensors = {**good_tensors(), EVICTION_WEIGHTS: torch.ones(LAYERS, HEADS, HEAD_DIM + 4, dtype=dtype)}
    message = refused(forged(tmp_path / "d.safetensors", model, tensors), model)
    assert f"tensor '{EVICTION_WEIGHTS}' is of dtype {str(dtype).removeprefix('torch.')}; allowed: real " \
           "floating-point tensors" in message


@pytest.mark.parametrize("value, says", [(float("nan"), "holds NaN or Inf"), (float("inf"), "holds NaN or Inf"),
                                         (1e30, "holds values up to 1e+30 in magnitude; allowed: at most 1e+06")])
def test_key_means_that_are_not_finite_or_bounded_are_refused_at_load_naming_the_file(model, tmp_path, value, says):
    """NaN key means were refused only at the first decode step, blamed on the inputs and the model weights."""
    tensors = good_tensors()
    tensors[KEY_CHANNEL_MEAN][1, 0, 3] = value
    path = forged(tmp_path / "nan.safetensors", model, tensors)
    message = refused(path, model)
    assert message.startswith(f"calibration file '{path}': tensor '{KEY_CHANNEL_MEAN}' {says}")
    config = CompressionConfig(kv_bits=4, key_offsets="calibrated", calibration=path)
    with pytest.raises(CacheFileError) as error:
        make_cache(model, config, max_length=40)
    assert str(error.value) == message


def test_deeply_nested_or_oversized_details_are_refused(model, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000  # raised RecursionError
    assert "not a JSON object of at most 8 levels" in refused(
        forged(tmp_path / "deep.safetensors", model, good_tensors(), details=json.dumps({"a": 1})[:-1]
               + ', "b": ' + "[" * 20 + "]" * 20 + "}"), model)
    assert "holds 200,000 characters; allowed: at most 65,536" in refused(
        forged(tmp_path / "big.safetensors", model, good_tensors(), details=deep), model)
    assert "not a JSON object" in refused(forged(tmp_path / "list.safetensors", model, good_tensors(), "[1]"), model)


def test_a_file_of_the_same_model_name_with_other_weights_names_the_difference(model, tmp_path):
    """The refusal read 'fitted on llama:2x1x32, not llama:2x1x32'."""
    other = tiny_llama(seed=1)
    path = tmp_path / "other.safetensors"
    save_calibration(path, Calibration(good_tensors(), model_fingerprint(other), model_identity(other)))
    with pytest.raises(CacheFileError) as error:
        load_calibration(path, model)
    message = str(error.value)
    assert f"a model of the same name and geometry ({model_identity(model)}) with other weights or config" in message
    assert f"not {model_identity(model)}" not in message


def test_a_calibration_with_a_policy_that_does_not_read_it_is_refused():
    """``--calibration FILE`` with ``--policy h2o`` was silently unused."""
    with pytest.raises(ConfigError) as error:
        CompressionConfig(policy="h2o", budget=0.2, calibration="scorer.safetensors")
    assert str(error.value) == ("calibration='scorer.safetensors' is not used by policy='h2o'; allowed: policy "
                                "calibrated, or key_offsets 'calibrated' (4- or 8-bit int keys), or no calibration")
    CompressionConfig(policy="calibrated", calibration="scorer.safetensors")  # each reader takes it
    CompressionConfig(kv_bits=4, key_offsets="calibrated", calibration="scorer.safetensors")


def test_the_cli_refuses_a_calibration_with_another_policy_in_one_line():
    from typer.testing import CliRunner

    from h2o_compress.cli import app

    result = CliRunner().invoke(app, ["generate", "--model", "no-such-model", "--policy", "h2o", "--calibration",
                                      "s.safetensors", "hello"])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        "error: calibration='s.safetensors' is not used by policy='h2o'; allowed: policy calibrated, or key_offsets "
        "'calibrated' (4- or 8-bit int keys), or no calibration"]


def test_a_policy_without_weights_names_the_real_option():
    """The message told the user to pass --scorer, which does not exist."""
    with pytest.raises(ConfigError) as error:
        CalibratedPolicy().rank(torch.zeros(1, 1, 3), torch.arange(3).view(1, 1, 3), 3)
    assert "--calibration scorer.safetensors" in str(error.value) and "--scorer" not in str(error.value)


@pytest.mark.parametrize("weights", [torch.ones(2, 8, dtype=torch.complex64), torch.ones(2, 8, dtype=torch.int32),
                                     torch.ones(2, 8, dtype=torch.bool)])
def test_weights_that_are_not_real_floating_point_are_refused(weights):
    with pytest.raises(ConfigError) as error:
        CalibratedPolicy(weights=weights)
    dtype = str(weights.dtype).removeprefix("torch.")
    assert str(error.value) == (f"calibrated weights of dtype {dtype} and shape [2, 8] are invalid; allowed: a real "
                                "floating-point (fp32) tensor [kv_heads, head_dim + 4]")


@pytest.mark.parametrize("args, kwargs, message", [
    ((None, object()), {}, "^model=None is not a loaded transformers model"),
    (("model", None), {}, "^tokenizer=None is not a tokenizer"),
    (("model", "tokenizer"), {"out": "a\0b"}, "holds a NUL character; allowed: a file path"),
])
def test_bad_calibrate_arguments_are_one_line_h2o_compress_errors(model, args, kwargs, message):
    """These raised TypeError / AttributeError / ValueError."""
    args = tuple(model if a == "model" else (lambda text, **_: None) if a == "tokenizer" else a for a in args)
    with pytest.raises(H2OCompressError, match=message) as error:
        calibrate(*args, **kwargs)
    assert "\n" not in str(error.value)
