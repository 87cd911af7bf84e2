"""Round-trip error bounds and packing of the KV quantizers."""

from __future__ import annotations

import pytest
import torch

from h2o_compress import ConfigError
from h2o_compress.formats import BitsAndBytesQuantizer, IntQuantizer, hadamard_matrix, make_quantizer


def sample(shape=(2, 3, 9, 64), seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., 5] *= 20  # an outlier channel, as keys have
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int_round_trip_within_half_a_step(bits, group_size):
    x = sample()
    quantizer = IntQuantizer(bits, group_size, 64, rotate=False)
    stored = quantizer.quantize(x)
    error = (quantizer.dequantize(stored, torch.float32) - x).abs()
    groups = x.unflatten(-1, (64 // group_size, group_size))
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    bound = step / 2 * 1.01 + groups.abs().amax(-1) * 2**-10  # half a step + fp16 rounding of scale/zero
    assert (error.unflatten(-1, (64 // group_size, group_size)).amax(-1) <= bound).all()
    assert stored.parts["data"].shape == (2, 3, 9, 64 * bits // 8)
    assert stored.parts["scale_zero"].dtype == torch.float16


@pytest.mark.parametrize("bits,relative", [(4, 0.12), (8, 0.008)])
def test_int_with_rotation_relative_error(bits, relative):
    x = sample()
    quantizer = IntQuantizer(bits, 32, 64, rotate=True)
    h = quantizer.rotation(x.device)
    y = quantizer.dequantize(quantizer.quantize(x @ h), torch.float32) @ h
    assert ((y - x).norm() / x.norm()).item() < relative


def test_rotation_helps_with_outlier_channels():
    x = sample(seed=3)
    plain = IntQuantizer(4, 32, 64, rotate=False)
    rotated = IntQuantizer(4, 32, 64, rotate=True)
    err_plain = (plain.dequantize(plain.quantize(x), torch.float32) - x).norm()
    h = rotated.rotation(x.device)
    err_rotated = (rotated.dequantize(rotated.quantize(x @ h), torch.float32) @ h - x).norm()
    assert plain.rotation(x.device) is None
    assert err_rotated < err_plain


def test_hadamard_is_orthonormal_and_symmetric():
    for dim in (64, 80, 128):
        h = hadamard_matrix(dim)
        assert torch.allclose(h @ h, torch.eye(dim), atol=1e-5)
        assert torch.equal(h, h.T)


def test_int4_packs_two_values_per_byte():
    x = torch.arange(64, dtype=torch.float32).view(1, 1, 1, 64)
    stored = IntQuantizer(4, 32, 64, rotate=False).quantize(x)
    data = stored.parts["data"][0, 0, 0]
    # group 0 holds 0..31, scale 31/15: element 0 -> 0, element 1 -> round(1 / 2.0667) = 0; 2 -> 1, 3 -> 1
    assert data[0].item() == 0 | (0 << 4)
    assert data[1].item() == 1 | (1 << 4)


@pytest.mark.parametrize("fmt,bits,relative", [("nf4", 4, 0.17), ("fp4", 4, 0.22), ("int8", 8, 0.02)])
def test_bitsandbytes_formats_round_trip(fmt, bits, relative):
    x = sample()
    quantizer = BitsAndBytesQuantizer(fmt, 64, 64)
    stored = quantizer.quantize(x)
    y = quantizer.dequantize(stored, torch.float32)
    assert ((y - x).norm() / x.norm()).item() < relative
    assert stored.parts["data"].shape == (2, 3, 9, 64 * bits // 8)
    # evicting = gathering tokens gives exactly the dequantized kept tokens
    kept = quantizer.dequantize(stored.select(torch.tensor([0, 4, 8])), torch.float32)
    assert torch.equal(kept, y[:, :, [0, 4, 8]])


def test_make_quantizer_and_bad_group_size():
    assert isinstance(make_quantizer(4, "nf4", 64, 64), BitsAndBytesQuantizer)
    assert make_quantizer(8, "fp4", 64, 64).fmt == "int8"
    assert make_quantizer(16, "int", 32, 64).bits == 16
    with pytest.raises(ConfigError, match="group_size=128 does not divide the model's head_dim=64"):
        IntQuantizer(4, 128, 64)


def test_rotation_made_in_inference_mode_works_with_autograd_on():
    """The Hadamard matrix is cached: one first built under torch.inference_mode must not poison later runs."""
    from h2o_compress.formats.integer import hadamard_matrix

    hadamard_matrix.cache_clear()
    with torch.inference_mode():
        made_in_inference = hadamard_matrix(48)
    rotation = hadamard_matrix(48)
    assert not rotation.is_inference()  # an inference tensor cannot be saved for backward
    assert rotation is made_in_inference  # the matrix cached under inference mode is the one reused
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(48), atol=1e-6, rtol=0)  # orthonormal
    x = torch.randn(2, 48, requires_grad=True)
    (x @ rotation).sum().backward()
    # d/dx sum(x @ R) = every row R summed over its columns
    torch.testing.assert_close(x.grad, rotation.sum(-1).expand(2, 48))
