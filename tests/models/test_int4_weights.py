"""4-bit weights on CPU through torch's packed int4 kernel (issue 50, Build item 1): ``load_model(weights_bits=4)``
on CPU packs the decoder's Linear layers to group-32 asymmetric 4-bit (`h2o_compress.models.int4_linear`) and the
head to int8, without bitsandbytes. Loading, planning and generation: tests/models/test_weights.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from h2o_compress.models.identity import model_fingerprint
from h2o_compress.models.int4_linear import GROUP_SIZE, Int4Linear, quantize_linears_int4
from h2o_compress.models.int8_linear import Int8Linear


def q4_1_linear(out: int = 64, width: int = 128, seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    """A Linear whose weight lies on a GGUF Q4_1 grid (per block of 32: minimum + step x code, codes 0 and 15 both
    used), and the step of each weight's block ``[out, width]``."""
    torch.manual_seed(seed)
    blocks = width // GROUP_SIZE
    step = torch.rand(out, blocks, 1) * 0.01 + 0.001
    low = torch.randn(out, blocks, 1) * 0.02
    codes = torch.randint(0, 16, (out, blocks, GROUP_SIZE))
    codes[..., 0], codes[..., 1] = 0, 15
    linear = nn.Linear(width, out, bias=True)
    linear.weight.data = (low + step * codes).reshape(out, width)
    return linear, step.expand(out, blocks, GROUP_SIZE).reshape(out, width)


def test_the_module_computes_with_its_dequantized_weight():
    linear, _ = q4_1_linear()
    packed = Int4Linear.from_linear(linear)
    x = torch.randn(2, 3, 128)
    expected = x @ packed.dequantized().t() + linear.bias
    assert packed(x).shape == (2, 3, 64)
    # bf16 activations inside the layer (measured: 4e-3 of the largest output)
    torch.testing.assert_close(packed(x), expected, atol=1e-2 * expected.abs().max().item(), rtol=0)


def test_a_q4_1_grid_comes_back_within_the_bf16_rounding_of_its_step_and_zero():
    """Codes come back exactly; only the bf16 step and zero move a weight (measured: at most 0.55 of its block's
    step where the block's minimum is large against its step, a median 0.07)."""
    linear, step = q4_1_linear()
    error = (Int4Linear.from_linear(linear).dequantized() - linear.weight).abs() / step
    assert error.max() < 0.6 and error.median() < 0.15
    # against a plain round-to-nearest int4 of random weights, whose error reaches half a step everywhere
    assert error.mean() < 0.25


def test_a_constant_group_and_a_zero_weight_stay_exact():
    linear = nn.Linear(64, 16, bias=False)
    linear.weight.data = torch.zeros(16, 64)
    linear.weight.data[:, :32] = 0.5
    torch.testing.assert_close(Int4Linear.from_linear(linear).dequantized(), linear.weight.data, atol=0, rtol=0)


def test_a_shape_the_kernel_cannot_take_is_refused_in_one_line_and_packed_to_int8_by_the_model_pass():
    with pytest.raises(ValueError, match=r"out_features divisible by 16 and in_features by 32; got 10 x 64"):
        Int4Linear.from_linear(nn.Linear(64, 10))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=40, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = LlamaForCausalLM(config).eval()
    assert quantize_linears_int4(model) == 8  # 7 decoder layers + the head
    mlp, attention = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert type(attention.q_proj) is Int4Linear and type(mlp.up_proj) is Int8Linear  # 40 outputs: not by 16
    assert type(mlp.down_proj) is Int8Linear  # 40 inputs: not by 32
    assert type(model.lm_head) is Int8Linear


def test_two_4bit_models_differing_only_in_their_packed_layers_have_different_fingerprints():
    import copy

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = LlamaForCausalLM(config).eval()
    quantize_linears_int4(model)
    same, other = copy.deepcopy(model), copy.deepcopy(model)
    layer = other.model.layers[0].self_attn.q_proj
    layer.weight_int4 = layer.weight_int4 ^ 1  # one code bit of every byte: parameters unchanged
    assert model_fingerprint(model) == model_fingerprint(same)
    assert model_fingerprint(model) != model_fingerprint(other)
