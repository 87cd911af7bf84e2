"""Streaming perplexity: the maths on a model with known probabilities, and the cache semantics on a tiny LLaMA."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tiny_lm import tiny_lm, one_thread  # noqa: F401 (fixture)

from h2o_compress import CompressionConfig
from h2o_compress.utils.errors import ConfigError, InputError
from h2o_compress.evaluation import reference_perplexity, streaming_perplexity, text_perplexity
from h2o_compress.evaluation.perplexity import stream_nll

pytestmark = pytest.mark.usefixtures("one_thread")


def bigram_step(table: torch.Tensor):
    """A stateless 'model' whose next-token distribution is row ``x_t`` of ``table`` (probabilities)."""
    log_table = table.log()
    return lambda chunk: log_table[chunk]  # [batch, k] -> [batch, k, vocab]


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_known_bigram_probabilities_give_the_exact_perplexity(chunk_size):
    torch.manual_seed(0)
    table = torch.softmax(torch.randn(5, 5, dtype=torch.float64) * 2, dim=-1)
    ids = torch.randint(0, 5, (1, 40))
    expected_nll = -sum(math.log(table[a, b].item()) for a, b in zip(ids[0, :-1].tolist(), ids[0, 1:].tolist())) / 39
    assert stream_nll(bigram_step(table), ids, chunk_size) == pytest.approx(expected_nll, rel=1e-12)


def test_uniform_model_has_perplexity_equal_to_the_vocabulary():
    table = torch.full((7, 7), 1 / 7, dtype=torch.float64)
    ids = torch.randint(0, 7, (1, 25))
    assert math.exp(stream_nll(bigram_step(table), ids, 4)) == pytest.approx(7.0, rel=1e-12)


def test_certain_model_has_perplexity_one():
    table = torch.roll(torch.eye(4, dtype=torch.float64), 1, dims=1).clamp_min(1e-300)  # always predicts x+1 mod 4
    ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    assert math.exp(stream_nll(bigram_step(table), ids, 2)) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_uncompressed_stream_matches_one_full_forward_pass(chunk_size):
    model, tokenizer = tiny_lm()
    ids = tokenizer("It was a dark and stormy night; the rain fell in torrents.", return_tensors="pt").input_ids
    result = streaming_perplexity(model, ids, CompressionConfig(policy="full"), chunk_size, reference=True)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    direct = math.exp(torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:]).item())
    assert result.perplexity == pytest.approx(direct, rel=1e-4)
    assert result.reference_perplexity == pytest.approx(direct, rel=1e-4)
    assert result.tokens == ids.shape[1] and result.capacity is None and result.kept_tokens == ids.shape[1]


def test_eviction_acts_while_the_text_is_read():
    model, tokenizer = tiny_lm()
    full = text_perplexity(model, tokenizer, None, 96, CompressionConfig(policy="full"), chunk_size=1)
    local = text_perplexity(model, tokenizer, None, 96, CompressionConfig(policy="local", budget=0.25), chunk_size=1)
    assert local.capacity == math.ceil(0.25 * 96) == local.kept_tokens
    assert local.kv_bytes < full.kv_bytes and local.kv_bytes_full_fp16 == full.kv_bytes_full_fp16
    assert local.perplexity != pytest.approx(full.perplexity, rel=1e-6)  # the window changed the predictions
    assert local.perplexity_ratio == pytest.approx(local.perplexity / full.perplexity, rel=1e-4)
    assert local.tokens_per_s > 0 and local.seconds > 0


def test_quantization_changes_bytes_and_perplexity_a_little():
    model, tokenizer = tiny_lm()
    full = text_perplexity(model, tokenizer, None, 64, CompressionConfig(), chunk_size=8, reference=False)
    int4 = text_perplexity(model, tokenizer, None, 64, CompressionConfig(kv_bits=4), chunk_size=8, reference=False)
    assert int4.kv_bytes < full.kv_bytes / 2
    assert 0.8 < int4.perplexity / full.perplexity < 1.25


def test_text_file_and_bad_inputs(tmp_path):
    model, tokenizer = tiny_lm()
    short = tmp_path / "short.txt"
    short.write_text("Holmes smiled.", encoding="utf-8")
    result = text_perplexity(model, tokenizer, str(short), 512, reference=False)
    assert result.tokens == len(tokenizer("Holmes smiled.", add_special_tokens=False).input_ids)
    with pytest.raises(ConfigError, match="chunk_size"):
        text_perplexity(model, tokenizer, None, 32, chunk_size=0)
    with pytest.raises(ConfigError, match="max_tokens"):
        text_perplexity(model, tokenizer, None, 1)
    with pytest.raises(InputError, match="does not exist"):
        text_perplexity(model, tokenizer, str(tmp_path / "missing.txt"))
    with pytest.raises(InputError, match="at least 2"):
        streaming_perplexity(model, torch.tensor([[5]]))
    with pytest.raises(InputError, match="context"):
        streaming_perplexity(model, torch.zeros(1, 5000, dtype=torch.long))
    assert reference_perplexity(model, torch.tensor([[3, 4, 5, 6]])) > 1


@pytest.mark.integration
def test_real_model_streaming_perplexity(smollm2, monkeypatch):
    model, tokenizer = smollm2
    # chunks of 16 and the one-forward reference through the same int8 kernel (a forward of DENSE_ROWS tokens or more
    # takes the dense bf16 product, whose roundings differ: tests/models/test_int8_weights.py bounds that)
    monkeypatch.setattr("h2o_compress.models.int8_linear.DENSE_ROWS", 1 << 30)
    full = text_perplexity(model, tokenizer, None, 160, CompressionConfig(policy="full"), chunk_size=16)
    assert full.perplexity == pytest.approx(full.reference_perplexity, rel=1e-3)  # chunking is exact uncompressed
    assert 5 < full.perplexity < 200  # real English prose, a real model
    h2o = text_perplexity(model, tokenizer, None, 160, CompressionConfig(policy="h2o", budget=0.2), chunk_size=16)
    local = text_perplexity(model, tokenizer, None, 160, CompressionConfig(policy="local", budget=0.2), chunk_size=16)
    assert h2o.capacity == 32 and h2o.kv_bytes < full.kv_bytes / 3
    assert 1.0 < h2o.perplexity_ratio < local.perplexity_ratio


def test_compiled_stream_gives_the_eager_perplexity():
    """``compile=True`` reads the one-token chunks through the compiled decode step (Inductor on CPU; on CUDA the
    CUDA graph, tests/test_cuda.py): the same perplexity as the eager steps, with evictions and int4 storage."""
    model, _ = tiny_lm()
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    config = CompressionConfig(budget=16, kv_bits=4, residual=2)
    torch._dynamo.reset()
    eager = streaming_perplexity(model, ids, config, compile=False)
    compiled = streaming_perplexity(model, ids, config, compile=True)
    assert compiled.perplexity == pytest.approx(eager.perplexity, rel=1e-4)
