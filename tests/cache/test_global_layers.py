"""Global layer budgets (``layer_budgets="global"``, KVzip's allocation): the layers of a compress-then-ask cache
sized by one ranking of the scoring pass over the whole model, under the uniform split's total bytes."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import TINY_MODELS
from helpers.tiny_lm import save_tiny_lm, tiny_lm
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, ConfigError, compress, generate, make_cache
from h2o_compress.cli import app
from h2o_compress.runtime.context_scores import global_layer_capacities, score_context
from h2o_compress.runtime.generation import encode_prompt, make_scored_cache
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes
from h2o_compress.policies import make_policy
from h2o_compress.evaluation import default_corpus

TEXT = default_corpus()[:1200]


def test_capacities_are_each_layers_share_of_the_top_entries():
    """Hand-made scores: layer 0 outranks everything, layer 1 has 4 good tokens per head, layer 2 none. The 18 best
    entries (3 layers x 2 heads x capacity 3) are 18 of layer 0's 20: shares [9, 0, 0]; each layer keeps the
    floor, and the total is taken back from layer 0."""
    scores = [torch.full((1, 2, 10), 1.0), torch.full((1, 2, 10), 0.01), torch.zeros(1, 2, 10)]
    scores[1][..., :4] = 0.5
    assert global_layer_capacities(scores, capacity=3, floor=1) == [7, 1, 1]
    scores[0][..., 5:] = 0.0  # layer 0: 5 tokens per head (10 entries), then layer 1's 8: 18 exactly
    caps = global_layer_capacities(scores, capacity=3, floor=1)  # shares [5, 4, 0]; the floor's token from layer 0
    assert caps == [4, 4, 1]
    batch = [torch.cat([s, s.flip(0)]) for s in scores]  # a second sequence ranks alike: the same shares
    assert global_layer_capacities(batch, capacity=3, floor=1) == caps


def test_capacities_always_sum_to_the_uniform_total_within_bounds():
    rng = random.Random(0)
    for trial in range(200):
        layers, heads, tokens = rng.randint(2, 6), rng.randint(1, 3), rng.randint(4, 40)
        capacity = rng.randint(1, tokens)
        floor, ceiling = rng.randint(1, capacity), rng.randint(capacity, tokens)
        gen, batch, power = torch.Generator().manual_seed(trial), rng.randint(1, 2), rng.choice([1, 8])
        scores = [torch.rand(batch, heads, tokens, generator=gen) ** power for _ in range(layers)]
        caps = global_layer_capacities(scores, capacity, floor, ceiling)
        assert sum(caps) == layers * capacity, (trial, caps)
        assert all(floor <= c <= ceiling for c in caps), (trial, caps)


@pytest.mark.parametrize("heads,high_bits", [("uniform", 0.0), ("adaptive", 0.0), ("uniform", 0.3), ("adaptive", 0.3)])
def test_compress_sizes_the_layers_by_the_scores_and_keeps_uniforms_bytes(heads, high_bits):
    """``compress`` with ``kvzip`` + global budgets: each layer's capacity is what the scores give, the prefill keeps
    the top of its layer's scores, the total bytes equal the uniform split's and the planner's to the byte, and
    the layers really differ (with mixed precision: their 8-bit rows too, the uniform layers' total)."""
    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="kvzip", budget=0.25, heavy_ratio=0.9, kv_bits=4, layer_budgets="global",
                               head_budgets=heads, high_bits_fraction=high_bits)
    context = compress(model, tokenizer, TEXT, config, chat=False)
    ids = encode_prompt(tokenizer, TEXT, False)
    tokens = ids.shape[1]
    capacity = config.capacity(tokens)
    scores = score_context(model, tokenizer, ids, make_policy("kvzip", 0.9))
    expected = global_layer_capacities(scores, capacity, config.min_layer_capacity(capacity), tokens)
    cache = context.cache
    assert cache.capacities == expected and sum(expected) == capacity * len(expected)
    assert len(set(expected)) > 1
    uniform = compress(model, tokenizer, TEXT, CompressionConfig(**{**config.to_dict(), "layer_budgets": "uniform"}),
                       chat=False).cache
    assert cache.nbytes() == uniform.nbytes() == cache.storage_nbytes()
    planned = cache_bytes(model_dims(model.config), config, batch=1, prompt_len=tokens, max_length=tokens,
                          kv_dtype=torch.float32)
    assert planned.total == cache.nbytes()
    if high_bits:
        rows = [layer.store.refine.slots.shape[2] for layer in cache.layers]
        assert len(set(rows)) > 1 and sum(rows) == sum(layer.store.refine.slots.shape[2] for layer in uniform.layers)
        assert all(0 < layer.store.refine.in_use(layer.store.positions).sum() for layer in cache.layers)
    if heads == "uniform":
        for layer, layer_scores, layer_capacity in zip(cache.layers, scores, expected):
            heavy = layer.setting.policy.heavy(layer_capacity)
            recent = set(range(tokens - (layer_capacity - heavy), tokens))
            for head, kept in enumerate(layer.positions()[0]):
                ranked = [p for p in layer_scores[0, head].argsort(descending=True, stable=True).tolist()
                          if p not in recent][:heavy]
                assert set(kept.tolist()) == set(ranked) | recent


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_budget_at_the_length_equals_the_full_cache(arch):
    """Every layer given the whole prompt: the scored, globally sized cache answers exactly as the full cache."""
    model = TINY_MODELS[arch]()

    class CharTokenizer:
        chat_template = None

        def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
            from types import SimpleNamespace

            return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 100 for c in text]]))

    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(1))
    config = CompressionConfig(policy="lookahead", budget=48, layer_budgets="global")
    with torch.inference_mode():
        cache = make_scored_cache(model, CharTokenizer(), ids, config, 48)
        assert cache.capacities == [48] * len(cache.layers)  # the whole length: nothing to spread
        ours = model(input_ids=ids, past_key_values=cache).logits
        full = model(input_ids=ids, past_key_values=make_cache(model, CompressionConfig(policy="full"))).logits
    torch.testing.assert_close(ours, full, atol=1e-5, rtol=1e-5)


