"""Issue 47 (5, 6): saved caches and compress-then-ask on every layer type and attention variant the architecture
matrix runs (tests/models/test_architectures.py: sliding, sliding + full, soft-cap, sink logits, chunked + no-RoPE,
MLA latents and expanded MLA, full, no-RoPE), as tiny random models (window / chunk 16).

- A cache saved by ``save_cache`` and loaded by ``load_cache`` continues with the same greedy tokens and logits as
  the cache in memory, and decodes with the same kernel, at budget 1.0 + 16 bits and compressed (the loaded layers
  are the layers ``make_cache`` builds: their spans, and the torch decode of soft-cap, sinks and MLA).
- ``ask`` runs with its defaults (kvzip scoring, global layer budgets, adaptive heads), and a compressed context
  saved and loaded answers the same tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.architectures import VOCAB, WINDOW, tiny_causal_lm
from helpers.tiny_lm import english_tokenizer

from h2o_compress import ASK_DEFAULTS, CompressionConfig, ask, compress, make_cache
from h2o_compress.evaluation import default_corpus
from h2o_compress.persistence import load_cache, save_cache
from h2o_compress.runtime.ask import CompressedContext
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.runtime.context_scores import reconstruction_scores

# One of each layer type and attention variant (the matrix's VARIANTS).
VARIANTS = ["mistral", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "llama4_text", "deepseek_v3", "deepseek_v2",
            "qwen3", "phi3", "smollm3"]
PROMPT, STEPS = 40, 6
SETTINGS = {"budget-1.0-16bit": CompressionConfig(budget=1.0, kv_bits=16),
            "h2o-0.3-4bit": CompressionConfig(budget=0.3, kv_bits=4, residual=2)}
CONTEXT = default_corpus()[:160]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.lru_cache(maxsize=None)
def model_of(model_type: str):
    model = tiny_causal_lm(model_type)
    assert not isinstance(model, str), model
    return model


@torch.no_grad()
def continue_greedily(model, cache, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``STEPS`` greedy tokens ``[1, STEPS]`` from ``logits`` through ``cache``, and the logits of each step."""
    tokens, out, seen = [], [], int(cache.get_seq_length())
    for _ in range(STEPS):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        logits = decode_step(model, token, cache, torch.full((1, 1), seen, dtype=torch.long))
        out.append(logits)
        seen += 1
    return torch.cat(tokens, 1), torch.stack(out)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("model_type", VARIANTS)
def test_a_saved_cache_of_every_layer_type_continues_like_the_cache_in_memory(model_type, setting, tmp_path):
    model = model_of(model_type)
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = make_cache(model, SETTINGS[setting], max_length=PROMPT + STEPS + 1)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[:, -1]
    path = save_cache(cache, tmp_path / "cache.safetensors", model=model)
    loaded = load_cache(path, model)
    assert [layer.setting.capacity for layer in loaded.layers] == [layer.setting.capacity for layer in cache.layers]
    assert [layer.setting.span for layer in loaded.layers] == [layer.setting.span for layer in cache.layers]
    tokens, steps = continue_greedily(model, cache, logits)
    loaded_tokens, loaded_steps = continue_greedily(model, loaded, logits)
    assert loaded.decode_kernel == cache.decode_kernel
    assert torch.equal(loaded_tokens, tokens), (model_type, loaded_tokens, tokens)
    assert (loaded_steps - steps).abs().max().item() <= 1e-6


@pytest.mark.parametrize("model_type", VARIANTS)
def test_ask_runs_with_its_defaults_on_every_layer_type_and_a_saved_context_answers_the_same(model_type, tmp_path):
    model, tokenizer = model_of(model_type), english_tokenizer()
    context = compress(model, tokenizer, CONTEXT, ASK_DEFAULTS, chat=False)
    for layer in context.cache.layers:  # adaptive heads: kv_heads x capacity per sequence; no more than a window
        assert int(layer.kept_per_head().sum(-1).max()) <= layer.geometry.kv_heads * layer.setting.capacity
        assert layer.setting.capacity <= layer.setting.span.cap(context.tokens)
        assert not layer.setting.span.windowed or layer.kept_length() <= layer.setting.span.size - 1
    answer = ask(model, tokenizer, context, "Who?", max_new_tokens=4)
    assert 1 <= answer.new_tokens <= 4  # a random model may end with its EOS
    context.save(tmp_path / "context.safetensors")
    loaded = CompressedContext.load(tmp_path / "context.safetensors", model, tokenizer, CONTEXT, chat=False)
    assert ask(model, tokenizer, loaded, "Who?", max_new_tokens=4).token_ids == answer.token_ids


@pytest.mark.parametrize("model_type", ["mistral", "llama4_text"])
def test_kvzip_scores_of_a_windowed_layer_are_those_of_the_tokens_its_queries_see(model_type):
    """Scores are per context position: a sliding layer's reconstruction queries (from position ``tokens`` on) see
    only the last ``window - 1`` context tokens, so the earlier ones score 0 (a chunked layer: those of the last
    chunk); a full layer scores every token."""
    model = model_of(model_type)
    ids = torch.randint(3, VOCAB, (1, 50), generator=torch.Generator().manual_seed(2))
    scores = reconstruction_scores(model, english_tokenizer(), ids)
    for layer_scores, span in zip(scores, (layer.setting.span for layer in make_cache(model).layers)):
        assert layer_scores.shape == (1, 2, 50)
        if span.windowed:
            first_seen = 50 - WINDOW + 1 if span.kind == "sliding" else 50 // WINDOW * WINDOW
            assert bool((layer_scores[..., :first_seen] == 0).all()) and bool((layer_scores[..., first_seen:] > 0).all())
        else:
            assert bool((layer_scores > 0).all())
