"""KVzip's reconstruction scores (:func:`h2o_compress.runtime.context_scores.reconstruction_scores`) from the one
pass (output and per-key maxima from one softmax, no probabilities materialized) equal those of transformers' eager
attention with ``output_attentions``, on a plain GQA model, one with sliding-window layers (the mask), and models
whose softmax has a soft-cap or sink logits (which fall back to the eager pass)."""

from __future__ import annotations

import pytest
import torch
from helpers.architectures import tiny_causal_lm
from helpers.tiny_lm import english_tokenizer, tiny_lm

from h2o_compress.evaluation import default_corpus
from h2o_compress.runtime import context_scores


@pytest.mark.parametrize("model_type, falls_back", [
    ("llama", False),  # GQA, full attention
    ("mistral", False),  # a sliding window shorter than the pass (the mask holds it)
    ("gemma2", True),  # logit soft-cap
    ("gpt_oss", True),  # learned sink logits
])
@torch.inference_mode()
def test_one_pass_reconstruction_scores_equal_the_eager_ones(monkeypatch, model_type, falls_back):
    if model_type == "llama":
        model, tokenizer = tiny_lm()
    else:
        model, tokenizer = tiny_causal_lm(model_type), english_tokenizer()
        if isinstance(model, str):
            pytest.skip(f"no tiny {model_type}: {model}")
        if model_type == "mistral":
            model.config.sliding_window = 24
    model.set_attn_implementation("sdpa" if getattr(model, "_supports_sdpa", False) else "eager")
    ids = tokenizer(default_corpus()[:300], return_tensors="pt").input_ids[:, :60]
    eager_calls = []
    eager = context_scores._eager_reconstruction_scores
    monkeypatch.setattr(context_scores, "_eager_reconstruction_scores",
                        lambda *args: eager_calls.append(1) or eager(*args))
    scores = context_scores.reconstruction_scores(model, tokenizer, ids)
    assert bool(eager_calls) == falls_back
    repeat, body = context_scores._reconstruction_prompt(tokenizer, ids)
    expected = eager(model, ids, torch.cat((repeat.expand(1, -1), body), dim=1))
    assert len(scores) == len(expected) == model.config.num_hidden_layers
    for got, want in zip(scores, expected, strict=True):
        assert got.shape == want.shape == (1, model.config.num_key_value_heads, ids.shape[1])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert model.config._attn_implementation in ("sdpa", "eager")  # restored
    assert not context_scores._maxima  # nothing held after the pass
