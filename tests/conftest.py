"""Shared fixtures: tiny randomly initialised LLaMA (GQA), OPT and GPT-NeoX models, and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM


def tiny_llama(seed: int = 0, kv_heads: int = 2, heads: int = 4, head_dim: int = 32, layers: int = 2):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def tiny_opt(seed: int = 0):
    torch.manual_seed(seed)
    config = OPTConfig(
        vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=2,
        word_embed_proj_dim=64, max_position_embeddings=1024, attn_implementation="sdpa",
    )
    return OPTForCausalLM(config).eval()


def tiny_neox(seed: int = 0):
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        rotary_pct=0.25, max_position_embeddings=1024, attn_implementation="sdpa",
    )
    return GPTNeoXForCausalLM(config).eval()


TINY_MODELS = {"llama": tiny_llama, "opt": tiny_opt, "neox": tiny_neox}


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_model(request):
    """Each tiny architecture in turn."""
    return TINY_MODELS[request.param]()


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (converted once, then cached). Integration tests only."""
    from h2o_compress import load_model

    return load_model("smollm2-135m", device="cpu")
