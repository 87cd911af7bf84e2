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
    "snapkv": CompressionConfig(policy="snapkv", budget=12, kv_bits=4),  # prompts read whole, then evicted once
    "lookahead": CompressionConfig(policy="lookahead", budget=12, kv_bits=4),  # the commands' default, the same
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
        assert run.stats.batch_size == min(batch_size, len(PROMPTS))
        assert run.stats.new_tokens == sum(len(t) for t in expected)
    static = generate_batch(model, tokenizer, PROMPTS, config, max_new_tokens=12, batch_size=3, chat=False,
                            in_order=True, refill=False, longest_first=False)
    assert [r.token_ids for r in static] == expected


@pytest.mark.parametrize("model_type", ["llama4_text", "mistral", "gemma2", "gpt_oss"])
@torch.inference_mode()
def test_rows_moved_between_caches_keep_chunks_windows_softcap_and_sinks(model_type, tokenizer, one_thread):
    """A prompt prefilled alone and moved into a row that has seen more (its positions shifted, its ring turned)
    decodes as alone: chunked (Llama 4), sliding (Mistral), soft-capped sliding (Gemma 2), sink logits (GPT-OSS)."""
    from helpers.architectures import tiny_causal_lm

    model = tiny_causal_lm(model_type)
    prompts = [p for p in PROMPTS if len(tokenizer(p).input_ids) > 20][:2] + PROMPTS[:4]
    for config in (CompressionConfig(budget=10, kv_bits=4, residual=3), CompressionConfig(budget=1.0, kv_bits=16)):
        expected = alone(model, tokenizer, config, prompts)
        run = generate_batch(model, tokenizer, prompts, config, max_new_tokens=12, batch_size=2, chat=False,
                             in_order=True, longest_first=False)
        assert [r.token_ids for r in run] == expected, config

# Every hybrid class of tests/helpers/architectures.py (a state layer, then attention; Falcon-H1 holds both in one
# layer; RecurrentGemma keeps its states in its own modules, held in the cache's rows while a batch runs).
HYBRIDS = ["bailing_hybrid", "bamba", "falcon_h1", "granitemoehybrid", "jamba", "kimi_linear", "lfm2", "lfm3",
           "minimax", "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma"]
HAND_MADE_HYBRIDS = ["lfm2_moe", "nemotron_h", "zamba", "zamba2"]


@pytest.mark.parametrize("model_type", HYBRIDS + HAND_MADE_HYBRIDS)
@torch.inference_mode()
def test_hybrid_rows_carry_their_states_through_refill_and_shrink(model_type, tokenizer, one_thread):
    """Three prompts of different lengths in 2 rows: the third is prefilled while the first row decodes and moved
    into the second's row (its conv and recurrent states with its keys), then the batch shrinks to the one row
    still running (every state layer's rows selected); each answer is the one generate gives it alone."""
    model = _hybrid(model_type)
    config = CompressionConfig(budget=10, kv_bits=4, residual=2)
    requests = [{"prompt": PROMPTS[1], "max_new_tokens": 10}, {"prompt": PROMPTS[0], "max_new_tokens": 2},
                {"prompt": " ".join(WORDS * 2), "max_new_tokens": 4}]
    expected = [generate(model, tokenizer, r["prompt"], config, max_new_tokens=r["max_new_tokens"],
                         chat=False).token_ids for r in requests]
    run = generate_batch(model, tokenizer, requests, config, batch_size=2, chat=False, in_order=True,
                         longest_first=False)
    results = list(run)
    assert [r.error for r in results] == [None] * 3
    assert [r.token_ids for r in results] == expected
    assert run.stats.batch_size == 2


def _hybrid(model_type: str):
    """A tiny hybrid of the matrix; RecurrentGemma's recurrent blocks with their output scaled up, so that a lost
    or misplaced conv or RG-LRU state changes the greedy tokens (at the random init they barely do)."""
    from helpers.architectures import hand_made_causal_lm, tiny_causal_lm

    model = hand_made_causal_lm(model_type) if model_type in HAND_MADE_HYBRIDS else tiny_causal_lm(model_type)
    assert not isinstance(model, str), model
    for module in model.modules():  # Mamba-2's torch scan pads every pass to its chunk (256): 16 is faster
        if hasattr(module, "ssm_state_size") and isinstance(getattr(module, "chunk_size", None), int):
            module.chunk_size = 16
        if hasattr(module, "rg_lru"):
            with torch.no_grad():
                module.linear_out.weight.mul_(10)
    return model


