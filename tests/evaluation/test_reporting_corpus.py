"""The reporting corpus: shipped texts of other kinds than the tuning text, each at least 50,000 SmolLM2 tokens,
with their provenance and licence shipped beside them."""

from __future__ import annotations

from importlib import resources

import pytest

from h2o_compress.evaluation.corpus import REPORTING_TEXTS, TUNING_TEXT, default_corpus, reporting_text
from h2o_compress.utils.errors import InputError

DATA = resources.files("h2o_compress").joinpath("data")
MIN_TOKENS = 50_000


@pytest.mark.parametrize("name", sorted(REPORTING_TEXTS))
def test_each_reporting_text_is_shipped_utf8_with_newline_line_endings(name):
    raw = DATA.joinpath("reporting", REPORTING_TEXTS[name]).read_bytes()
    text = raw.decode("utf-8")  # strict: raises on a byte that is not UTF-8
    assert reporting_text(name) == text
    assert "\r" not in text and text.endswith("\n") and not text.startswith("\ufeff")
    # cheap lower bound: SmolLM2 gives under one token per 3 characters of English prose or Python code here
    assert len(text) >= 3 * MIN_TOKENS
    assert len(raw) < 600_000


@pytest.mark.parametrize("name", sorted(REPORTING_TEXTS))
def test_each_reporting_text_shares_no_passage_with_the_tuning_text(name):
    text, tuning = reporting_text(name), default_corpus()
    assert TUNING_TEXT == "sherlock_holmes.txt" and REPORTING_TEXTS[name] != TUNING_TEXT
    assert text != tuning
    windows = {text[i:i + 120] for i in range(0, len(text) - 120, 997)}
    assert not any(w in tuning for w in windows)


def test_the_reporting_texts_differ_from_each_other():
    texts = [reporting_text(name) for name in REPORTING_TEXTS]
    assert len(set(texts)) == len(texts) >= 3
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            assert not any(a[k:k + 200] in b for k in range(0, len(a) - 200, 4999))


def test_an_unknown_name_is_refused_with_the_allowed_names():
    with pytest.raises(InputError, match="unknown reporting text 'sherlock'; allowed: .*persuasion"):
        reporting_text("sherlock")


def test_provenance_and_licence_ship_beside_the_texts():
    readme = DATA.joinpath("README.md").read_text(encoding="utf-8")
    assert "never used to choose a default, factor, policy or threshold" in readme
    for name, file in REPORTING_TEXTS.items():
        assert f"`reporting/{file}` (name `{name}`)" in readme
    licence = DATA.joinpath("reporting", "LICENSE-PSF.txt").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence
    assert "Python Software Foundation;\nAll Rights Reserved" in licence
    assert "Summary of the changes made to Python" in licence


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(REPORTING_TEXTS))
def test_each_reporting_text_has_at_least_50k_smollm2_tokens(smollm2, name):
    _, tokenizer = smollm2
    assert len(tokenizer(reporting_text(name), add_special_tokens=False).input_ids) >= MIN_TOKENS


def test_eval_text_file_takes_the_shipped_texts_by_name(tmp_path, monkeypatch):
    from h2o_compress.evaluation.corpus import TEXT_NAMES, default_corpus, load_text

    assert TEXT_NAMES == ("sherlock", *REPORTING_TEXTS)
    assert load_text("sherlock") == load_text(None) == default_corpus()
    for name in REPORTING_TEXTS:
        assert load_text(name) == reporting_text(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "persuasion").write_text("my own file")
    assert load_text("./persuasion") == "my own file"  # a file of that name, by path
