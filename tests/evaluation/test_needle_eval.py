"""Passkey retrieval: answer scoring, needle placement, prompt building, accuracy tables."""

from __future__ import annotations

import pytest
from helpers.tiny_lm import tiny_lm, one_thread  # noqa: F401 (fixture)

from h2o_compress import CompressionConfig
from h2o_compress.utils.errors import ConfigError
from h2o_compress.evaluation import extract_answer, is_correct, needle_eval, plant_needle
from h2o_compress.evaluation import needle as needle_module

HAY = "The fog was thick. Holmes lit his pipe! Watson waited? The cab did not come. Night fell."

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "text, correct",
    [(" 48213.", True), ("48213", True), (" 48213 is the key", True), (" 482135.", False), (" 4821", False),
     ("I do not know.", False), ("It is 12, no, 48213.", False), ("", False)],
)
def test_answer_is_the_first_number(text, correct):
    assert is_correct(text, "48213") is correct


def test_extract_answer():
    assert extract_answer("The pass key is 7 or 48213") == "7"
    assert extract_answer("none") is None


def test_needle_at_depth_zero_and_one():
    assert plant_needle(HAY, "NEEDLE.", 0.0).startswith("NEEDLE. The fog")
    assert plant_needle(HAY, "NEEDLE.", 1.0).endswith("Night fell. NEEDLE.")


def test_needle_lands_on_a_sentence_boundary_near_the_depth():
    planted = plant_needle(HAY, "NEEDLE.", 0.5)
    before, after = planted.split(" NEEDLE. ")
    assert before.endswith(("!", "?", ".")) and after[0].isupper()
    assert abs(len(before) - 0.5 * len(HAY)) < 20
    assert planted.replace(" NEEDLE.", "") == HAY  # the haystack is untouched


def test_bad_depth():
    with pytest.raises(ConfigError, match="depth"):
        plant_needle(HAY, "x", 1.5)


def test_prompt_has_the_passkey_the_question_and_about_the_length():
    _, tokenizer = tiny_lm()
    prompt = needle_module.needle_prompt(tokenizer, 300, 0.5, "61532", offset=5000)
    text = tokenizer.decode(prompt[0])
    assert "The pass key is 61532. Remember it. 61532 is the pass key." in text
    assert text.rstrip().endswith("What is the pass key?\nThe pass key is")
    assert 240 <= prompt.shape[1] <= 300


def test_accuracy_table_counts_right_and_wrong_answers(monkeypatch):
    model, tokenizer = tiny_lm()

    def fake_answer(model, tokenizer, prompt, config, max_new_tokens, chunk_size, compile=None, context_tokens=None):
        key = tokenizer.decode(prompt[0]).split("The pass key is ")[1][:5]
        right = config.policy == "full" or prompt.shape[1] < 300  # compressed fails on the long prompts
        return (f" {key}." if right else " 11111."), 0

    monkeypatch.setattr(needle_module, "answer_prompt", fake_answer)
    result = needle_eval(model, tokenizer, CompressionConfig(policy="local", budget=0.5), lengths=(200, 400),
                         depths=(0.0, 1.0), trials=2)
    assert len(result.trials) == 2 * 2 * 2 * 2
    assert result.accuracy["reference"] == {200: {0.0: 1.0, 1.0: 1.0}, 400: {0.0: 1.0, 1.0: 1.0}}
    assert result.accuracy["compressed"] == {200: {0.0: 1.0, 1.0: 1.0}, 400: {0.0: 0.0, 1.0: 0.0}}
    assert result.overall("compressed") == 0.5
    keys = {(t.length, t.depth, t.trial): t.passkey for t in result.trials}
    assert len(set(keys.values())) == len(keys)  # a fresh passkey per cell and trial, shared by both settings
    assert result.to_dict()["accuracy"]["compressed"]["400"]["1"] == 0.0


def test_needle_eval_runs_on_a_tiny_model():
    model, tokenizer = tiny_lm()
    result = needle_eval(model, tokenizer, CompressionConfig(policy="h2o", budget=0.25), lengths=(96,),
                         depths=(0.5,), max_new_tokens=6, chunk_size=16)
    assert [t.setting for t in result.trials] == ["compressed", "reference"]
    for t in result.trials:
        assert t.correct == is_correct(t.answer, t.passkey)
    assert result.trials[0].kv_bytes < result.trials[1].kv_bytes


def test_bad_arguments():
    model, tokenizer = tiny_lm()
    with pytest.raises(ConfigError, match="length"):
        needle_eval(model, tokenizer, lengths=(10,))
    with pytest.raises(ConfigError, match="trials"):
        needle_eval(model, tokenizer, trials=0)


@pytest.mark.integration
def test_real_model_finds_the_passkey_with_the_full_cache(smollm2):
    model, tokenizer = smollm2
    result = needle_eval(model, tokenizer, CompressionConfig(policy="full"), lengths=(512,), depths=(0.25, 0.75),
                         reference=False, seed=3)
    assert result.overall("compressed") == 1.0, [t.answer for t in result.trials]


def test_several_keys_in_one_haystack_are_scored_per_key(monkeypatch):
    """``keys=3``: three numbered passkeys in one haystack, in its three thirds, each asked for in its own question
    from the same context; the accuracy is given per key."""
    model, tokenizer = tiny_lm()
    asked = []

    def fake_answer(model, tokenizer, prompt, config, max_new_tokens, chunk_size, compile=None, context_tokens=None):
        text = tokenizer.decode(prompt[0])
        number = int(text.rsplit("Pass key number ", 1)[1][0])
        key = text.split(f"Pass key number {number} is ")[1][:5]
        asked.append((number, context_tokens, text[: 40]))
        right = config.policy == "full" or number != 2  # compressed loses the middle key
        return (f" {key}." if right else " 11111."), 0

    monkeypatch.setattr(needle_module, "answer_prompt", fake_answer)
    result = needle_eval(model, tokenizer, CompressionConfig(policy="local", budget=0.5), lengths=(300,),
                         depths=(0.5,), trials=2, keys=3, protocol="compress-then-ask")
    assert len(result.trials) == 2 * 3 * 2
    assert result.per_key == {"compressed": {1: 1.0, 2: 0.0, 3: 1.0}, "reference": {1: 1.0, 2: 1.0, 3: 1.0}}
    assert result.to_dict()["per_key"]["compressed"]["2"] == 0.0
    assert {n for n, _, _ in asked} == {1, 2, 3}
    contexts = {context for _, context, _ in asked}
    assert len(contexts) == 2 and all(c is not None for c in contexts)  # one context per trial, shared by its keys
    cell = [t for t in result.trials if t.trial == 0 and t.setting == "reference"]
    assert len({t.passkey for t in cell}) == 3
    prompt, _ = needle_module.numbered_prompts(tokenizer, 300, 0.5, [t.passkey for t in cell])[0]
    text = tokenizer.decode(prompt[0])
    positions = [text.index(f"Pass key number {n} is {t.passkey}") for n, t in enumerate(cell, start=1)]
    assert positions == sorted(positions) and min(b - a for a, b in zip(positions, positions[1:])) > 60  # spread
    with pytest.raises(ConfigError, match="keys"):
        needle_eval(model, tokenizer, keys=11)