def test_generate_and_save_load_keep_the_scored_layers(tmp_path):
    """``generate`` sizes the layers from the prompt's scores too; a compressed context saved and loaded keeps its
    layers' capacities and answers the same."""
    from h2o_compress import ask
    from h2o_compress.runtime.ask import CompressedContext

    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="lookahead", budget=0.25, heavy_ratio=0.9, kv_bits=4, layer_budgets="global")
    cache = make_scored_cache(model, tokenizer, encode_prompt(tokenizer, TEXT[:600], False), config, 400,
                              question_in_prompt=True)
    assert len(set(cache.capacities)) > 1 and sum(cache.capacities) == cache.capacity * len(cache.layers)
    assert generate(model, tokenizer, TEXT[:600], config, max_new_tokens=4, chat=False).new_tokens >= 1
    context = compress(model, tokenizer, TEXT, config, chat=False)
    context.save(tmp_path / "ctx.safetensors")
    loaded = CompressedContext.load(tmp_path / "ctx.safetensors", model, tokenizer, TEXT, chat=False)
    assert loaded.cache.capacities == context.cache.capacities
    assert ask(model, tokenizer, loaded, "Who?", max_new_tokens=4).token_ids == \
        ask(model, tokenizer, context, "Who?", max_new_tokens=4).token_ids


def test_bad_global_settings_are_refused():
    with pytest.raises(ConfigError, match="layer_budgets='global' with policy='h2o'.*allowed policies: snapkv, kvzip, lookahead"):
        CompressionConfig(policy="h2o", budget=0.2, layer_budgets="global")
    model, _ = tiny_lm()
    config = CompressionConfig(policy="kvzip", budget=10, layer_budgets="global")
    layers = len(make_cache(model, config).layers)
    with pytest.raises(ConfigError, match=f"allowed: {layers} integers >= 1"):
        make_cache(model, config, layer_capacities=[10])
    with pytest.raises(ConfigError, match="only with layer_budgets 'global'"):
        make_cache(model, CompressionConfig(policy="kvzip", budget=10), layer_capacities=[10] * layers)


