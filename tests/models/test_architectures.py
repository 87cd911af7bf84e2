"""The architecture matrix (issue 32): every decoder class transformers ships, as a tiny random model (2 layers,
4 heads, 2 KV heads, head_dim 32, sliding window / attention chunk 16 where it has one), is exact at budget 1.0 +
16 bits against its own ``DynamicCache(config=...)`` with eager attention over an 80-token prompt and 8 greedy
steps, or refused in one line before anything is allocated. A class transformers adds later lands in one of the
two or fails :func:`test_every_decoder_class_is_exact_or_refused` until it is listed here.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import DynamicCache

from helpers.architectures import VOCAB, WINDOW, causal_lm_types, tiny_causal_lm
from h2o_compress import CompressionConfig, UnsupportedModelError, make_cache
from h2o_compress.attention import use_h2o_attention
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.planner.sizes import cache_bytes
from h2o_compress.models import model_dims

PROMPT, STEPS = 80, 8

# No tiny model from the generic overrides (encoder-decoders, multimodal wrappers, configs that validate their own
# geometry, Mamba-only models): listed so that a new class that cannot be built is noticed, not skipped silently.
NOT_BUILT = {
    "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "blt", "cohere_compass_text", "cpmant", "dbrx",
    "dots1", "dots3_note", "emu3", "fuyu", "gemma3", "gemma3n", "gemma3n_text", "gemma4", "gemma4_assistant",
    "gemma4_text", "gemma4_unified", "gemma4_unified_assistant", "gemma4_unified_text", "git", "got_ocr2", "gpt_neo",
    "inkling2_text", "inkling_text", "lfm2_moe", "llama4", "longcat_flash", "mamba2", "marian",
    "mbart", "mllama", "moss_transcribe_diarize", "musicgen", "musicgen_melody", "mvp", "nemotron_h", "pegasus",
    "phi4_multimodal", "plbart", "prophetnet", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "qwen4_exp_text", "reformer",
    "roc_bert", "trocr", "whisper", "xlm", "zamba", "zamba2", "zaya",
}
# The model itself needs more than input ids (xmod: a language id).
OWN_INPUTS = {"xmod"}
# Refused in one line: attention outside AttentionInterface, non-attention or shared/indexed layers, or an attention
# the cache cannot follow (h2o_compress.attention.interface.UNSUPPORTED_MODEL_TYPES).
REFUSED = {
    "big_bird", "bloom", "codegen", "falcon", "gpt_neox_japanese", "gptj", "megatron-bert", "mpt",
    "openai-gpt", "rembert", "roformer", "xglm", "xlnet",  # no AttentionInterface
    "falcon_mamba", "mamba", "rwkv", "xlstm",  # no KV cache at all (and no AttentionInterface)
    "axk2", "deepseek_v32", "deepseek_v4", "dots3_note_text", "glm_moe_dsa", "hy_v4",  # indexed / compressed attention
    "diffllama", "doge",  # attention the cache cannot follow
}
# Hybrids (issue 51): linear-attention / SSM / conv layers beside attention layers (the tiny builder gives each a
# state layer first, an attention layer second); their state layers stay transformers' LinearAttentionLayer.
# Falcon-H1's layers hold both ("hybrid"): CompressedStateLayer, keys compressed, its SSM state beside them.
# MiniMax's lightning-attention states: a LinearAttentionLayer in a CompressedMiniMaxCache (its model takes no other).
# Kimi-Linear: Kimi delta attention + MLA. Nemotron-H, Zamba, Zamba2, LFM2-MoE: tests/models/test_hand_made_hybrids.py.
HYBRIDS = ["bailing_hybrid", "bamba", "falcon_h1", "granitemoehybrid", "jamba", "kimi_linear", "lfm3", "minimax",
           "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma"]
MODULE_STATES = {"recurrent_gemma"}  # keeps its recurrent and conv states in its own modules, not in the cache
# One of each layer type and attention variant, for the compressed runs below.
VARIANTS = ["mistral", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "llama4_text", "deepseek_v3", "deepseek_v2",
            "qwen3", "phi3", "smollm3",
            # issue 51: the interface without the class flag (biogpt, stablelm), KV heads tiled by the module
            # (jetmoe), one module for several cache layers (hrm_text: its stacks run 8 times, 16 cache layers)
            "biogpt", "stablelm", "jetmoe", "hrm_text",
            "moshi"]  # its mask is full causal over a step, its cache layers slide: held_window spans


def prompt(batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


def own_cache(model):
    """The model's own uncompressed cache: ``DynamicCache(config=...)``, or MiniMax's ``MiniMaxCache`` (its model
    refuses any other)."""
    if model.config.model_type == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    return DynamicCache(config=model.config)


def greedy_logits(model, ids: torch.Tensor, cache, step=None) -> torch.Tensor:
    """Logits of the prompt's last token and of ``STEPS`` greedy steps, ``[STEPS + 1, batch, vocab]``."""
    step = step or decode_step
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        out, seen = [logits], ids.shape[1]
        for _ in range(STEPS):
            token = logits.argmax(-1, keepdim=True)
            positions = torch.full((ids.shape[0], 1), seen, dtype=torch.long)
            logits = step(model, token, cache, positions)
            out.append(logits)
            seen += 1
    return torch.stack(out)


