"""Issue 35, item 4: ``profile --quality-texts`` measures every configuration on more texts (the reporting corpus)
and the report adds a "Quality per corpus" table with ratios against the reference on each text."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from helpers.tiny_lm import TINY_PROFILE, one_thread, profile_tiny, tiny_lm  # noqa: F401 (fixture)
from typer.testing import CliRunner

from h2o_compress.cli import app
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, expand_text_names
from h2o_compress.profiling import ProfileSettings, run_profile
from h2o_compress.profiling.report import _corpus_table, load_report, markdown
from h2o_compress.utils.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")


def small_settings(**overrides) -> ProfileSettings:
    return ProfileSettings(**{**TINY_PROFILE, "kv_bits": (16, 4), "agreement_prompts": 0, "needle_lengths": (64,),
                              "needle_depths": (0.5,), "quality_texts": ("python_code",), **overrides})


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile-corpora")
    model, tokenizer = tiny_lm()
    return profile_tiny(small_settings(), out, model, tokenizer), out, model, tokenizer


def test_every_row_is_measured_on_each_quality_text(corpus_run):
    report, *_ = corpus_run
    results = report["results"]
    assert [r["label"] for r in results] == ["full unquantized", "h2o 0.5 unquantized", "full 4-bit", "h2o 0.5 4-bit"]
    reference = results[0]["corpora"]["python_code"]
    assert reference["ratio"] == 1.0 and results[0]["config"]["budget"] == 1.0 and results[0]["config"]["kv_bits"] == 16
    for r in results:
        assert list(r["corpora"]) == ["python_code"]
        entry = r["corpora"]["python_code"]
        assert entry["tokens"] == 24 and math.isfinite(entry["perplexity"]) and entry["perplexity"] > 1
        assert entry["ratio"] == pytest.approx(entry["perplexity"] / reference["perplexity"])
        assert 0.0 <= entry["needle_accuracy"] <= 1.0
        assert entry["perplexity"] != r["perplexity"]["perplexity"]  # another text, not the main one again
    assert results[3]["corpora"]["python_code"]["ratio"] != 1.0  # evicted and 4-bit: not the reference's figure


def test_markdown_has_the_quality_per_corpus_table(corpus_run):
    report, out, *_ = corpus_run
    page = (out / "report.md").read_text()
    assert page == markdown(report)
    table = page.split("### Quality per corpus", 1)[1].split("###", 1)[0]
    header = next(line for line in table.splitlines() if line.startswith("| Configuration"))
    assert header == ("| Configuration | sherlock (tuning) ppl x | sherlock (tuning) needle | python_code (reporting) "
                      "ppl x | python_code (reporting) needle |")
    ref_needle = report["results"][0]["corpora"]["python_code"]["needle_accuracy"]
    assert f"| full unquantized | 1.000x | {report['results'][0]['metrics']['passkey_accuracy']:.2f} | 1.000x | " \
           f"{ref_needle:.2f} |" in table
    h2o = report["results"][3]
    assert f"| h2o 0.5 4-bit | {h2o['perplexity']['ratio']:.3f}x |" in table
    assert f"| {h2o['corpora']['python_code']['ratio']:.3f}x |" in table
    assert "Quality per corpus" in (out / "report.html").read_text()


def test_no_table_without_quality_texts():
    report = {"settings": {"ppl_tokens": 8, "chunk_size": 1, "needle_lengths": []},
              "results": [{"label": "full unquantized", "perplexity": {"ratio": 1.0}}]}
    assert _corpus_table(report) is None


def test_resume_reuses_rows_only_for_the_same_quality_texts(corpus_run, tmp_path):
    _, done, model, tokenizer = corpus_run
    out = tmp_path / "out"
    shutil.copytree(done, out)  # the module's report stays as it is for the other tests
    again = profile_tiny(small_settings(), out, model, tokenizer)
    assert again["rows_reused"] == 4
    other = profile_tiny(small_settings(quality_texts=("persuasion",)), out, model, tokenizer)
    assert other["rows_reused"] == 0 and list(other["results"][2]["corpora"]) == ["persuasion"]


def test_reporting_expands_to_the_six_reporting_texts():
    assert expand_text_names(["reporting"]) == ("python_reference", "persuasion", "python_code", "german_jokes",
                                                 "fortune_quotes", "pci_ids")
    assert small_settings(quality_texts=("reporting",)).quality_texts == tuple(REPORTING_TEXTS)
    # repeats and the main text are dropped (the main text is always the table's first column group)
    others = ("german_jokes", "fortune_quotes", "pci_ids")
    assert small_settings(quality_texts=("persuasion", "reporting", "sherlock")).quality_texts == (
        "persuasion", "python_reference", "python_code", *others)
    assert small_settings(text_file="persuasion", quality_texts="reporting").quality_texts == (
        "python_reference", "python_code", *others)


def test_unknown_quality_text_is_refused_before_any_output(tmp_path):
    with pytest.raises(InputError, match=r"quality text 'python-code'.*allowed: sherlock, python_reference, "
                                         r"persuasion, python_code, german_jokes, fortune_quotes, pci_ids, reporting"):
        small_settings(quality_texts=("reporting", "python-code"))
    settings = small_settings(model="/no/such/model")
    settings.quality_texts = (str(tmp_path / "missing.txt"),)  # changed after the checks of the constructor
    with pytest.raises(InputError, match="missing.txt"):
        run_profile(settings, tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, ["profile", "--model", "tiny-does-not-load", "--out", str(tmp_path / "cli"),
                                      "--quality-texts", "reporting,nope"])
    assert result.exit_code == 2 and result.output.startswith("error: quality text 'nope'"), result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "cli").exists()


def test_cli_help_names_the_allowed_texts():
    result = CliRunner().invoke(app, ["profile", "--help"], terminal_width=200)
    assert result.exit_code == 0
    flat = " ".join(result.output.replace("│", " ").split())
    assert "--quality-texts" in flat and "python_reference, persuasion, python_code, german_jokes, fortune_quotes, pci_ids, reporting" in flat


@pytest.mark.parametrize("value, named", [
    ({"python_code": {"perplexity": "2", "tokens": 24, "needle_accuracy": None}},
     "results[1].corpora.python_code.perplexity"),
    ({"python_code": {"perplexity": 2.0, "needle_accuracy": None}}, "results[1].corpora.python_code.tokens"),
    ({"python_code": {"perplexity": 2.0, "tokens": 24, "needle_accuracy": "1"}},
     "results[1].corpora.python_code.needle_accuracy"),
    ({"python_code": 2.0}, "results[1].corpora.python_code"),
    (["python_code"], "results[1].corpora"),
])
def test_render_refuses_a_malformed_corpora_field(corpus_run, tmp_path, value, named):
    _, out, *_ = corpus_run
    bad = json.loads((out / "report.json").read_text())
    bad["results"][1]["corpora"] = value
    source = tmp_path / "bad.json"
    source.write_text(json.dumps(bad))
    with pytest.raises(InputError) as err:
        load_report(source)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_render_refuses_a_reference_without_a_usable_perplexity_on_a_text(corpus_run, tmp_path):
    _, out, *_ = corpus_run
    bad = json.loads((out / "report.json").read_text())
    bad["results"][0]["corpora"]["python_code"]["perplexity"] = 0.0
    source = tmp_path / "bad.json"
    source.write_text(json.dumps(bad))
    with pytest.raises(InputError, match="reference perplexity of quality text 'python_code' is 0.0"):
        load_report(source)


def test_cli_quality_texts_reach_the_report(tmp_path):
    from helpers.tiny_lm import save_tiny_lm

    model_dir = save_tiny_lm(tmp_path / "model")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "profile", "--model", model_dir, "--device", "cpu", "--no-isolate", "--policies", "h2o", "--budgets", "1,0.5",
        "--kv-bits", "16", "--seq-len", "16", "--decode-tokens", "2", "--ppl-tokens", "24", "--chunk-size", "8",
        "--agreement-prompts", "0", "--quality-texts", "persuasion, python_code", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["quality_texts"] == ["persuasion", "python_code"]
    assert [list(r["corpora"]) for r in report["results"]] == [["persuasion", "python_code"]] * 2
    assert "| persuasion (reporting) ppl x | python_code (reporting) ppl x |" in (out / "report.md").read_text()