@pytest.mark.parametrize("model_type", ["recurrent_gemma", "bamba"])
@torch.inference_mode()
def test_a_prompt_prefilled_in_chunks_between_steps_keeps_its_states(model_type, tokenizer, one_thread):
    """Continuous batching's interleaved prefill: the third prompt (two 256-token chunks) is prefilled a chunk
    per decode step of the first row, each chunk carrying its own states (RecurrentGemma: the
    blocks' own, held in the prompt's one-row cache between chunks) while the batch's rows keep theirs; then the
    batch shrinks. Each answer is the one generate gives it alone."""
    model = _hybrid(model_type)
    config = CompressionConfig(budget=10, kv_bits=4, residual=2, prefill_chunk_size=256)
    requests = [{"prompt": PROMPTS[1], "max_new_tokens": 10}, {"prompt": PROMPTS[0], "max_new_tokens": 2},
                {"prompt": " ".join(WORDS * 9), "max_new_tokens": 4}]
    assert len(tokenizer(requests[2]["prompt"]).input_ids) > 256
    expected = [generate(model, tokenizer, r["prompt"], config, max_new_tokens=r["max_new_tokens"],
                         chat=False).token_ids for r in requests]
    steps = []
    run = generate_batch(model, tokenizer, requests, config, batch_size=2, chat=False, in_order=True,
                         longest_first=False, on_step=lambda running, rows: steps.append((running, rows)))
    assert [r.token_ids for r in run] == expected
    assert steps[:3] == [(2, 2), (1, 2), (2, 2)] and steps[-1] == (1, 1)  # a step between the third's chunks


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
def test_rows_are_refilled_as_they_end_and_static_batches_wait(tokenizer, one_thread):
    """Mixed lengths: continuous batching refills a row as soon as its sequence ends (idle rows only at the end of
    the job), static batches leave ended rows idle until their batch's longest ends; the answers are the same."""
    model = TINY_MODELS["llama"]()
    lengths = [2, 12, 3, 12, 5, 2, 9, 4, 12, 3]
    requests = [{"id": f"r{i}", "prompt": PROMPTS[i % 9], "max_new_tokens": n} for i, n in enumerate(lengths)]
    config = CompressionConfig(budget=10, kv_bits=4, residual=2)
    runs = {refill: generate_batch(model, tokenizer, requests, config, batch_size=3, chat=False, in_order=True,
                                   refill=refill, longest_first=False) for refill in (True, False)}
    answers = {refill: [r.token_ids for r in run] for refill, run in runs.items()}
    assert answers[True] == answers[False]
    assert all(len(a) <= n for a, n in zip(answers[True], lengths))
    continuous, static = runs[True].stats, runs[False].stats
    decoded = sum(len(a) - 1 for a in answers[True])  # the first token of each comes from its prefill
    assert continuous.row_steps - continuous.idle_row_steps == decoded == static.row_steps - static.idle_row_steps
    assert continuous.idle_row_steps < static.idle_row_steps
    assert continuous.row_steps < static.row_steps