def built(model_type: str):
    model = tiny_causal_lm(model_type)
    if isinstance(model, str):
        assert model_type in NOT_BUILT, f"{model_type}: no tiny model ({model}); make the builder handle it or list it"
        pytest.skip(f"no tiny model of {model_type}: {model}")
    return model


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_every_decoder_class_is_exact_or_refused(model_type):
    if model_type in OWN_INPUTS:
        pytest.skip(f"{model_type} needs inputs of its own")
    model = built(model_type)
    try:
        cache = make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=PROMPT + STEPS + 1)
    except UnsupportedModelError as error:
        assert model_type in REFUSED, f"{model_type} refused: {error}"
        assert "\n" not in str(error) and (model_type in str(error) or type(model).__name__ in str(error))
        return
    assert model_type not in REFUSED, f"{model_type} is listed as refused but make_cache took it"
    ids = prompt()
    model.set_attn_implementation("eager")
    reference = greedy_logits(model, ids, own_cache(model))
    use_h2o_attention(model)
    ours = greedy_logits(model, ids, cache)
    assert (ours - reference).abs().max().item() < 1e-5, model_type


@pytest.mark.parametrize("model_type", VARIANTS)
def test_h2o_and_4_bits_stay_finite_within_capacity_and_window(model_type):
    model = built(model_type)
    config = CompressionConfig(budget=0.2, kv_bits=4, group_size=32)
    cache = make_cache(model, config, max_length=PROMPT + STEPS + 1)
    logits = greedy_logits(model, prompt(2), cache)
    assert torch.isfinite(logits).all()
    for layer in cache.layers:
        assert layer.kept_length() <= layer.setting.capacity <= 18
        if layer.setting.span.windowed:
            assert layer.setting.capacity <= layer.setting.span.size - 1
            held = layer.positions()
            assert int(held[held >= 0].min()) >= int(layer.setting.span.lowest(layer.counters.seen, layer.counters.first_real).min())


def _states(cache, idx: int) -> list[torch.Tensor]:
    if hasattr(cache, "linear_cache") and not hasattr(cache, "attention_layers"):  # MiniMaxCache's own list
        return [cache.linear_cache[idx]]
    layer = cache.layers[idx]
    return [t for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None]


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrid_attention_layers_compress_and_their_states_are_the_models_own(model_type, tmp_path):
    """h2o 0.2 + 4 bits on a hybrid: the attention layers hold at most their capacity, in fewer bytes than at
    budget 1.0 + 16 bits, the logits stay finite, and the state layers before the first attention layer hold exactly
    what the model's own DynamicCache holds after the prefill (nothing compressed reaches them)."""
    from transformers.cache_utils import LinearAttentionLayer

    from h2o_compress import save_cache
    from h2o_compress.utils.errors import CacheStateError

    model = built(model_type)
    ids = prompt()
    model.set_attn_implementation("eager")
    reference = own_cache(model)
    with torch.no_grad():
        model(ids, past_key_values=reference)
    caches = {}
    for budget, bits in ((1.0, 16), (0.2, 4)):
        cache = make_cache(model, CompressionConfig(budget=budget, kv_bits=bits, group_size=32),
                           max_length=PROMPT + STEPS + 1)
        assert torch.isfinite(greedy_logits(model, ids, cache)).all()
        caches[budget] = cache
    small, whole = caches[0.2], caches[1.0]
    first = next(i for i, layer in enumerate(small.layers) if not isinstance(layer, LinearAttentionLayer))
    first = first or 1  # Falcon-H1 (state and keys in every layer): layer 0's state comes from the inputs alone
    assert small.attention_layers and small.state_layers
    assert all(layer.kept_length() <= layer.setting.capacity <= 18 for layer in small.attention_layers)
    assert small.nbytes() < whole.nbytes() and small.state_nbytes() == whole.state_nbytes()
    assert (small.state_nbytes() > 0) == (model_type not in MODULE_STATES)
    prefilled = make_cache(model, CompressionConfig(budget=0.2, kv_bits=4, group_size=32), max_length=PROMPT)
    with torch.no_grad():
        model(ids, past_key_values=prefilled)
    for idx in range(first):
        ours, theirs = _states(prefilled, idx), _states(reference, idx)
        assert [torch.equal(a, b) for a, b in zip(ours, theirs)] == [True] * len(theirs)
    with pytest.raises(CacheStateError, match="saving a cache with linear-attention/SSM states is not supported"):
        save_cache(small, tmp_path / "cache.safetensors")


