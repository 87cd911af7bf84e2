"""``h2o-compress eval ...`` and ``h2o-compress profile`` through the CLI on a tiny local model."""

from __future__ import annotations

import json

import pytest
from helpers.tiny_lm import save_tiny_lm, one_thread  # noqa: F401 (fixture)
from typer.testing import CliRunner

from h2o_compress.cli import app
from h2o_compress.utils.outputs import MANIFEST

runner = CliRunner()

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-english"))


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_perplexity_json(model_dir):
    result = invoke("eval", "perplexity", "--model", model_dir, "--max-tokens", 48, "--chunk-size", 4,
                    "--policy", "h2o", "--budget", "0.25", "--kv-bits", 4, "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    for key in ("perplexity", "tokens", "kv_bytes", "kv_bytes_full_fp16", "tokens_per_s", "perplexity_ratio"):
        assert key in figures
    assert figures["tokens"] == 48 and figures["capacity"] == 12 and figures["config"]["kv_bits"] == 4


def test_perplexity_text_file_and_human_output(model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    result = invoke("eval", "perplexity", "--model", model_dir, "--text-file", text, "--max-tokens", 32)
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.stdout and "32 tokens, chunk 1" in result.stdout


def test_needle_and_agreement_json(model_dir):
    needle = invoke("eval", "needle", "--model", model_dir, "--lengths", 200, "--depths", "0,1", "--budget", "0.5",
                    "--max-new-tokens", 6, "--json")  # 6: the passkey's tokens with the tiny tokenizer
    assert needle.exit_code == 0, needle.output
    data = json.loads(needle.stdout)
    assert set(data["accuracy"]) == {"compressed", "reference"} and len(data["trials"]) == 4
    agreement = invoke("eval", "agreement", "--model", model_dir, "--limit", 1, "--max-new-tokens", 3, "--json")
    assert agreement.exit_code == 0, agreement.output
    assert json.loads(agreement.stdout)["token_match"] == 1.0  # no compression: identical to the reference


def test_profile_writes_the_report(model_dir, tmp_path):
    out = tmp_path / "out"
    result = invoke("profile", "--model", model_dir, "--out", out, "--no-isolate", "--budgets", "1,0.5",
                    "--kv-bits", "16", "--policies", "h2o,local", "--seq-len", "16", "--ppl-tokens", 24,
                    "--chunk-size", 8, "--agreement-prompts", 1, "--max-new-tokens", 2, "--decode-tokens", 2)
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html", "rows", MANIFEST, *(
        "perplexity_vs_kv_bytes.png", "decode_speed_vs_context.png", "memory_vs_context.png")}
    assert len(json.loads((out / "report.json").read_text())["results"]) == 3
    assert len(list((out / "rows").glob("*.json"))) == 3  # one finished row each, for a rerun to resume from


@pytest.mark.parametrize("args, message", [
    (["eval", "perplexity", "--chunk-size", "0"], "chunk_size=0"),
    (["eval", "perplexity", "--max-tokens", "1"], "max_tokens=1"),
    (["eval", "perplexity", "--budget", "abc"], "budget"),
    (["eval", "needle", "--depths", "0,x"], "depths"),
    (["eval", "agreement", "--limit", "0"], "limit=0"),
    (["profile", "--out", "OUT", "--budgets", "0.5,zz"], "budgets"),
    (["profile", "--out", "OUT", "--kv-bits", "3"], "kv bits 3"),
])
def test_user_errors_exit_2_with_one_line(args, message, tmp_path):
    result = runner.invoke(app, [a.replace("OUT", str(tmp_path / "o")) for a in args])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error:") and message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_profile_out_is_a_file(model_dir, tmp_path):
    (tmp_path / "f").write_text("x")
    result = invoke("profile", "--model", model_dir, "--out", tmp_path / "f", "--no-isolate")
    assert result.exit_code == 2 and "not a directory" in result.output


def test_profile_render_from_json(model_dir, tmp_path):
    out = tmp_path / "out"
    assert invoke("profile", "--model", model_dir, "--out", out, "--no-isolate", "--budgets", "1", "--kv-bits", "16",
                  "--seq-len", "16", "--ppl-tokens", 16, "--agreement-prompts", 0, "--decode-tokens", 1).exit_code == 0
    again = tmp_path / "again"
    result = invoke("profile", "--out", again, "--render", out / "report.json")
    assert result.exit_code == 0, result.output
    assert (again / "report.md").read_text() == (out / "report.md").read_text()
    bad = invoke("profile", "--out", again, "--render", out / "report.md")
    assert bad.exit_code == 2 and "cannot read report" in bad.output
