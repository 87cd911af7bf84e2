"""Hybrids the generic tiny builder cannot make (issue 51), from hand-made tiny configs
(``tests/helpers/architectures.py`` ``HAND_MADE``): Nemotron-H (Mamba-2 + attention), Zamba (Mamba + a shared
attention block in its ``hybrid`` layers), Zamba2 (Mamba-2 + one attention block shared by two ``hybrid`` layers),
LFM2-MoE (short convolution + attention). Each is exact at budget 1.0 + 16 bits against its own
``DynamicCache(config=...)``, and under h2o 0.2 + 4 bits its attention layers hold at most their capacity in fewer
bytes, with finite logits and the state layers' bytes unchanged. Kimi-Linear, which the generic builder makes, is in
the matrix's HYBRIDS. Nemotron-H's MLP and MoE layers (transformers' dummy cache layers) are refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from helpers.architectures import hand_made_causal_lm
from h2o_compress import CompressionConfig, UnsupportedModelError, make_cache
from h2o_compress.attention import use_h2o_attention
from models.test_architectures import PROMPT, STEPS, greedy_logits, prompt

HAND_MADE_HYBRIDS = ["lfm2_moe", "nemotron_h", "zamba", "zamba2"]


@pytest.mark.parametrize("model_type", HAND_MADE_HYBRIDS)
def test_hand_made_hybrid_is_exact_and_its_attention_layers_compress(model_type):
    model = hand_made_causal_lm(model_type)
    ids, max_length = prompt(), PROMPT + STEPS + 1
    whole = make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=max_length)
    model.set_attn_implementation("eager")
    reference = greedy_logits(model, ids, DynamicCache(config=model.config))
    use_h2o_attention(model)
    assert (greedy_logits(model, ids, whole) - reference).abs().max().item() < 1e-5
    small = make_cache(model, CompressionConfig(budget=0.2, kv_bits=4, group_size=32), max_length=max_length)
    assert torch.isfinite(greedy_logits(model, ids, small)).all()
    assert small.attention_layers and small.state_layers
    assert all(layer.kept_length() <= layer.setting.capacity <= 18 for layer in small.attention_layers)
    assert small.nbytes() < whole.nbytes() and small.state_nbytes() == whole.state_nbytes() > 0


def test_nemotron_h_mlp_and_moe_layers_are_refused_in_one_line():
    model = hand_made_causal_lm("nemotron_h", layers_block_type=["linear_attention", "mlp", "full_attention", "moe"])
    with pytest.raises(UnsupportedModelError, match=r"model type 'nemotron_h' has layers without attention or state "
                                                    r"\(mlp, moe: transformers' dummy cache layers\)") as error:
        make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=PROMPT)
    assert "\n" not in str(error.value)
