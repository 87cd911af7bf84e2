"""The floor of a fractional budget (``CompressionConfig.min_capacity``): a sequence of at most the floor is never
evicted, a longer one keeps ``max(ceil(budget x length), floor)`` tokens, a budget in tokens has no floor; the
bytes follow (``nbytes`` and the planner agree), and the summary line says why nothing was evicted."""

from __future__ import annotations

import pytest
from helpers.measured_caches import predicted, run_cache
from helpers.tiny_lm import tiny_lm

from h2o_compress import CompressionConfig, generate, generate_batch
from h2o_compress.cli.generate import capacity_text
from h2o_compress.utils.errors import ConfigError

TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
        "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors. ") * 6


def test_the_default_floor_is_192_tokens(default_floor):
    assert default_floor == 192
    assert CompressionConfig(budget=0.2).floor == 192 and CompressionConfig(budget=0.2).capacity(192) is None
    assert CompressionConfig(budget=0.2, min_capacity=0).floor == 0


@pytest.mark.parametrize(("budget", "floor", "length", "capacity"), [
    (0.2, 128, 70, None),      # the README's main job: 38 + 32 tokens, nothing evicted
    (0.2, 128, 128, None),     # exactly the floor: still whole
    (0.2, 128, 129, 128),      # one past it: the floor
    (0.2, 128, 1000, 200),     # the budget above the floor
    (0.2, 0, 70, 14),          # off: the budget alone (what 0.2 meant before)
    (0.5, 16, 20, 16),
    (16, 128, 70, 16),         # a budget in tokens has no floor
    (1.0, 128, 1000, None),
])
def test_capacity_rule(budget, floor, length, capacity):
    assert CompressionConfig(budget=budget, min_capacity=floor).capacity(length) == capacity


@pytest.mark.parametrize("bad", [-1, 1.5, "128", True, 2**31])
def test_bad_floor_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match=r"min_capacity=.* allowed: an integer from 0 to"):
        CompressionConfig(budget=0.2, min_capacity=bad)


def test_a_short_sequence_answers_as_the_uncompressed_cache(default_floor):
    model, tokenizer = tiny_lm()
    prompt = TEXT[:40]
    full = generate(model, tokenizer, prompt, CompressionConfig(policy="full"), max_new_tokens=12, chat=False)
    assert full.prompt_tokens + 12 <= default_floor
    kept = generate(model, tokenizer, prompt, CompressionConfig(budget=0.2), max_new_tokens=12, chat=False)
    assert kept.capacity is None and kept.token_ids == full.token_ids
    evicted = generate(model, tokenizer, prompt, CompressionConfig(budget=0.2, min_capacity=0), max_new_tokens=12,
                       chat=False)
    assert evicted.capacity == -(-(full.prompt_tokens + 12) // 5)  # ceil(0.2 x length): the floor made the difference


def test_past_the_floor_the_cache_keeps_the_floor_and_its_bytes_shrink(default_floor):
    model, tokenizer = tiny_lm()
    prompt = TEXT[:400]
    full = generate(model, tokenizer, prompt, CompressionConfig(policy="full"), max_new_tokens=8, chat=False)
    assert default_floor < full.prompt_tokens + 8 < 5 * default_floor  # 0.2 of it is under the floor
    floored = generate(model, tokenizer, prompt, CompressionConfig(budget=0.2), max_new_tokens=8, chat=False)
    assert floored.capacity == default_floor
    assert floored.kv_bytes < full.kv_bytes
    assert floored.kv_bytes == pytest.approx(full.kv_bytes * default_floor / (full.prompt_tokens + 8), rel=0.05)


@pytest.mark.parametrize("bits", [16, 4])
def test_planner_counts_the_floor_as_nbytes_does(bits):
    model, _ = tiny_lm()
    for prompt, new in ((20, 10), (40, 30), (90, 12)):
        config = CompressionConfig(budget=0.2, kv_bits=bits, min_capacity=64)
        cache = run_cache(model, config, 1, prompt, new)
        assert predicted(model, config, 1, prompt, new).total == cache.nbytes(), (prompt, new)


def test_batch_rows_are_not_evicted_within_the_floor(default_floor):
    model, tokenizer = tiny_lm()
    prompts = [TEXT[:60], TEXT[:100]]
    full = [r.token_ids for r in generate_batch(model, tokenizer, prompts, CompressionConfig(policy="full"),
                                                max_new_tokens=8, chat=False, in_order=True)]
    run = generate_batch(model, tokenizer, prompts, CompressionConfig(budget=0.2), max_new_tokens=8, chat=False,
                         in_order=True)
    assert [r.token_ids for r in run] == full
    assert run.stats.capacity is None


def test_summary_says_why_nothing_was_evicted():
    figures = {"capacity": None, "prompt_tokens": 38, "new_tokens": 32, "min_capacity": 128,
               "config": {"policy": "h2o", "budget": 0.2, "min_capacity": None}}
    assert capacity_text(figures) == "capacity all (70 tokens <= --min-capacity 128: nothing evicted)"
    assert capacity_text({**figures, "capacity": 14}) == "capacity 14 of 69 tokens (55 evicted per layer and KV head)"
    assert capacity_text({**figures, "config": {"policy": "full", "budget": 1.0}}) == "capacity all"
