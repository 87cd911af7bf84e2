"""``snapkv`` and ``lookahead`` (the commands' default policy) on a prompt that holds its question: a prompt longer
than the capacity is read whole, ranked by the attention of its end (and of the model's own answer) and evicted
once; its first new token is the uncompressed model's."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS
from helpers.tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)

from h2o_compress import CompressionConfig, generate
from h2o_compress.config import COMMAND_POLICY
from h2o_compress.evaluation import default_corpus
from h2o_compress.runtime import context_scores, generation
from h2o_compress.runtime.context_scores import read_prompt
from h2o_compress.runtime.generation import make_scored_cache
from h2o_compress.runtime.prefill import prefill

CAPACITY, TOKENS = 48, 200


@pytest.fixture(scope="module")
def lm():
    return tiny_lm()


def prompt_ids(tokenizer, tokens: int = TOKENS) -> torch.Tensor:
    return tokenizer(default_corpus()[:6000], return_tensors="pt").input_ids[:, :tokens]


@pytest.mark.parametrize("kv_bits", [16, 4])
@torch.inference_mode()
def test_prompt_is_laid_in_once_ranked_by_its_last_queries(lm, kv_bits, one_thread):
    model, tokenizer = lm
    ids = prompt_ids(tokenizer)
    config = CompressionConfig(policy="snapkv", budget=CAPACITY, kv_bits=kv_bits)
    cache = make_scored_cache(model, tokenizer, ids, config, TOKENS + 8, question_in_prompt=True)
    assert cache.seen_tokens() == TOKENS  # laid in: the prefill has nothing left to feed
    reference = model(ids).logits[:, -1]
    torch.testing.assert_close(prefill(model, ids, cache), reference, atol=1e-5, rtol=1e-5)
    policy = config.eviction_policy()
    recent = policy.recent_window(CAPACITY)
    votes = read_prompt(model, ids, policy.window, policy.pool, 64).scores
    for layer, layer_votes in zip(cache.layers, votes):
        kept = layer.positions()[0]
        assert kept.shape[-1] == CAPACITY
        for head, positions in enumerate(kept.tolist()):
            assert set(range(TOKENS - recent, TOKENS)) <= set(positions)  # the recent window
            older = layer_votes[0, head, : TOKENS - recent]
            heavy = [p for p in positions if p < TOKENS - recent]
            evicted = sorted(set(range(TOKENS - recent)) - set(heavy))
            assert older[heavy].min() >= older[evicted].max()  # the top of the window's votes


@torch.inference_mode()
def test_the_reading_is_chunked_and_its_votes_do_not_depend_on_the_chunk(lm, one_thread):
    model, tokenizer = lm
    ids = prompt_ids(tokenizer)
    whole, chunked = read_prompt(model, ids, 32, 5, TOKENS), read_prompt(model, ids, 32, 5, 17)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(chunked.scores, whole.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert chunked.cache.get_seq_length() == TOKENS


@torch.inference_mode()
def test_a_prompt_within_the_capacity_is_not_scored_and_equals_the_full_cache(lm, one_thread, monkeypatch):
    model, tokenizer = lm
    text = " ".join(default_corpus().split()[:20])

    def unexpected(*args, **kwargs):
        raise AssertionError("a prompt within the capacity was scored")

    monkeypatch.setattr(generation, "read_prompt", unexpected)
    snap = generate(model, tokenizer, text, CompressionConfig(policy="snapkv", budget=400), max_new_tokens=8,
                    chat=False)
    full = generate(model, tokenizer, text, CompressionConfig(policy="full"), max_new_tokens=8, chat=False)
    assert snap.token_ids == full.token_ids


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@torch.inference_mode()
def test_generate_starts_from_the_uncompressed_first_token_and_frees_the_prompt(arch, one_thread):
    model = TINY_MODELS[arch]()
    ids = torch.randint(3, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))
    config = CompressionConfig(policy="snapkv", budget=24, kv_bits=4)
    cache = make_scored_cache(model, None, ids, config, 128, question_in_prompt=True)
    assert cache.seen_tokens() == 120 and max(layer.kept_length() for layer in cache.layers) <= 24
    assert cache.nbytes() < 0.25 * cache.full_fp16_nbytes()
    assert int(prefill(model, ids, cache).argmax()) == int(model(ids).logits[0, -1].argmax())


def test_commands_default_to_the_prompt_read_whole():
    import importlib
    import inspect

    from h2o_compress.cli.evaluate import needle_command
    from h2o_compress.integrations.lm_eval_model import compression_from_args

    assert COMMAND_POLICY == "lookahead"
    assert compression_from_args({"budget": 0.2}).policy == "lookahead"
    assert compression_from_args({"budget": 0.2, "policy": "h2o"}).policy == "h2o"
    commands = [getattr(importlib.import_module(f"h2o_compress.cli.{name}"), name) for name in ("generate", "batch")]
    for command in (*commands, needle_command):
        assert inspect.signature(command).parameters["policy"].default.default == "lookahead", command
    assert CompressionConfig().policy == "h2o"  # the Python config's own default is unchanged


@torch.inference_mode()
def test_lookahead_reads_the_prompt_once_with_the_votes_of_its_own_pass(lm, one_thread):
    model, tokenizer = lm
    ids = prompt_ids(tokenizer)
    policy = CompressionConfig(policy="lookahead", budget=CAPACITY).eviction_policy()
    before = context_scores.lookahead_scores(model, tokenizer, ids, None, policy.new_tokens, policy.pool,
                                             policy.segment)  # its earlier pass: scores only, a second prefill after
    read = read_prompt(model, ids, 1, policy.pool, 64, answer_tokens=policy.new_tokens - 1)
    for a, b in zip(read.scores, before):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert read.cache.get_seq_length() == TOKENS  # the answer was dropped
    config = CompressionConfig(policy="lookahead", budget=CAPACITY, kv_bits=4)
    cache = make_scored_cache(model, tokenizer, ids, config, TOKENS + 8, question_in_prompt=True)
    assert cache.seen_tokens() == TOKENS and cache.kept_length() == CAPACITY
    torch.testing.assert_close(prefill(model, ids, cache), model(ids).logits[:, -1], atol=1e-5, rtol=1e-5)


def test_a_memory_limit_too_small_for_the_whole_prompt_falls_back_to_chunked_eviction(lm):
    from h2o_compress.models import model_dims
    from h2o_compress.planner.plan import PlanRow, read_whole_fallback

    model, _ = lm
    read = model_dims(model.config).fp16_bytes_per_token * 1000 * 2  # fp32: twice the fp16 bytes
    for policy in ("lookahead", "snapkv"):
        row = lambda: PlanRow(CompressionConfig(policy=policy, budget=0.2), None, 0, 0, 10_000, True, 1, 1)  # noqa: E731
        kept, said = read_whole_fallback(model, row(), 1000, 10_000 + read)
        assert kept.config.policy == policy and said is None
        fell, said = read_whole_fallback(model, row(), 1000, 10_000 + read - 1)
        assert fell.config.policy == "h2o" and "evicted chunk by chunk (h2o) instead of read whole" in said
        within = PlanRow(CompressionConfig(policy=policy, budget=200), None, 0, 0, 10_000, True, 1, 1)
        short, said = read_whole_fallback(model, within, 150, 10_001)  # within the capacity: nothing read whole
        assert short.config.policy == policy and said is None


@pytest.mark.parametrize("model_type", ["bamba", "qwen3_next"])
@torch.inference_mode()
def test_a_hybrid_is_evicted_chunk_by_chunk_instead_of_read_whole(model_type, one_thread):
    from helpers.architectures import tiny_causal_lm

    from h2o_compress.runtime.generation import reads_whole

    model = tiny_causal_lm(model_type)
    ids = torch.randint(3, 100, (1, 120), generator=torch.Generator().manual_seed(0))
    assert not reads_whole(model)  # its constant states are not held by a DynamicCache read
    config = CompressionConfig(policy=COMMAND_POLICY, budget=24, kv_bits=4)
    cache = make_scored_cache(model, None, ids, config, 128, question_in_prompt=True)
    assert cache.seen_tokens() == 0  # nothing read, nothing scored: the prefill ranks as h2o
    logits = prefill(model, ids, cache)
    assert torch.isfinite(logits).all() and max(layer.kept_length() for layer in cache.attention_layers) <= 24
