"""The package's steps that the benchmarks run instead of their own loops: `fixed_steps` / `run_steps` (a fixed
number of decode steps through the one decode loop), ``prompt_chunks(chunk=)`` and `prefill_replicated`."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.runtime.decode_loop import decode, fixed_steps, greedy, run_steps
from h2o_compress.runtime.prefill import feed_prompt, prefill_replicated, prompt_chunks
from h2o_compress.utils.errors import H2OCompressError
from tests.conftest import tiny_llama


def _prompt(tokens: int = 12, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (rows, tokens), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["ours", "dynamic"])
def test_fixed_steps_decode_what_decode_decodes_for_our_cache_and_a_transformers_one(kind):
    model, prompt = tiny_llama(), _prompt()
    new = lambda: (make_cache(model, CompressionConfig(budget=8, kv_bits=4)) if kind == "ours"  # noqa: E731
                   else DynamicCache(config=model.config))
    with torch.inference_mode():
        cache = new()
        first = greedy(feed_prompt(model, prompt, cache))
        steps = list(fixed_steps(decode_step, model, cache, first, prompt.shape[1], 5))
        reference = new()
        token = greedy(feed_prompt(model, prompt, reference))
        ids = decode(decode_step, model, reference, token, prompt.shape[1], greedy, set(), 6).ids
    assert len(steps) == 5 and all(s.timed and s.seconds > 0 for s in steps)
    assert [first.item()] + [s.values[0] for s in steps] == ids  # the loop of generate, step for step
    assert cache.get_seq_length() == reference.get_seq_length()


def test_run_steps_returns_the_last_token_and_runs_none_for_zero():
    model, prompt = tiny_llama(), _prompt()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        first = greedy(feed_prompt(model, prompt, cache))
        assert run_steps(decode_step, model, cache, first, prompt.shape[1], 0) is first
        last = run_steps(decode_step, model, cache, first, prompt.shape[1], 3)
    assert last.shape == (1, 1) and cache.get_seq_length() == prompt.shape[1] + 3


def test_prompt_chunks_takes_a_chunk_size_for_any_cache():
    model, prompt = tiny_llama(), _prompt(10)
    with torch.inference_mode():
        sizes = [n for n, _ in prompt_chunks(model, prompt, DynamicCache(config=model.config), chunk=4)]
        whole = feed_prompt(model, prompt, DynamicCache(config=model.config))
        *_, (_, last) = prompt_chunks(model, prompt, DynamicCache(config=model.config), chunk=4)
    assert sizes == [4, 4, 2]
    torch.testing.assert_close(last, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["ours", "dynamic"])
def test_prefill_replicated_gives_every_row_the_one_prompt(kind):
    model, prompt = tiny_llama(), _prompt()
    cache = (make_cache(model, CompressionConfig(budget=8, kv_bits=4)) if kind == "ours"
             else DynamicCache(config=model.config))
    with torch.inference_mode():
        logits = prefill_replicated(model, prompt, cache, 3, chunk=5)
        after = decode_step(model, greedy(logits), cache, torch.full((3, 1), prompt.shape[1]),
                            None if kind == "ours" else torch.ones(3, prompt.shape[1] + 1, dtype=torch.long))
    assert logits.shape == (3, 128) and after.shape == (3, 128)
    torch.testing.assert_close(after[1:], after[:1].expand(2, -1))  # three identical rows after the copy


@pytest.mark.parametrize("ids, batch, message", [
    (_prompt(5, rows=2), 2, "takes one prompt"), (_prompt(5), 0, "batch=0"), (_prompt(5), True, "batch=True")])
def test_prefill_replicated_refuses_several_rows_or_a_bad_batch(ids, batch, message):
    model = tiny_llama()
    with pytest.raises(H2OCompressError, match=message):
        prefill_replicated(model, ids, DynamicCache(config=model.config), batch)
