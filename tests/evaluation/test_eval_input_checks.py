"""Input checks of ``profile`` and ``eval``: a user's files in ``--out`` are never replaced, options are refused
(naming what is allowed) before a model loads or a directory is created, and nothing is silently ignored."""

from __future__ import annotations

import json

import pytest
from helpers.tiny_lm import save_tiny_lm, tiny_lm, one_thread  # noqa: F401 (fixture)
from typer.testing import CliRunner

from h2o_compress.cli import app
from h2o_compress.config import CompressionConfig
from h2o_compress.utils.errors import ConfigError, InputError, ModelLoadError
from h2o_compress.evaluation import needle_eval
from h2o_compress.profiling import ProfileSettings, run_profile, write_report
from h2o_compress.evaluation.corpus import load_prompts
from h2o_compress.evaluation.needle import check_needle_args, passkey_tokens
from h2o_compress.evaluation.perplexity import text_perplexity
from h2o_compress.profiling.report import check_out_dir

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()
NO_MODEL = "/no/such/model/dir"  # a check that ran after loading would fail on the model instead
SWEEP = ["--no-isolate", "--threads", "1", "--policies", "h2o", "--budgets", "1,0.5", "--kv-bits", "16",
         "--seq-len", "16", "--ppl-tokens", "16", "--chunk-size", "8", "--agreement-prompts", "0",
         "--decode-tokens", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-english"))


@pytest.fixture(scope="module")
def profile_out(model_dir, tmp_path_factory):
    """The output directory of one small profile run."""
    out = tmp_path_factory.mktemp("profiled") / "out"
    result = invoke("profile", "--model", model_dir, "--out", out, *SWEEP)
    assert result.exit_code == 0, result.output
    return out


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *parts):
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert line.startswith("error:") and len(line.splitlines()) == 1 and "Traceback" not in line, line
    for part in parts:
        assert part in line, line


def user_files(directory, **files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".")).write_text(text)
    return {name.replace("_", "."): text for name, text in files.items()}


def unchanged(directory, files):
    return {p.name: p.read_text() for p in directory.iterdir()} == files


# -- 1. the user's report files in --out ----------------------------------------------------------------------------
def test_profile_refuses_an_out_dir_holding_the_users_report_files(model_dir, tmp_path):
    files = user_files(tmp_path / "mine", report_md="my notes", report_json='{"mine": 1}')
    result = invoke("profile", "--model", model_dir, "--out", tmp_path / "mine", *SWEEP)
    one_line_error(result, "report.json, report.md", "not written by h2o-compress profile", "another --out")
    assert unchanged(tmp_path / "mine", files)


def test_render_refuses_an_out_dir_holding_the_users_report_md(profile_out, tmp_path):
    files = user_files(tmp_path / "mine", report_md="my notes")
    result = invoke("profile", "--out", tmp_path / "mine", "--render", profile_out / "report.json")
    one_line_error(result, "already holds report.md")
    assert unchanged(tmp_path / "mine", files)


