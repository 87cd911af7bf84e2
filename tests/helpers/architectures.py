"""Tiny random models of every decoder-only class transformers ships (the architecture matrix, issue 32).

:func:`causal_lm_types` lists the ``model_type`` of every class in transformers' causal-LM mapping;
:func:`tiny_causal_lm` builds one with 2 layers, 4 query heads, 2 KV heads, head_dim 32 and a sliding window /
attention chunk of 16 tokens where the architecture has one (so an 80-token prompt runs past it), or returns why it
cannot (a config that a generic override cannot make tiny, a class that needs remote code, a multimodal wrapper).
"""

from __future__ import annotations

import inspect

import torch

WINDOW = 16  # sliding window / attention chunk of the tiny models, tokens: an 80-token prompt goes well past it
VOCAB = 128
MAX_PARAMETERS = 5_000_000

# Generic names of a tiny geometry in transformers' configs (each set only where the config's __init__ takes it).
TINY = {
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "hidden_size": 128, "n_embd": 128, "d_model": 128, "dim": 128,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 32, "intermediate_size": 256, "ffn_dim": 256, "n_inner": 256, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 512,
    "n_positions": 512, "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False,
    # MLA (DeepSeek V2/V3 and kin): query/key head = nope + rope, value head of its own
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # hybrids (issue 51): of the 2 layers, the first a linear-attention/SSM/conv layer, the second attention
    "attn_layer_indices": [1], "attn_layer_period": 2, "attn_layer_offset": 1, "block_types": ["recurrent", "attention"],
}
_STATE_TYPES = {"linear_attention", "conv"}  # a hybrid's constant-state layer types (transformers' layer_types)
# Per model type, over TINY: MiniMax as its published configs (no sliding window: its mask would slide over layers
# its cache holds in full, which make_cache refuses), a lightning-attention layer first, as there.
OVERRIDES = {"minimax": {"sliding_window": None, "layer_types": ["linear_attention", "full_attention"]}}


def causal_lm_types() -> list[str]:
    """``model_type`` of every class in transformers' causal-LM auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_causal_lm(model_type: str, seed: int = 0):
    """A tiny random causal LM of ``model_type`` in eval mode with eager attention, or ``str``: why none."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        return "no config class"
    try:
        params = set(inspect.signature(config_class.__init__).parameters)
        fields = set(getattr(config_class, "__dataclass_fields__", {}) or {})
        names = params | fields
        kwargs = {k: v for k, v in TINY.items() if k in names or "kwargs" in params and k in _known(config_class)}
        kwargs.update(OVERRIDES.get(model_type, {}))
        if "qk_rope_head_dim" in kwargs:  # MLA: the head dims are nope + rope (keys) and v_head_dim (values)
            kwargs.pop("head_dim", None)
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)  # MLA: a key per query head
        config = config_class(**kwargs)
        for k, v in kwargs.items():  # configs that compute fields in __post_init__ keep what they computed
            if getattr(config, k, v) != v and k in ("sliding_window", "attention_chunk_size"):
                setattr(config, k, v)
        if getattr(config, "layer_types", None) is not None and len(config.layer_types) != _layers(config):
            config.layer_types = list(config.layer_types[: _layers(config)])
        _hybrid_with_attention(config)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return f"not tiny: {size:,} parameters with the generic overrides"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception as error:  # noqa: BLE001 - the matrix lists why a class could not be built
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return model.eval()


def _hybrid_with_attention(config) -> None:
    """A hybrid whose tiny ``layer_types`` came out all linear-attention/conv (its pattern puts attention further
    down) gets a full-attention last layer, where ``layer_types`` is a field the model is built from."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and types and set(types) <= _STATE_TYPES:
        try:
            config.layer_types = [*types[:-1], "full_attention"]
        except (AttributeError, TypeError):  # a property computed from other fields
            pass


def _known(config_class) -> set[str]:
    try:
        return set(config_class().to_dict())
    except Exception:  # noqa: BLE001
        return set()


def _layers(config) -> int:
    return next((getattr(config, n) for n in ("num_hidden_layers", "n_layer", "num_layers") if hasattr(config, n)), 2)


# Hybrids the generic overrides cannot make tiny (issue 51), by hand: the tiny geometry above (hidden 128, 4 heads,
# 2 KV heads, vocab 128) where the config takes it, a state layer first, then attention. Zamba2's two hybrid layers
# share one attention block (num_mem_blocks=1).
HAND_COMMON = {"vocab_size": VOCAB, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                "tie_word_embeddings": False}
HAND_MADE = {
    "nemotron_h": {"layers_block_type": ["linear_attention", "full_attention"], "head_dim": 32,
                   "intermediate_size": 256, "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
                   "n_groups": 1, "chunk_size": 16, "n_routed_experts": 4, "moe_intermediate_size": 64,
                   "moe_shared_expert_intermediate_size": 64},
    "zamba": {"num_hidden_layers": 2, "layers_block_type": ["linear_attention", "hybrid"], "hidden_size": 64,
              "mamba_d_state": 16, "intermediate_size": 256},
    "zamba2": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
               "hidden_size": 64, "mamba_d_state": 16, "n_mamba_heads": 4, "mamba_ngroups": 1,
               "intermediate_size": 256, "chunk_size": 16, "adapter_rank": 8},
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "intermediate_size": 256,
                 "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "num_dense_layers": 1},
}


def hand_made_causal_lm(model_type: str, seed: int = 0, **overrides):
    """A tiny random causal LM of ``model_type`` from `HAND_MADE` (plus ``overrides`` of its config fields), eval
    mode, eager attention.

    Raises:
        KeyError: ``model_type`` has no hand-made config.
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fields = set(getattr(config_class, "__dataclass_fields__", {}) or {})
    kwargs = {k: v for k, v in HAND_COMMON.items() if k in fields}
    kwargs.update(HAND_MADE[model_type], **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**kwargs), attn_implementation="eager")
    assert sum(p.numel() for p in model.parameters()) <= MAX_PARAMETERS, model_type
    return model.eval()