def test_sliding_layers_hold_no_more_than_dynamic_cache_and_plan_agrees():
    """A tiny Gemma 3 (sliding window 16; its 2 layers are both sliding, the 6th would be full) at budget 1.0: each
    sliding layer holds what transformers' DynamicSlidingWindowLayer holds (window - 1 tokens), and the planner's
    bytes are the cache's."""
    model = built("gemma3_text")
    assert model.config.layer_types == ["sliding_attention"] * 2
    ids = prompt()
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=reference)
    max_length = PROMPT + STEPS + 1
    cache = make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=max_length)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    for ours, theirs in zip(cache.layers, reference.layers):
        assert ours.kept_length() <= theirs.keys.shape[2]
    assert [layer.kept_length() for layer in cache.layers] == [WINDOW - 1] * 2
    planned = cache_bytes(model_dims(model.config), cache.config, 1, PROMPT, max_length=max_length,
                          kv_dtype=torch.float32)
    assert planned.total == cache.nbytes()
    full_only = cache_bytes(model_dims(model.config).__class__(2, 4, 2, 32), cache.config, 1, PROMPT,
                            max_length=max_length, kv_dtype=torch.float32)
    assert planned.total < full_only.total  # the sliding layer really holds less


@pytest.mark.parametrize("model_type", ["mistral", "gemma2"])
def test_compiled_step_matches_eager_for_sliding_and_softcap(model_type):
    model = built(model_type)
    config = CompressionConfig(budget=0.3, kv_bits=8, residual=2)
    eager = greedy_logits(model, prompt(), make_cache(model, config, max_length=PROMPT + STEPS + 1))
    torch._dynamo.reset()
    compiled_step = torch.compile(decode_step, fullgraph=True, backend="eager")
    compiled = greedy_logits(model, prompt(), make_cache(model, config, max_length=PROMPT + STEPS + 1), compiled_step)
    assert (compiled - eager).abs().max().item() < 1e-5


def test_softcap_and_sink_layers_decode_in_torch_and_say_so():
    for model_type in ("gemma2", "gpt_oss"):
        model = built(model_type)
        cache = make_cache(model, CompressionConfig(budget=1.0, kv_bits=16, attention_kernel="auto"), max_length=96)
        greedy_logits(model, prompt(), cache)
        assert cache.decode_kernel == "torch"


@pytest.mark.parametrize("model_type", ["llama4_text", "mistral", "gemma2", "gpt_oss"])
def test_left_padded_batch_is_exact_on_chunked_sliding_softcap_and_sinks(model_type):
    """A left-padded batch (chunks counted from each sequence's first real token, as transformers' chunked mask)."""
    model = built(model_type)
    ids = prompt(2)[:, :40]
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :5] = 0

    def run(cache):
        seen, logits = mask.clone(), []
        with torch.no_grad():
            out = model(ids, attention_mask=seen, past_key_values=cache).logits[:, -1]
            for _ in range(6):
                logits.append(out)
                seen = torch.cat((seen, torch.ones(2, 1, dtype=torch.long)), 1)
                out = model(out.argmax(-1, keepdim=True), attention_mask=seen, past_key_values=cache).logits[:, -1]
        return torch.stack(logits)

    cache = make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=47)
    model.set_attn_implementation("eager")
    reference = run(DynamicCache(config=model.config))
    use_h2o_attention(model)
    assert (run(cache) - reference).abs().max().item() < 1e-5