@torch.inference_mode()
def test_a_long_prompt_is_prefilled_between_the_running_rows_steps(tokenizer, one_thread, monkeypatch):
    """Continuous batching (issue 49): a prompt admitted while another row decodes is prefilled one chunk budget
    (``prefill_chunk_size`` tokens) per decode step, interleaved with the running row's steps, not all before the
    next step; every answer is still the one generate gives it alone."""
    from h2o_compress.runtime import batch as batch_module

    events = []

    def logged_chunks(model, inputs, cache):
        for tokens, logits in batch_module.prompt_chunks.__wrapped__(model, inputs, cache):
            events.append(("chunk", inputs.shape[1], tokens))
            yield tokens, logits

    logged_chunks.__wrapped__ = batch_module.prompt_chunks
    monkeypatch.setattr(batch_module, "prompt_chunks", logged_chunks)
    model = TINY_MODELS["llama"]()
    config = CompressionConfig(budget=10, kv_bits=4, residual=2, prefill_chunk_size=4)
    long_prompt = " ".join(WORDS * 3)
    requests = [{"prompt": PROMPTS[0], "max_new_tokens": 20}, {"prompt": PROMPTS[1], "max_new_tokens": 2},
                {"prompt": long_prompt, "max_new_tokens": 3}]
    run = generate_batch(model, tokenizer, requests, config, batch_size=2, chat=False, in_order=True,
                         longest_first=False, on_step=lambda running, rows: events.append(("step", running)))
    answers = [r.token_ids for r in run]
    expected = [generate(model, tokenizer, r["prompt"], config, max_new_tokens=r["max_new_tokens"],
                         chat=False).token_ids for r in requests]
    assert answers == expected
    long_tokens = max(e[1] for e in events if e[0] == "chunk")
    assert long_tokens > 12  # several chunks of 4
    long_chunks = [i for i, e in enumerate(events) if e[0] == "chunk" and e[1] == long_tokens]
    gaps = [[e for e in events[a + 1 : b] if e[0] == "step"] for a, b in zip(long_chunks, long_chunks[1:])]
    assert sum(len(gap) for gap in gaps) >= 3  # the other row decoded while the long prompt was prefilled
    assert all(len(gap) <= 1 for gap in gaps)  # at most one step between two chunks: the prefill does not wait
    interleaved = [i for i, gap in enumerate(gaps) if gap]
    assert interleaved == list(range(len(interleaved)))  # one chunk per step until the other row ended, then the rest
    assert all(gap[0][1] == 1 for gap in gaps if gap)  # one row decoding, the other being prefilled


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


def test_rows_join_the_batch_without_autograd_history(tokenizer, monkeypatch):
    """Prefills run in inference mode even when the caller has gradients on: a row copied into the batch cache with
    its autograd history would keep every prefill's activations alive (500 MB per SmolLM2 prompt, found by the
    throughput benchmark)."""
    from h2o_compress.cache import CompressedCache

    model, moved = TINY_MODELS["llama"](), []
    original = CompressedCache.take_rows

    def take_rows(self, indices, source, batch):
        moved.extend(t.requires_grad or not t.is_inference() for layer in source.layers
                     for t in layer.tensors().values())
        return original(self, indices, source, batch)

    monkeypatch.setattr(CompressedCache, "take_rows", take_rows)
    assert torch.is_grad_enabled()
    list(generate_batch(model, tokenizer, PROMPTS[:3], CompressionConfig(budget=10, kv_bits=4), max_new_tokens=3,
                        batch_size=2, chat=False))
    assert moved and not any(moved)


@pytest.mark.integration
@torch.inference_mode()
def test_smollm2_batched_answers_equal_generate_alone(smollm2):
    """The real model (GQA, chat template): batch sizes 1, 3 and 8 over prompts of different lengths give the
    greedy tokens generate gives each prompt alone, at an integer budget and 4 bits. The torch form of the decode
    attention: on an Intel AMX machine the native CPU kernel's batched sums differ from a lone row's in the last
    bits, enough to flip a near-tie in one of these answers at its 5th token (the tiny-model tests above check the
    native kernel's batches). The torch form's batched sums differ in the last bits too: on an AMD EPYC (AVX-512)
    machine "Name three colours." flipped a near-tie at its 5th token, alone against batched, so it gave way to
    "Name three fruits."."""
    model, tokenizer = smollm2
    prompts = ["Explain what a KV cache is.", "Name three fruits.",
               "Write one sentence about the sea, then one about the mountains, and one about rivers.",
               "What is 2 + 2?", "Why is the sky blue? Answer in one short sentence."]
    config = CompressionConfig(budget=24, kv_bits=4, attention_kernel="torch")
    expected = [generate(model, tokenizer, p, config, max_new_tokens=12).token_ids for p in prompts]
    for batch_size in (1, 3, 8):
        run = generate_batch(model, tokenizer, prompts, config, max_new_tokens=12, batch_size=batch_size,
                             in_order=True)
        assert [r.token_ids for r in run] == expected, f"batch {batch_size}"
