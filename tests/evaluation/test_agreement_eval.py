"""Greedy agreement: token match, prefix match, ROUGE-L, and the evaluation on a tiny model."""

from __future__ import annotations

import pytest
from helpers.tiny_lm import tiny_lm, one_thread  # noqa: F401 (fixture)

from h2o_compress import CompressionConfig
from h2o_compress.utils.errors import InputError
from h2o_compress.evaluation import agreement_eval, load_prompts, prefix_match_rate, rouge_l, token_match_rate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_match_rate():
    assert token_match_rate([1, 2, 3], [1, 5, 3, 4]) == 2 / 4
    assert token_match_rate([1, 2], [1, 2]) == 1.0
    assert token_match_rate([], []) == 1.0
    assert token_match_rate([1, 2, 3], []) == 0.0


def test_prefix_match_rate():
    assert prefix_match_rate([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert prefix_match_rate([1, 2], [1, 2, 3]) == 1.0
    assert prefix_match_rate([7], [1]) == 0.0


def test_rouge_l():
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)  # LCS a c d: P = R = 3/4
    assert rouge_l("the cat sat", "the cat sat") == 1.0
    assert rouge_l("the cat", "dog runs") == 0.0
    assert rouge_l("", "") == 1.0 and rouge_l("words", "") == 0.0


def test_shipped_prompts():
    prompts = load_prompts()
    assert len(prompts) >= 5 and all(p.strip() for p in prompts)


def test_prompts_file(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\nsecond prompt\n", encoding="utf-8")
    assert load_prompts(lines) == ["first prompt", "second prompt"]
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(InputError, match="list of strings"):
        load_prompts(bad)


def test_uncompressed_agrees_fully_and_eviction_measures_in_range():
    model, tokenizer = tiny_lm()
    prompts = ["The fog was thick over Baker Street", "Holmes took his violin"]
    same = agreement_eval(model, tokenizer, CompressionConfig(), prompts, max_new_tokens=12)
    assert (same.token_match, same.prefix_match, same.rouge_l) == (1.0, 1.0, 1.0)
    squeezed = agreement_eval(model, tokenizer, CompressionConfig(policy="local", budget=2), prompts, 12)
    for item in squeezed.items:
        assert 0 <= item.token_match <= 1 and 0 <= item.prefix_match <= 1 and 0 <= item.rouge_l <= 1
    assert squeezed.items[0].reference_text == same.items[0].reference_text
    assert squeezed.token_match < 1.0  # a 2-token window changes what a random model says


def test_references_must_match_prompts():
    model, tokenizer = tiny_lm()
    with pytest.raises(InputError, match="reference"):
        agreement_eval(model, tokenizer, prompts=["a", "b"], max_new_tokens=2, references=[])
