"""Planner on hybrid models (issue 51): the constant linear-attention / SSM / convolution states sized from the
config per family equal, to the byte, the states a real prefill and decode steps leave in the compressed cache (or
in RecurrentGemma's own modules), and the planner's cache total equals ``cache.nbytes()``; the known hybrids show
them; families without a formula and Gemma 4 are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.architectures import HAND_COMMON, HAND_MADE as BUILT_BY_HAND, VOCAB, tiny_causal_lm
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, UnsupportedModelError, make_cache
from h2o_compress.cache.hybrid import state_tensors
from h2o_compress.cli import app
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes, model_states, state_bytes
from h2o_compress.planner.known_models import known_config, resolve_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# every hybrid class the tiny builder makes (tests/models/test_architectures.py HYBRIDS), and others by hand
HYBRIDS = ["bailing_hybrid", "bamba", "falcon_h1", "granitemoehybrid", "jamba", "kimi_linear", "lfm3", "minimax",
           "olmo_hybrid",
           "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma"]
PROMPT, STEPS, BATCH = 12, 2, 2
MiB = 2**20


# hybrids built by hand: tests/helpers/architectures.py's, plus LFM2
HAND_MADE = {"lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "intermediate_size": 128},
             **BUILT_BY_HAND}


def _hand_made(model_type: str):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fields = set(getattr(config_class, "__dataclass_fields__", {}) or {})
    kwargs = {k: v for k, v in HAND_COMMON.items() if k in fields}
    torch.manual_seed(0)
    config = config_class(**{**kwargs, **HAND_MADE[model_type]})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _module_state_bytes(model) -> int:
    """Bytes of the states RecurrentGemma's blocks hold themselves (conv window and RG-LRU state)."""
    tensors = [getattr(m, "conv1d_state", None) for m in model.modules()]
    tensors += [getattr(getattr(m, "rg_lru", None), "recurrent_states", None) for m in model.modules()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("model_type", [*HYBRIDS, *HAND_MADE])
def test_planned_states_and_total_equal_the_cache_after_a_real_run(model_type):
    """bfloat16 (conv windows in bf16, recurrent states in fp32), h2o 0.5 + 4 bits on the attention layers."""
    model = _hand_made(model_type) if model_type in HAND_MADE else tiny_causal_lm(model_type)
    assert not isinstance(model, str), model
    model = model.to(torch.bfloat16)
    for module in model.modules():  # Mamba-2's torch scan pads a 12-token prompt to its 256-token chunk: 16 is faster
        if isinstance(getattr(module, "chunk_size", None), int):
            module.chunk_size = 16
    config = CompressionConfig(budget=0.5, kv_bits=4, group_size=32)
    try:
        cache = make_cache(model, config, max_length=PROMPT + STEPS + 1)
    except UnsupportedModelError as refused:  # the planner sizes it; the cache does not run it (yet)
        assert model_type in HAND_MADE, refused
        pytest.skip(f"the cache refuses {model_type}: {refused}")
    ids = torch.randint(3, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(STEPS):
            logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[:, -1]
    states = model_states(model.config)
    in_cache, outside = state_bytes(states, BATCH, torch.bfloat16)
    measured = sum(t.numel() * t.element_size() for layer in cache.state_layers for t in state_tensors(layer))
    assert in_cache == measured == cache.state_nbytes()
    assert outside == _module_state_bytes(model)
    assert in_cache + outside > 0  # every one of them holds some state
    planned = cache_bytes(model_dims(model.config), config, BATCH, PROMPT, STEPS, PROMPT + STEPS + 1,
                          torch.bfloat16, states)
    assert planned.states == in_cache and planned.model_states == outside
    assert planned.total == cache.nbytes()


# per sequence, fp16 compute: conv windows 2 bytes per value, recurrent states 4
KNOWN = {
    # 36 gated-DeltaNet layers: conv (2 x 16 x 128 + 32 x 128) x 4, state 32 x 128 x 128
    "qwen3-next-80b-a3b": 36 * (8192 * 4 * 2 + 32 * 128 * 128 * 4),
    # 36 Mamba-2 layers: conv (8192 + 2 x 128) x 4, state 128 heads x 64 x 128
    "granite-4.0-h-small": 36 * (8448 * 4 * 2 + 128 * 64 * 128 * 4),
    "granite-4.0-h-tiny": 36 * (3328 * 4 * 2 + 48 * 64 * 128 * 4),
    # every one of the layers beside its attention: conv (3072 + 2 x 256) x 4, state heads x head dim x 256
    "falcon-h1-1.5b": 24 * (3584 * 4 * 2 + 48 * 64 * 256 * 4),
    "falcon-h1-7b": 44 * (3584 * 4 * 2 + 24 * 128 * 256 * 4),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_hybrids_state_bytes_by_hand(name):
    config = known_config(name)
    assert state_bytes(model_states(config), 1, torch.float16) == (KNOWN[name], 0)
    assert state_bytes(model_states(config), 3, torch.float16)[0] == 3 * KNOWN[name]


# parameters the model cards publish (billions), the planner's meta-device count within 1%
PUBLISHED = {"qwen3-next-80b-a3b": 80, "granite-4.0-h-small": 32.2, "granite-4.0-h-tiny": 6.9, "falcon-h1-1.5b": 1.55,
             "falcon-h1-7b": 7.59, "deepseek-v3": 671}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_new_known_models_plan_with_their_published_sizes(name):
    from h2o_compress import plan

    report = plan(name, "80GiB", batch=2, prompt_len=4096, gen_len=128, budgets=(0.2,), bits=(4,), group_sizes=(32,))
    assert report.weight_bytes / 2 / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01)
    assert report.state_bytes == report.rows[0].cache.states == 2 * KNOWN.get(name, 0)
    if name == "deepseek-v3":  # the latent per token and layer: 512 + 64 values (multi-head latent attention)
        assert report.dims.fp16_bytes_per_token == 61 * (512 + 64) * 2


def test_hybrid_plan_counts_states_in_rows_and_totals(tmp_path):
    """A local tiny Qwen3-Next directory through the Python API and the CLI: the report's state bytes, each row's
    cache (states in its total, not compressed), the header line and the ``states`` column."""
    from transformers import AutoConfig

    from h2o_compress import plan

    config = AutoConfig.for_model("qwen3_next", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=VOCAB,
                                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                  linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32)
    config.save_pretrained(tmp_path)
    per_sequence = 3 * ((2 * 2 * 16 + 4 * 16) * 4 * 2 + 4 * 16 * 16 * 4)  # 3 of 4 layers linear attention
    report = plan(str(tmp_path), "1GiB", batch=2, prompt_len=100, gen_len=10, bits=(16, 4), group_sizes=(32,))
    assert report.state_bytes == 2 * per_sequence and report.state_layers == 3
    assert report.fp16_cache_bytes == 2 * 109 * 1 * 2 * (32 + 32) * 2  # the one attention layer's keys and values
    for row in report.rows:
        assert row.cache.states == 2 * per_sequence and row.cache.model_states == 0
        assert row.total_bytes == row.weight_bytes + row.cache.total + row.workspace_bytes
    out = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--memory", "1GiB", "--batch", "2",
                                   "--prompt-len", "100", "--gen-len", "10", "--budgets", "1.0,0.2", "--bits", "16,4"],
                            env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "constant states (3 linear-attention/SSM/conv layers)" in out.output and "states" in out.output
    assert "1 of 4 layers" in out.output
    data = json.loads(CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--memory", "1GiB", "--json",
                                               "--budgets", "1.0", "--bits", "16"]).output)
    assert data["state_bytes"] == per_sequence and data["rows"][0]["cache"]["states"] == per_sequence


def test_unsized_state_family_and_gemma4_are_refused_in_one_line():
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModelError, match=r"'mamba' has 32 linear-attention") as refused:
        model_states(AutoConfig.for_model("mamba"))
    assert "\n" not in str(refused.value) and "qwen3_next" in str(refused.value)
    with pytest.raises(UnsupportedModelError, match="varies by layer") as refused:  # before the model is built
        resolve_model("gemma-4")
    assert "\n" not in str(refused.value)
    assert model_states(known_config("llama-2-7b")) == ()