@pytest.mark.parametrize("model_type,fragment", [
    ("gemma3n_text", "has layers of type dummy (KV shared with another layer)"),
    ("gemma4_text", "has an attention geometry that varies by layer"),
    ("deepseek_v32", "has layers of type indexed_attention (KV shared between layers, indexed or compressed"),
])
def test_shared_kv_per_layer_geometry_and_hybrids_are_refused_from_the_config(model_type, fragment):
    """Models the tiny builder cannot make are refused from their config (make_cache and the planner read it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with pytest.raises(UnsupportedModelError, match=re.escape(f"model type '{model_type}' {fragment}")) as error:
        model_dims(CONFIG_MAPPING[model_type]())
    assert "\n" not in str(error.value)


def test_refusals_of_unreadable_layer_types_and_of_variants_on_a_fast_kernel():
    """Each one line: layer types that do not match the layer count or lack a window, values wider than keys,
    and a soft-cap reaching a layer whose decode kernel cannot run it."""
    from transformers import MistralConfig

    from h2o_compress.attention.variant import AttentionVariant
    from h2o_compress.cache.span import layer_spans
    from h2o_compress.cache.state import pad_values

    config = MistralConfig(num_hidden_layers=2, sliding_window=None, layer_types=["full_attention"] * 2)
    with pytest.raises(UnsupportedModelError, match="declares 2 layer types for 3 layers"):
        layer_spans(config, 3)
    config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="a sliding_attention layer without a window size"):
        layer_spans(config, 2)
    with pytest.raises(UnsupportedModelError, match="values of head dim 48 wider than the keys' 32"):
        pad_values(torch.zeros(1, 2, 3, 48), 32, 0)
    with pytest.raises(UnsupportedModelError, match="soft-cap or sink logits, which the cpu decode kernel"):
        AttentionVariant.from_call({"softcap": 50.0}, "cpu", 0)
    assert AttentionVariant.from_call({"softcap": 50.0}) == AttentionVariant(50.0)


def test_minimax_gets_its_own_cache_class_and_a_sliding_window_is_refused():
    """MiniMax takes no cache but a MiniMaxCache: make_cache builds a CompressedCache of that class. Its mask would
    slide over layers that its layer types hold whole where ``sliding_window`` is set: refused in one line."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    from h2o_compress.cache import CompressedCache

    model = built("minimax")
    cache = make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=PROMPT)
    assert isinstance(cache, MiniMaxCache) and isinstance(cache, CompressedCache)
    assert cache.get_linear_cache(0) is None and len(cache) == 2
    model.config.sliding_window = WINDOW
    with pytest.raises(UnsupportedModelError, match="model type 'minimax' with sliding_window=16 is not supported"):
        make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=PROMPT)


def test_moshi_prefilled_in_chunks_sees_what_its_sliding_cache_held():
    """Moshi masks each step full causal while its DynamicCache's layers slide (the last 15 tokens kept between
    steps): a prompt fed in 3 chunks of 40, 25 and 15 tokens (the second and third see the 15 held tokens and
    their own, not a window per query), then 4 greedy steps, exact at budget 1.0."""
    model = built("moshi")
    ids = prompt()

    def run(cache):
        with torch.no_grad():
            for start, stop in ((0, 40), (40, 65), (65, 80)):
                logits = model(ids[:, start:stop], past_key_values=cache).logits[:, -1]
            out = [logits]
            for _ in range(4):
                out.append(model(out[-1].argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1])
        return torch.stack(out)

    model.set_attn_implementation("eager")
    reference = run(DynamicCache(config=model.config))
    cache = make_cache(model, CompressionConfig(budget=1.0, kv_bits=16), max_length=PROMPT + 4)
    assert {span.kind for span in model_dims(model.config).spans} == {"held_window"}
    assert (run(cache) - reference).abs().max().item() < 1e-5
    assert [layer.kept_length() for layer in cache.layers] == [WINDOW - 1] * 2
