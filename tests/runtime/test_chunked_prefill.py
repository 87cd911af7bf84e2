"""Chunked prefill (issue 49): `prefill` feeds a prompt longer than ``prefill_chunk_size`` in chunks, the cache
scoring and evicting after each; the config field, its CLI flag and the progress of a chunked prefill."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import tiny_llama
from transformers import DynamicCache

from h2o_compress import CompressionConfig, ConfigError, make_cache
from h2o_compress.cache import chunk
from h2o_compress.cache.chunk import occupied_slots  # noqa: F401 (named in a docstring)
from h2o_compress.cli.options import COMPRESSION_FLAGS
from h2o_compress.runtime.prefill import feed_prompt, layer_progress, prefill, prefill_step
from h2o_compress.utils.progress import report_progress

PROMPT = 41  # no chunk of 3 or 7 ends on one token (a one-token step runs the decode kernel, not SDPA)


def _prompt(length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _dynamic_logits(model, ids: torch.Tensor, step: int) -> torch.Tensor:
    """transformers' DynamicCache fed ``ids`` in chunks of ``step`` tokens: the last chunk's last logits."""
    cache = DynamicCache(config=model.config)
    for start in range(0, ids.shape[1], step):
        logits = model(input_ids=ids[:, start : start + step], past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
    return logits


@pytest.mark.parametrize("max_length", [PROMPT + 4, None])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 0])
@torch.no_grad()
def test_full_budget_is_exact_against_dynamic_cache_fed_the_same_chunks(chunk_size, max_length):
    """Bit for bit: a chunk attends over the held tokens only (not the empty slots after them: `occupied_slots`),
    in the order DynamicCache holds them. One-token chunks run the decode step's kernel (the native CPU kernel or
    the torch form, not SDPA): equal to fp32 rounding only."""
    model = tiny_llama()
    ids = _prompt()
    config = CompressionConfig(budget=1.0, prefill_chunk_size=chunk_size)
    cache = make_cache(model, config, max_length=max_length)
    ours = prefill(model, ids, cache)
    reference = _dynamic_logits(model, ids, chunk_size or PROMPT)
    if chunk_size == 1:
        torch.testing.assert_close(ours, reference, rtol=1.3e-6, atol=1e-6)
    else:
        assert torch.equal(ours, reference)
    assert cache.get_seq_length() == PROMPT and cache.kept_length() == PROMPT


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 16])
@torch.no_grad()
def test_chunked_prefill_at_16_bits_is_close_to_one_pass(chunk_size):
    model = tiny_llama()
    ids = _prompt()
    one_pass = prefill(model, ids, make_cache(model, CompressionConfig(prefill_chunk_size=0), max_length=PROMPT))
    cache = make_cache(model, CompressionConfig(prefill_chunk_size=chunk_size), max_length=PROMPT)
    chunked = prefill(model, ids, cache)
    torch.testing.assert_close(chunked, one_pass, rtol=1.3e-6, atol=1e-5)


@torch.no_grad()
def test_a_prompt_no_longer_than_the_chunk_runs_in_one_pass_bit_for_bit(monkeypatch):
    model = tiny_llama()
    ids = _prompt()
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **k: calls.append(k["input_ids"].shape[1])
                        or forward(self, *a, **k))
    config = CompressionConfig(policy="h2o", budget=0.3, min_capacity=0)
    default = prefill(model, ids, make_cache(model, config, max_length=PROMPT + 2))
    whole = prefill(model, ids, make_cache(model, dataclasses.replace(config, prefill_chunk_size=0),
                                           max_length=PROMPT + 2))
    fitting = prefill(model, ids, make_cache(model, dataclasses.replace(config, prefill_chunk_size=PROMPT),
                                             max_length=PROMPT + 2))
    assert calls == [PROMPT] * 3
    assert torch.equal(default, whole) and torch.equal(fitting, whole)


@pytest.mark.parametrize("chunk_size", [3, 7])
@torch.no_grad()
def test_with_eviction_the_cache_holds_at_most_capacity_plus_a_chunk(monkeypatch, chunk_size):
    model = tiny_llama()
    ids = _prompt()
    config = CompressionConfig(policy="h2o", budget=0.3, min_capacity=0, prefill_chunk_size=chunk_size)
    cache = make_cache(model, config, max_length=PROMPT)
    capacity = cache.capacity
    assert capacity == math.ceil(0.3 * PROMPT)
    widest = []
    attend = chunk.attend

    def watching(layer, module, query, keys, *args, **kwargs):
        widest.append(keys.shape[2])  # what a chunk's attention reads: held + the chunk
        return attend(layer, module, query, keys, *args, **kwargs)

    monkeypatch.setattr(chunk, "attend", watching)
    prefill(model, ids, cache)
    assert widest and max(widest) <= capacity + chunk_size
    assert len(widest) == model.config.num_hidden_layers * -(-PROMPT // chunk_size)
    assert all(cache.kept_length(i) == capacity for i in range(model.config.num_hidden_layers))
    assert cache.get_seq_length() == PROMPT


def test_prefill_step_and_what_runs_in_one_pass():
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(prefill_chunk_size=8), max_length=64)
    assert prefill_step(cache, 20) == 8 and prefill_step(cache, 8) == 8 and prefill_step(cache, 5) == 5
    assert prefill_step(make_cache(model, CompressionConfig(prefill_chunk_size=0)), 20) == 20
    assert prefill_step(DynamicCache(config=model.config), 20) == 20  # no config: one pass
    cache.layers[0].setting.policy.context_scores = torch.zeros(1, 2, 20)  # a scoring pass ranks the whole prompt at once
    assert prefill_step(cache, 20) == 20
    assert CompressionConfig().prefill_chunk_size == COMPRESSION_FLAGS["prefill_chunk_size"].option.default


@pytest.mark.parametrize("value", [-1, 1.5, True, "8", 2**31])
def test_prefill_chunk_size_is_checked(value):
    with pytest.raises(ConfigError, match=r"prefill_chunk_size=.* is invalid; allowed: an integer from 1 to .*, or 0"):
        CompressionConfig(prefill_chunk_size=value)


def test_the_cli_flag_names_its_default():
    flag = COMPRESSION_FLAGS["prefill_chunk_size"].option
    assert "--prefill-chunk" in flag.param_decls
    assert f"default {CompressionConfig().prefill_chunk_size}" in flag.help


@torch.no_grad()
def test_a_chunked_prefill_reports_chunks_and_a_one_pass_prefill_layers():
    model = tiny_llama()
    ids = _prompt()
    calls = []
    with report_progress(lambda *call: calls.append(call)):
        with layer_progress(model, "prefill"):
            feed_prompt(model, ids, make_cache(model, CompressionConfig(prefill_chunk_size=16), max_length=PROMPT))
    assert calls[1:] == [("prefill", done, 3) for done in range(4)]  # after the start (0 of the layers)
    calls.clear()
    with report_progress(lambda *call: calls.append(call)):
        with layer_progress(model, "prefill"):
            feed_prompt(model, ids, make_cache(model, CompressionConfig(prefill_chunk_size=0), max_length=PROMPT))
    layers = model.config.num_hidden_layers
    assert calls == [("prefill", done, layers) for done in range(layers + 1)]


@pytest.mark.parametrize("model_type", ["bamba", "qwen3_next"])
def test_a_hybrid_is_prefilled_in_chunks_of_at_least_min_state_chunk(model_type, one_torch_thread):
    """A hybrid's state kernels cost about as much per pass whatever the chunk (Mamba-2's scan pads each pass to
    its chunk): a chunk below `MIN_STATE_CHUNK` is raised to it, so 260 tokens at ``prefill_chunk_size=3`` run in 2
    passes, with the logits of ``prefill_chunk_size=MIN_STATE_CHUNK``; an attention-only model keeps its chunk."""
    from helpers.architectures import tiny_causal_lm

    from h2o_compress.runtime.prefill import MIN_STATE_CHUNK

    model = tiny_causal_lm(model_type)
    for module in model.modules():  # Mamba-2's torch scan pads every pass to its chunk (256): 16 is faster
        if hasattr(module, "ssm_state_size") and isinstance(getattr(module, "chunk_size", None), int):
            module.chunk_size = 16
    ids, passes = _prompt(260), []
    model.register_forward_pre_hook(lambda *_: passes.append(1))
    logits = {}
    for size in (3, MIN_STATE_CHUNK):
        cache = make_cache(model, CompressionConfig(budget=64, kv_bits=4, prefill_chunk_size=size), max_length=260)
        assert prefill_step(cache, 260) == MIN_STATE_CHUNK
        passes.clear()
        with torch.no_grad():
            logits[size] = prefill(model, ids, cache)
        assert len(passes) == 2, size
    assert torch.equal(logits[3], logits[MIN_STATE_CHUNK])
    assert prefill_step(make_cache(tiny_llama(), CompressionConfig(prefill_chunk_size=3), max_length=260), 260) == 3