def test_a_profile_out_dir_and_a_dir_without_report_files_are_written(profile_out, model_dir, tmp_path):
    again = invoke("profile", "--out", profile_out, "--render", profile_out / "report.json")  # re-render in place
    assert again.exit_code == 0, again.output
    rerun = invoke("profile", "--model", model_dir, "--out", profile_out, *SWEEP)  # a rerun resumes from rows/
    assert rerun.exit_code == 0 and "2 reused" in rerun.stdout, rerun.output
    user_files(tmp_path / "other", notes_txt="kept")
    result = invoke("profile", "--out", tmp_path / "other", "--render", profile_out / "report.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "other" / "notes.txt").read_text() == "kept" and (tmp_path / "other" / "report.md").is_file()


def test_library_refuses_to_replace_the_users_report_files(profile_out, tmp_path):
    report = json.loads((profile_out / "report.json").read_text())
    files = user_files(tmp_path / "mine", report_html="<p>mine</p>")
    with pytest.raises(InputError, match="already holds report.html"):
        write_report(report, tmp_path / "mine")
    with pytest.raises(InputError, match="already holds report.html"):
        run_profile(ProfileSettings(model=NO_MODEL, isolate=False), tmp_path / "mine", show_progress=False)
    assert unchanged(tmp_path / "mine", files)
    (tmp_path / "mine" / "rows").mkdir()  # a rows/ folder does not make the user's files profile's (issue 37)
    with pytest.raises(InputError, match="already holds report.html"):
        check_out_dir(tmp_path / "mine")
    assert (tmp_path / "mine" / "report.html").read_text() == files["report.html"]


def test_profile_output_follows_no_symlink_and_replaces_only_what_it_wrote(profile_out, tmp_path):
    """Issue 37: a report.html symlink is refused (the file it points to untouched); files profile wrote are
    re-rendered in place (its manifest), but not once edited by hand; an empty --out is refused."""
    report = json.loads((profile_out / "report.json").read_text())
    out, outside = tmp_path / "out", tmp_path / "elsewhere.html"
    out.mkdir()
    outside.write_text("keep me")
    (out / "report.html").symlink_to(outside)
    with pytest.raises(InputError, match="already holds report.html"):
        write_report(report, out)
    assert outside.read_text() == "keep me"
    (out / "report.html").unlink()
    assert set(write_report(report, out)) >= {"report.json", "report.md", "report.html"}
    write_report(report, out)  # again: every file is still what profile wrote
    (out / "report.md").write_text("edited by hand")
    with pytest.raises(InputError, match="already holds report.md.*or changed since"):
        write_report(report, out)
    assert (out / "report.md").read_text() == "edited by hand"
    for empty in ("", "  "):
        with pytest.raises(InputError, match="output directory is empty"):
            write_report(report, empty)
    one_line_error(invoke("profile", "--out", "", "--render", profile_out / "report.json"), "output directory is empty")


# -- 2. agreement prompts beyond the shipped ones -------------------------------------------------------------------
def test_more_agreement_prompts_than_shipped_are_refused(tmp_path):
    shipped = len(load_prompts())
    with pytest.raises(ConfigError, match=f"agreement_prompts={shipped + 1} is invalid.*at most {shipped}"):
        ProfileSettings(agreement_prompts=shipped + 1)
    assert ProfileSettings(agreement_prompts=shipped).agreement_prompts == shipped
    result = invoke("profile", "--model", NO_MODEL, "--out", tmp_path / "o", "--agreement-prompts", 50)
    one_line_error(result, "agreement_prompts=50", f"at most {shipped}")
    assert not (tmp_path / "o").exists()
    result = invoke("eval", "agreement", "--model", NO_MODEL, "--limit", shipped + 1)
    one_line_error(result, f"limit={shipped + 1}", f"at most {shipped}")


# -- 3. needle settings and the out dir of a failed run --------------------------------------------------------------
@pytest.mark.parametrize("lengths, depths, message", [
    ("64", "2", "needle depth=2.0 is invalid"),
    ("10", "0.5", "needle length=10 is invalid"),
    ("64", "", "needle lengths and depths must not be empty"),
    ("", "-1", "needle depth=-1.0 is invalid"),
])
def test_profile_checks_needle_settings_before_loading(lengths, depths, message, tmp_path):
    result = invoke("profile", "--model", NO_MODEL, "--out", tmp_path / "o", "--needle-lengths", lengths,
                    "--needle-depths", depths)
    one_line_error(result, message, "allowed:")
    assert not (tmp_path / "o").exists()


def test_a_failed_sweep_removes_the_dirs_it_created_empty(model_dir, tmp_path):
    model, tokenizer = tiny_lm()  # its context: 4096 positions
    settings = ProfileSettings(model="tiny", policies=("h2o",), budgets=(1.0,), kv_bits=(16,), seq_lens=(16,),
                               decode_tokens=1, ppl_tokens=16, agreement_prompts=0, needle_lengths=(5000,))
    with pytest.raises(InputError, match="needle lengths 5000 .* allowed: needle lengths at most 4088"):
        run_profile(settings, tmp_path / "a" / "b", show_progress=False, model=model, tokenizer=tokenizer)
    with pytest.raises(ModelLoadError):
        run_profile(ProfileSettings(model=NO_MODEL, isolate=False), tmp_path / "a" / "b", show_progress=False)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()  # a directory that existed before is left as it was
    with pytest.raises(ModelLoadError):
        run_profile(ProfileSettings(model=NO_MODEL, isolate=False), tmp_path / "kept", show_progress=False)
    assert (tmp_path / "kept").is_dir()


def test_an_unreachable_ray_address_leaves_no_out_dir(model_dir, tmp_path):
    pytest.importorskip("ray")
    result = invoke("profile", "--model", model_dir, "--out", tmp_path / "o" / "p", "--ray", "bad::addr", *SWEEP)
    assert result.exit_code == 2 and "error: cannot start or reach Ray at address 'bad::addr'" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output  # the error alone: no progress bar first
    assert list(tmp_path.iterdir()) == []


# -- 4. an answer too short for the passkey --------------------------------------------------------------------------
def test_needle_refuses_too_few_new_tokens_for_the_passkey(model_dir):
    model, tokenizer = tiny_lm()
    need = passkey_tokens(tokenizer, "48213")
    assert need == 6  # "▁" and one token per digit with the tiny tokenizer
    with pytest.raises(ConfigError, match=f"max_new_tokens={need - 1} is too few.*at least {need}"):
        needle_eval(model, tokenizer, CompressionConfig(policy="full"), (64,), (0.5,), max_new_tokens=need - 1)
    result = invoke("eval", "needle", "--model", model_dir, "--lengths", 128, "--depths", 0.5, "--max-new-tokens", 2)
    one_line_error(result, "max_new_tokens=2 is too few", f"at least {need}")


# -- 5. sweep options with --render ---------------------------------------------------------------------------------
def test_render_refuses_sweep_options(profile_out, tmp_path):
    result = invoke("profile", "--render", profile_out / "report.json", "--out", tmp_path / "r", "--budgets", 7,
                    "--kv-bits", 3, "--threads", 0, "--heavy-ratio", 0.3, "--no-resume")
    one_line_error(result, "--budgets, --kv-bits, --threads, --resume/--no-resume, --heavy-ratio",
                   "cannot be given with --render", "allowed:")
    assert not (tmp_path / "r").exists()


# -- 6. perplexity beyond the model's context -----------------------------------------------------------------------
def test_perplexity_beyond_the_context_names_the_largest_max_tokens(model_dir):
    model, tokenizer = tiny_lm()
    with pytest.raises(InputError, match="max_tokens=5000 reads 5000 tokens.*allowed: max_tokens at most 4096"):
        text_perplexity(model, tokenizer, None, 5000)
    result = invoke("eval", "perplexity", "--model", model_dir, "--max-tokens", 100000)
    one_line_error(result, "max_tokens=100000", "allowed: max_tokens at most 4096")


# -- 7. the passkey seed ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**64])
def test_needle_seed_is_checked_as_generate_checks_it(seed):
    with pytest.raises(ConfigError, match=rf"seed={seed} is invalid; allowed: an integer in \[0, 2\*\*64\)"):
        check_needle_args((64,), (0.5,), seed=seed)
    one_line_error(invoke("eval", "needle", "--model", NO_MODEL, "--seed", seed), f"seed={seed} is invalid")
    check_needle_args((64,), (0.5,), seed=2**64 - 1)
