"""Issue 51 (1): multi-head latent attention (DeepSeek-V2 and V3) on the configs the architecture matrix does not
build: KV head counts 1, 2 and 4 under 4 query heads, 0 to 2 dense layers before the MoE ones, q_lora on and off,
and latents as wide as, narrower or wider than the rotary key.

- At budget 1.0 + 16 bits the logits of a prompt and greedy steps are the model's own with ``DynamicCache`` and
  eager attention. transformers' eager and SDPA attention repeat the keys the module expanded (one per query head)
  ``num_attention_heads / num_key_value_heads`` times again and fail with any cache where that is above 1; the
  reference then runs the same model with one key per query head (``num_key_value_groups = 1``, as flash
  attention runs it), which is what the compressed cache computes.
- Compressed (H2O, budget 0.2, 4 bits) the logits are finite and each layer holds at most its capacity.
- The latent store keeps the latents and the rotary keys at their own widths, and ``cache.nbytes()`` is the
  planner's ``cache_bytes``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, DynamicCache

from h2o_compress import CompressionConfig, ModelLoadError, UnsupportedModelError, make_cache
from h2o_compress.models import model_dims
from h2o_compress.planner.sizes import cache_bytes

VOCAB, PROMPT, STEPS = 256, 40, 4
CLASSES = {"v2": DeepseekV2Config, "v3": DeepseekV3Config}
# The V3 config (2 KV heads, both layers dense); its V2 config has 4 KV heads and 4 dense layers.
BASE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
            first_k_dense_replace=2, moe_intermediate_size=64, n_group=1, topk_group=1, vocab_size=VOCAB,
            intermediate_size=256, num_hidden_layers=2)
CASES = {
    "issue-v3": ("v3", {}),
    "issue-v2": ("v2", dict(num_key_value_heads=4, first_k_dense_replace=4)),
    **{f"{version}-kv{kv}-dense{dense}-q{q}": (version, dict(num_key_value_heads=kv, first_k_dense_replace=dense,
                                                             q_lora_rank=q))
       for version in CLASSES for kv, dense, q in ((1, 0, None), (2, 1, 16), (4, 2, None), (1, 1, 16), (4, 0, 16))},
    # latents narrower than the rotary key, and wider
    "v3-rope-wider": ("v3", dict(kv_lora_rank=32, qk_rope_head_dim=64)),
    "v2-rope-narrower": ("v2", dict(kv_lora_rank=64, qk_rope_head_dim=32, num_key_value_heads=1)),
    "v3-rope-16": ("v3", dict(qk_rope_head_dim=16, q_lora_rank=16)),
    # one query head; two query heads of one KV head
    "v3-heads1": ("v3", dict(num_attention_heads=1, num_key_value_heads=1, first_k_dense_replace=0)),
    "v2-heads2-kv1": ("v2", dict(num_attention_heads=2, num_key_value_heads=1, q_lora_rank=16)),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(case: str):
    version, overrides = CASES[case]
    torch.manual_seed(0)
    config = CLASSES[version](**{**BASE, **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def greedy_logits(model, cache, batch: int = 1) -> torch.Tensor:
    """Logits of the prompt's last token and of ``STEPS`` greedy steps, ``[STEPS + 1, batch, vocab]``."""
    ids = torch.randint(3, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        out = [logits]
        for _ in range(STEPS):
            logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return torch.stack(out)


def reference_logits(model) -> torch.Tensor:
    """`greedy_logits` of a copy of ``model`` with ``DynamicCache`` and eager attention, one key per query head."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    for module in model.modules():
        if hasattr(module, "expand_kv"):
            module.num_key_value_groups = 1
    return greedy_logits(model, DynamicCache(config=model.config))


@pytest.mark.parametrize("case", list(CASES))
def test_budget_1_is_the_models_own_dynamic_cache(case):
    model = tiny(case)
    reference = reference_logits(model)
    cache = make_cache(model, CompressionConfig(policy="full"), max_length=PROMPT + STEPS + 1)
    ours = greedy_logits(model, cache)
    assert cache.decode_kernel == "torch"
    assert (ours - reference).abs().max().item() < 1e-5, case


@pytest.mark.parametrize("case", ["issue-v3", "issue-v2", "v3-kv1-dense0-qNone", "v2-kv2-dense1-q16",
                                  "v3-rope-wider", "v2-rope-narrower", "v3-heads1", "v2-heads2-kv1"])
def test_h2o_4_bits_is_finite_and_evicts(case):
    model = tiny(case)
    config = CompressionConfig(policy="h2o", budget=0.2, kv_bits=4, group_size=32)
    cache = make_cache(model, config, max_length=PROMPT + STEPS + 1)
    logits = greedy_logits(model, cache, batch=2)
    assert torch.isfinite(logits).all()
    for layer in cache.layers:
        assert layer.kept_length() <= layer.setting.capacity < PROMPT


@pytest.mark.parametrize("case", ["issue-v3", "v3-rope-wider", "v2-rope-narrower"])
@pytest.mark.parametrize("config", [CompressionConfig(budget=1.0, kv_bits=16),
                                    CompressionConfig(policy="h2o", budget=0.3, kv_bits=4, group_size=32, residual=2)],
                         ids=["16bit", "h2o-4bit"])
def test_latents_are_held_at_their_own_widths_and_planned_exactly(case, config):
    model = tiny(case)
    cache = make_cache(model, config, max_length=PROMPT + STEPS + 1)
    greedy_logits(model, cache)
    dims = model_dims(model.config)
    rank, rope = model.config.kv_lora_rank, model.config.qk_rope_head_dim
    assert (dims.kv_heads, dims.head_dim, dims.value_head_dim or dims.head_dim) == (1, rank, rope)
    for layer in cache.layers:
        assert layer.store.keys.parts[next(iter(layer.store.keys.parts))].shape[-1] <= rank
        assert layer.geometry.value_dim == rope
        if layer.ring is not None:
            assert layer.ring.values.shape[-1] == rope
    planned = cache_bytes(dims, cache.config, 1, PROMPT, STEPS, max_length=PROMPT + STEPS + 1,
                          kv_dtype=torch.float32)
    assert planned.total == cache.nbytes()


@pytest.mark.parametrize("version", list(CLASSES))
def test_kv_heads_that_do_not_divide_the_query_heads_are_refused_before_any_work(version):
    """transformers builds the model (3 KV heads under 4 query heads); make_cache refuses it in one line."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CLASSES[version](**{**BASE, "num_key_value_heads": 3}))
    with pytest.raises(ModelLoadError, match="num_key_value_heads=3 does not divide num_attention_heads=4") as error:
        make_cache(model, CompressionConfig(policy="h2o", budget=0.2, kv_bits=4), max_length=PROMPT + STEPS + 1)
    assert "\n" not in str(error.value)
    assert model.config._attn_implementation != "h2o_compress"  # nothing was switched


def test_a_layer_built_without_the_value_width_pads_to_the_keys_and_refuses_wider_values():
    """A hand-built layer (no value_dim) holds narrower values zero-padded to the keys' head dim, as before, and
    refuses wider ones in one line; build_layers with the model's value head dim holds them at their width."""
    from h2o_compress.attention import withdraw
    from h2o_compress.cache import build_layers

    config = CompressionConfig(budget=1.0, kv_bits=16)
    (padded,) = build_layers(config, 1, 32, None, max_tokens=8)
    keys, values = torch.randn(1, 1, 3, 32), torch.randn(1, 1, 3, 16)
    _, read = padded.update(keys, values)
    withdraw(0)  # no attention call follows: nothing stays announced for a later model's layer 0
    assert read.shape[-1] == 16 and padded.geometry.value_dim == 32 and torch.equal(read, values)
    (own,) = build_layers(config, 1, 32, None, max_tokens=8, value_dim=64)
    _, read = own.update(keys, torch.randn(1, 1, 3, 64))
    withdraw(0)
    assert own.geometry.value_dim == 64 and read.shape[-1] == 64
    (narrow,) = build_layers(config, 1, 32, None, max_tokens=8)
    with pytest.raises(UnsupportedModelError, match="values of head dim 64 wider than the keys' 32"):
        narrow.update(keys, torch.randn(1, 1, 3, 64))