def test_cli_ask_takes_global_layer_budgets(tmp_path):
    model_dir = save_tiny_lm(tmp_path / "model")
    document = tmp_path / "doc.txt"
    document.write_text(TEXT[:600])
    result = CliRunner().invoke(app, ["ask", "--model", model_dir, "--no-chat", "--context-file", str(document),
                                      "--question", "Who?", "--max-new-tokens", "2", "--policy", "kvzip",
                                      "--layer-budgets", "global", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["layer_budgets"] == "global"
    refused = CliRunner().invoke(app, ["ask", "--model", model_dir, "--no-chat", "--context-file", str(document),
                                       "--question", "Who?", "--policy", "h2o", "--layer-budgets", "global"])
    assert refused.exit_code != 0 and "allowed policies: snapkv, kvzip, lookahead" in refused.output


def test_sinks_rank_first_and_the_floor_needs_no_recent_window_at_heavy_ratio_1():
    """KVzip's own setting (``heavy_ratio=1``, 4 sinks; kvpress's ``KVzipPress(n_sink=4)``): the sinks of every layer
    are counted first, so a layer whose other scores are all 0 still gets them; the floor is the sinks, not the
    capacity that leaves a recent window (which at heavy ratio 1 would be the whole capacity: uniform)."""
    scores = [torch.full((1, 1, 10), 1.0), torch.zeros(1, 1, 10)]
    assert global_layer_capacities(scores, capacity=3, floor=1) == [5, 1]
    assert global_layer_capacities(scores, capacity=3, floor=1, sinks=2) == [4, 2]
    kvzip = CompressionConfig(policy="kvzip", budget=0.2, heavy_ratio=1.0, sink_tokens=4, layer_budgets="global")
    assert kvzip.min_layer_capacity(100) == 4
    assert CompressionConfig(policy="kvzip", budget=0.2, heavy_ratio=1.0).min_layer_capacity(100) == 1
    assert CompressionConfig(policy="kvzip", budget=0.2, heavy_ratio=0.99, sink_tokens=4).min_layer_capacity(100) == 5


def test_heavy_ratio_below_1_always_leaves_one_recent_token():
    for ratio, capacity, sinks, heavy in [(0.99, 20, 0, 19), (0.9, 4, 0, 3), (0.99, 6, 4, 1), (0.5, 10, 0, 5),
                                          (1.0, 20, 0, 20), (0.99, 4, 4, 0), (0.0, 5, 0, 0)]:
        policy = make_policy("h2o", heavy_ratio=ratio, sink_tokens=sinks)
        assert policy.heavy(capacity) == heavy, (ratio, capacity, sinks)
        assert policy.recent_window(capacity) == capacity - min(sinks, capacity) - heavy


def test_compress_then_ask_takes_heavy_ratio_1_where_decoding_refuses_it(tmp_path):
    """No recent window is KVzip's setting for a context compressed once (``compress``, ``ask``, ``eval needle
    --protocol compress-then-ask``): nothing is evicted afterwards. ``generate`` still refuses it."""
    from h2o_compress.config import check_usable

    config = CompressionConfig(policy="kvzip", budget=0.25, heavy_ratio=1.0, sink_tokens=4, kv_bits=4,
                               layer_budgets="global", head_budgets="adaptive")
    assert check_usable(config, 30, frozen=True) is config
    with pytest.raises(ConfigError, match="heavy_ratio=1.0 leaves no recent window"):
        check_usable(config, 30)
    model, tokenizer = tiny_lm()
    context = compress(model, tokenizer, TEXT[:400], config, chat=False)
    caps = context.cache.capacities
    assert sum(caps) == len(caps) * context.cache.capacity and min(caps) >= 4
    for layer in context.cache.layers:  # every head keeps its 4 sinks, and no more than its layer's share
        positions = layer.store.head_positions()[0]
        for head in range(positions.shape[0]):
            assert set(range(4)) <= set(positions[head][positions[head] >= 0].tolist())
    model_dir = save_tiny_lm(tmp_path / "model")
    document = tmp_path / "doc.txt"
    document.write_text(TEXT[:600])
    flags = ["--model", model_dir, "--policy", "kvzip", "--budget", "0.25", "--heavy-ratio", "1", "--sink-tokens", "4"]
    result = CliRunner().invoke(app, ["ask", *flags, "--no-chat", "--context-file", str(document), "--question", "Who?",
                                      "--max-new-tokens", "2", "--json"])
    assert result.exit_code == 0, result.output
    refused = CliRunner().invoke(app, ["generate", *flags, "--max-new-tokens", "2", "Hello"])
    assert refused.exit_code != 0 and "leaves no recent window" in refused.output


def test_mixed_precision_global_layers_save_load_and_answer_alike(tmp_path):
    """Global layers with 8-bit rows: a saved context loads with each layer's rows and answers the same."""
    from h2o_compress import ask
    from h2o_compress.runtime.ask import CompressedContext

    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="kvzip", budget=0.25, heavy_ratio=1.0, sink_tokens=2, kv_bits=4,
                               layer_budgets="global", head_budgets="adaptive", high_bits_fraction=0.25)
    context = compress(model, tokenizer, TEXT, config, chat=False)
    context.save(tmp_path / "ctx.safetensors")
    loaded = CompressedContext.load(tmp_path / "ctx.safetensors", model, tokenizer, TEXT, chat=False)
    assert [layer.store.refine.slots.shape for layer in loaded.cache.layers] == \
        [layer.store.refine.slots.shape for layer in context.cache.layers]
    assert ask(model, tokenizer, loaded, "Who?", max_new_tokens=4).token_ids == \
        ask(model, tokenizer, context, "Who?", max_new_tokens=4).token_ids
