"""generate_batch: each prompt's answer in a batch is the one generate gives it alone; a budget fraction means the
job's longest sequence for every row; bad requests become error results; finished rows are counted as idle."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_MODELS
from helpers.tiny_lm import english_tokenizer, one_thread  # noqa: F401 (a fixture)

from h2o_compress import BatchRequest, CompressionConfig, generate, generate_batch
from h2o_compress.utils.errors import ConfigError

WORDS = "the cache keeps heavy hitters and the recent window of tokens while the rest is evicted".split()
#: 9 prompts of 3 to 45 tokens' worth of words, in no order of length
PROMPTS = [" ".join(WORDS[: 3 + (i * 5) % 14]) * (1 + i % 3) for i in range(9)]
SETTINGS = {
    "h2o int4": CompressionConfig(budget=10, kv_bits=4, residual=2),
    "full": CompressionConfig(policy="full", kv_bits=16),
    "kvzip": CompressionConfig(policy="kvzip", budget=12, kv_bits=4, heavy_ratio=0.5),
}


@pytest.fixture(scope="module")
def tokenizer():
    return english_tokenizer()


def alone(model, tokenizer, config, prompts=PROMPTS, max_new_tokens=12):
    return [generate(model, tokenizer, p, config, max_new_tokens=max_new_tokens, chat=False).token_ids for p in prompts]


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@torch.inference_mode()
def test_batched_answers_equal_generate_alone(arch, setting, tokenizer, one_thread):
    model, config = TINY_MODELS[arch](), SETTINGS[setting]
    expected = alone(model, tokenizer, config)
    assert len({len(p) for p in PROMPTS}) > 3  # prompts of different lengths: rows are left-padded
    for batch_size in (1, 3, 8):
        run = generate_batch(model, tokenizer, PROMPTS, config, max_new_tokens=12, batch_size=batch_size, chat=False,
                             in_order=True)
        results = list(run)
        assert [r.index for r in results] == list(range(len(PROMPTS)))
        assert [r.token_ids for r in results] == expected, f"batch {batch_size}"
        assert run.stats.batches == math.ceil(len(PROMPTS) / batch_size)
        assert run.stats.new_tokens == sum(len(t) for t in expected)


@torch.inference_mode()
def test_budget_fraction_is_of_the_longest_sequence(tokenizer, one_thread):
    """A fraction applies to the job's longest prompt + new tokens: every row keeps ceil(budget x that), at any
    batch size, so answers do not depend on how prompts were grouped; a lone prompt gets what generate gives it."""
    model = TINY_MODELS["llama"]()
    config = CompressionConfig(budget=0.25, kv_bits=4, residual=2)
    longest = max(len(tokenizer(p).input_ids) for p in PROMPTS) + 12
    answers = []
    for batch_size in (1, 3, 8):
        run = generate_batch(model, tokenizer, PROMPTS, config, max_new_tokens=12, batch_size=batch_size, chat=False,
                             in_order=True)
        answers.append([r.token_ids for r in run])
        assert run.stats.capacity == math.ceil(0.25 * longest)
    assert answers[0] == answers[1] == answers[2]
    lone = list(generate_batch(model, tokenizer, PROMPTS[:1], config, max_new_tokens=12, chat=False))[0]
    assert lone.token_ids == alone(model, tokenizer, config, PROMPTS[:1])[0]


@torch.inference_mode()
def test_sampling_with_a_seed_draws_what_generate_draws(tokenizer, one_thread):
    model = TINY_MODELS["llama"]()
    config = CompressionConfig(budget=10, kv_bits=8)
    requests = [BatchRequest(id=str(i), prompt=p, temperature=0.9, seed=100 + i) for i, p in enumerate(PROMPTS[:4])]
    results = list(generate_batch(model, tokenizer, requests, config, max_new_tokens=10, batch_size=4, chat=False,
                                  in_order=True))
    for i, result in enumerate(results):
        expected = generate(model, tokenizer, PROMPTS[i], config, max_new_tokens=10, chat=False, temperature=0.9,
                            seed=100 + i)
        assert result.token_ids == expected.token_ids


@torch.inference_mode()
def test_per_prompt_max_new_tokens_and_idle_rows(tokenizer, one_thread):
    """A row that ends early waits for its group: the idle row-steps are counted, never decoded into its answer."""
    model = TINY_MODELS["llama"]()
    lengths = [2, 9, 5]
    requests = [{"id": f"r{n}", "prompt": PROMPTS[0], "max_new_tokens": n} for n in lengths]
    run = generate_batch(model, tokenizer, requests, CompressionConfig(budget=10), batch_size=3, chat=False,
                         in_order=True)
    results = list(run)
    assert [r.new_tokens for r in results if r.finish_reason == "length"] == [n for n, r in zip(lengths, results)
                                                                               if r.finish_reason == "length"]
    assert all(r.new_tokens <= n for n, r in zip(lengths, results))
    steps = max(r.new_tokens for r in results) - 1
    assert run.stats.row_steps == 3 * steps
    assert run.stats.idle_row_steps == sum(steps - (r.new_tokens - 1) for r in results)
    assert run.stats.idle_share > 0


@torch.inference_mode()
def test_bad_requests_become_errors_naming_their_id(tokenizer, one_thread):
    model = TINY_MODELS["llama"]()
    requests = [
        PROMPTS[0],
        {"id": "empty", "prompt": "   "},
        {"id": "both", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"id": "long", "prompt": PROMPTS[1], "max_new_tokens": 10**6},
        {"id": "temp", "prompt": PROMPTS[1], "temperature": -1},
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},  # this tokenizer has no chat template
        {"id": "key", "prompt": "a", "colour": "red"},
        42,
    ]
    results = {r.id: r for r in generate_batch(model, tokenizer, requests, max_new_tokens=4, chat=False)}
    assert results["0"].finish_reason in ("stop", "length") and results["0"].error is None
    reasons = {
        "empty": "empty", "both": "exactly one", "long": "context", "temp": "temperature", "chat": "chat template",
        "key": "unknown key 'colour'", "7": "int",
    }
    for ident, words in reasons.items():
        assert results[ident].finish_reason == "error" and words in results[ident].error, (ident, results[ident])
    assert len(results) == len(requests)


@pytest.mark.parametrize("bad", [{"batch_size": 0}, {"batch_size": "8"}, {"max_new_tokens": 0}, {"temperature": -1},
                                 {"on_step": 3}])
def test_bad_job_arguments_are_refused_at_the_call(bad, tokenizer):
    model = TINY_MODELS["llama"]()
    with pytest.raises(ConfigError):
        generate_batch(model, tokenizer, PROMPTS, **bad)
    with pytest.raises(ConfigError, match="single text"):
        generate_batch(model, tokenizer, "one prompt")
