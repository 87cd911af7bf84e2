"""``h2o_compress.stream``: the new text piece by piece from the decode loop itself (no thread), joined equal to
``generate``'s text; and ``CompressedCache.get_seq_length()`` as a Python int (the tensor count kept for compiled
code)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.tiny_lm import tiny_lm

from h2o_compress import CompressionConfig, ConfigError, InputError, generate, make_cache, stream
from h2o_compress.runtime import generation

PROMPT = "Holmes looked at the letter and said nothing for a while"


@pytest.mark.parametrize("config", [CompressionConfig(), CompressionConfig(budget=8, kv_bits=4, residual=2)])
def test_pieces_join_to_generates_text(config):
    model, tokenizer = tiny_lm()
    expected = generate(model, tokenizer, PROMPT, config, max_new_tokens=12, chat=False)
    pieces = stream(model, tokenizer, PROMPT, config, max_new_tokens=12, chat=False)
    assert pieces.result is None
    got = list(pieces)
    assert len(got) > 1 and all(isinstance(p, str) and p for p in got)
    assert "".join(got) == expected.text and pieces.result.text == expected.text
    assert pieces.result.token_ids == expected.token_ids and pieces.result.kv_bytes == expected.kv_bytes
    assert list(pieces) == []  # exhausted: stays so, the result kept
    assert pieces.result.text == expected.text


def test_each_piece_comes_as_its_step_is_decoded(monkeypatch):
    """The iteration drives the loop: one decode step more per piece asked for, in the caller's thread."""
    model, tokenizer = tiny_lm()
    steps, threads = [], set()
    original = generation.decode_step

    def counted(*args, **kwargs):
        steps.append(1)
        threads.add(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(generation, "decode_step", counted)
    pieces = stream(model, tokenizer, PROMPT, max_new_tokens=10, chat=False)
    assert steps == []  # nothing runs before the first next()
    first = next(pieces)
    assert first and len(steps) <= 1
    taken = len(steps)
    next(pieces)
    assert len(steps) > taken and threads == {threading.get_ident()}
    pieces = stream(model, tokenizer, PROMPT, max_new_tokens=10, chat=False)
    for _ in pieces:
        break  # stopping early leaves no result
    assert pieces.result is None


def test_bad_arguments_are_refused_at_the_call_and_the_prompt_at_the_first_piece():
    model, tokenizer = tiny_lm()
    with pytest.raises(ConfigError, match="max_new_tokens"):
        stream(model, tokenizer, PROMPT, max_new_tokens=0)
    pieces = stream(model, tokenizer, "", max_new_tokens=2, chat=False)
    with pytest.raises(InputError):
        next(pieces)


def test_get_seq_length_is_an_int_and_the_tensor_count_stays_for_compiled_code():
    model, _ = tiny_lm()
    cache = make_cache(model, CompressionConfig(budget=8, kv_bits=4, residual=2), max_length=32)
    assert cache.get_seq_length() == 0 and type(cache.get_seq_length()) is int
    with torch.inference_mode():
        model(input_ids=torch.arange(5, 25).unsqueeze(0), past_key_values=cache)
    assert type(cache.get_seq_length()) is int and cache.get_seq_length() == 20 == cache.seen_tokens()
    offset = cache.get_query_offset()
    assert isinstance(offset, torch.Tensor) and offset.dim() == 0 and int(offset) == 20
    assert torch.equal(cache.seen_length(), offset)
