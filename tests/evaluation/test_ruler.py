"""``eval ruler``: RULER-style tasks generated locally, sized to the length asked, scored as RULER scores them."""

from __future__ import annotations

import re

import pytest
from helpers.tiny_lm import one_thread, tiny_lm  # noqa: F401 (a fixture)
from typer.testing import CliRunner

from h2o_compress.cli import app
from h2o_compress.evaluation.ruler import TASKS, check_ruler_args, make_sample, ruler_eval, score
from h2o_compress.utils.errors import ConfigError


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_task_fits_its_length_and_holds_its_answers(task):
    sample = make_sample(task, 600, seed=3, count_tokens=words)
    assert 300 < words(sample.prompt) <= 600  # sized close to the length asked
    assert all(answer in sample.context for answer in sample.answers)
    assert sample == make_sample(task, 600, seed=3, count_tokens=words)  # seeded
    assert sample != make_sample(task, 600, seed=4, count_tokens=words)
    assert score(" ".join(sample.answers).upper(), sample) == 1.0
    assert score("nothing here", sample) == 0.0
    if len(sample.answers) > 1:
        assert score(sample.answers[0], sample) == pytest.approx(1 / len(sample.answers))


def test_common_words_are_the_frequent_ones():
    sample = make_sample("cwe", 2000, seed=0, count_tokens=words)
    listed = re.findall(r"\d+\. (\w+)", sample.context)
    counts = {w: listed.count(w) for w in set(listed)}
    assert min(counts[w] for w in sample.answers) > max(c for w, c in counts.items() if w not in sample.answers)


@pytest.mark.parametrize("bad", [{"tasks": ["niah_nine"]}, {"ratios": [1.0]}, {"ratios": [-0.1]}, {"samples": 0},
                                 {"length": 100}])
def test_bad_arguments_are_refused_naming_them(bad):
    args = {"tasks": ["vt"], "ratios": [0.5], "samples": 1, "length": 512} | bad
    with pytest.raises(ConfigError, match="allowed"):
        check_ruler_args(**args)


def test_runs_every_policy_at_every_ratio_against_the_uncompressed_cache(one_thread):
    model, tokenizer = tiny_lm()
    result = ruler_eval(model, tokenizer, ["h2o", "lookahead"], (0.5, 0.875), ("niah_single", "vt"), samples=1,
                        length=300)
    assert list(result.scores) == ["uncompressed", "h2o 0.5", "h2o 0.875", "lookahead 0.5", "lookahead 0.875"]
    assert all(set(scores) == {"niah_single", "vt"} for scores in result.scores.values())
    assert result.kv_share["h2o 0.875"] < result.kv_share["h2o 0.5"] < result.kv_share["uncompressed"]
    assert set(result.to_dict()["means"]) == set(result.scores)


def test_cli_refuses_bad_options_in_one_line_before_loading():
    runner = CliRunner()
    for args, said in ((["--ratios", "0.5,1.2"], "ratio=1.2"), (["--policies", "nope"], "policies='nope'"),
                       (["--tasks", "vt,x"], "task 'x'"), (["--samples", "0"], "samples=0")):
        result = runner.invoke(app, ["eval", "ruler", "--model", "no-such-model", *args])
        assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output
