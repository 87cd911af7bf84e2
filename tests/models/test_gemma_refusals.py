"""Gemma 4 and Gemma 3n from tiny hand-made configs (issue 51, item 3): refused in one line, before any cache is
allocated, with a reason that names the transformers feature that blocks them: Gemma 4's head dim that varies by
layer (``global_head_dim`` on its full-attention layers) and the KV both share between layers
(``num_kv_shared_layers``: the later layers read an earlier layer's keys, transformers' ``dummy`` cache layers)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from h2o_compress import CompressionConfig, UnsupportedModelError, make_cache
from h2o_compress.attention import use_h2o_attention

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             sliding_window=8, vocab_size=128, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
             layer_types=LAYERS)
CASES = {
    "gemma4 per-layer head dim": ("gemma4_text", dict(intermediate_size=64, num_kv_shared_layers=0, global_head_dim=32),
                                  r"attention geometry that varies by layer \('head_dim'"),
    "gemma4 shared KV": ("gemma4_text", dict(intermediate_size=64, num_kv_shared_layers=2, global_head_dim=16),
                         r"layers of type dummy \(KV shared with another layer\)"),
    "gemma3n shared KV": ("gemma3n_text", dict(intermediate_size=[64] * 4, num_kv_shared_layers=2, laurel_rank=4,
                                               altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4),
                          r"layers of type dummy \(KV shared with another layer\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gemma4_and_gemma3n_are_refused_naming_what_blocks_them(case):
    model_type, extra, reason = CASES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL, **extra)).eval()
    with pytest.raises(UnsupportedModelError, match=reason) as refused:
        use_h2o_attention(model)
        make_cache(model, CompressionConfig(policy="full", kv_bits=16), max_length=40)
    assert "\n" not in str(refused.value) and model_type in str(refused.value)
