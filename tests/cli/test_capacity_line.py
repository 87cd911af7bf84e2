"""The summary's capacity: what eviction did (tokens kept and evicted), and the floor named where it overrides a
fractional ``--budget``."""

from __future__ import annotations

from h2o_compress.cli.generate import capacity_text


def _figures(prompt: int, new: int, capacity, budget=0.2, floor=192, max_new=None, policy="lookahead") -> dict:
    return {"prompt_tokens": prompt, "new_tokens": new, "capacity": capacity, "min_capacity": floor,
            "max_new_tokens": new if max_new is None else max_new, "config": {"budget": budget, "policy": policy}}


def test_a_long_prompt_shows_the_tokens_evicted():
    text = capacity_text(_figures(935, 19, 195, max_new=40))
    assert text == "capacity 195 of 953 tokens (758 evicted per layer and KV head)"


def test_the_floor_is_named_where_it_overrides_the_budget():
    # 0.1 x (700 + 128) = 83 tokens asked; the floor keeps 192
    text = capacity_text(_figures(700, 128, 192, budget=0.1, max_new=128))
    assert "--budget 0.1 alone keeps 83" in text and "--min-capacity 192 keeps 192" in text
    assert text.startswith("capacity 192 of 827 tokens (635 evicted")


def test_no_floor_note_where_the_budget_decides():
    assert "min-capacity" not in capacity_text(_figures(2000, 100, 420, budget=0.2, max_new=100))


def test_a_short_prompt_says_nothing_was_evicted():
    assert capacity_text(_figures(38, 128, None)) == (
        "capacity all (166 tokens <= --min-capacity 192: nothing evicted)")
    assert capacity_text(_figures(38, 128, None, policy="full", budget=1.0)) == "capacity all"
