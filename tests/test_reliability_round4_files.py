"""Issue 47 (reliability round 4), items 1 to 4, 7 and 12: the files ``batch`` and ``profile`` read and write.
Nothing a user gave is lost or overwritten (a file without a final newline, a ``rows`` symlink, a hand-edited
manifest, a directory at the manifest's name), every prompt of INPUT is read as written and answered exactly once,
also across a killed run (unique ids, lines split at ``\\n`` only), and OUTPUT lines are answers only when each
value is of an answer's type."""

from __future__ import annotations

import hashlib
import json

import pytest
from helpers.tiny_lm import TINY_PROFILE, one_thread, profile_tiny, tiny_lm  # noqa: F401 (fixture)
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, run_batch
from h2o_compress.cli import app
from h2o_compress.jobs.batch_files import AnswerFile, read_requests
from h2o_compress.profiling import ProfileSettings
from h2o_compress.profiling.report import check_out_dir, write_report
from h2o_compress.profiling.rows import RowStore
from h2o_compress.runtime.batch_requests import BatchResult
from h2o_compress.utils.errors import InputError
from h2o_compress.utils.outputs import MANIFEST

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()
SETTING = ["--budget", "0.5", "--max-new-tokens", "2", "--no-chat", "--threads", "1"]


def one_error_line(result, *parts: str) -> str:
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert line.startswith("error: ") and len(line.splitlines()) == 1 and "Traceback" not in line, result.output
    for part in parts:
        assert part in line, line
    return line


def tree(directory) -> dict:
    """Every path under ``directory`` with its bytes (None for a directory or link)."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() and not p.is_symlink() else p.is_symlink())
            for p in sorted(directory.rglob("*"))}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A small profile run's output directory and its report.json."""
    out = tmp_path_factory.mktemp("profiled") / "out"
    settings = ProfileSettings(**{**TINY_PROFILE, "kv_bits": (16,), "agreement_prompts": 0, "budgets": (1.0,)})
    profile_tiny(settings, out, *tiny_lm())
    return out, out / "report.json"


# -- 1. profile --out never follows a rows symlink --------------------------------------------------------------
def test_profile_refuses_a_rows_symlink_before_any_work(tmp_path):
    out, mine = tmp_path / "out", tmp_path / "mine"
    out.mkdir()
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    (out / "rows").symlink_to(mine)
    before = tree(tmp_path)
    settings = ProfileSettings(**{**TINY_PROFILE, "kv_bits": (16,), "agreement_prompts": 0, "budgets": (1.0,)})
    with pytest.raises(InputError, match="rows' is a symbolic link"):
        profile_tiny(settings, out, *tiny_lm())
    assert tree(tmp_path) == before


def test_a_row_is_never_written_through_a_rows_symlink_made_after_the_start(tmp_path):
    out, mine = tmp_path / "out", tmp_path / "mine"
    out.mkdir()
    mine.mkdir()
    store = RowStore(out)
    (out / "rows").symlink_to(mine)
    with pytest.raises(InputError, match="symbolic link"):
        store.save({"k": 1}, "h2o 50%", {"label": "x"})
    assert list(mine.iterdir()) == [] and store.load({"k": 1}, "h2o 50%") is None


# -- 2. batch --output: a file that is not answers is refused, even without a final newline -----------------------
@pytest.mark.parametrize("content", [b"my notes", b'{"notes": 1}', b"\x89PNG\x1a\x00\x01\xff",
                                     b'{"id": "a", "prompt": "a prompt line"}', b'{"id": 1', b'{"id": "a", "text": 7'],
                         ids=["text", "json", "binary", "prompt-line", "int-id", "int-text"])
@pytest.mark.parametrize("through_link", [False, True], ids=["file", "symlink"])
def test_batch_output_without_final_newline_is_refused_and_kept(tiny_model_dir, tmp_path, content, through_link):
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "w1 w2"}\n')
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    output = notes
    if through_link:
        output = tmp_path / "answers.jsonl"
        output.symlink_to(notes)
    result = runner.invoke(app, ["batch", str(source), "--output", str(output), "--model", tiny_model_dir, *SETTING])
    one_error_line(result, "line 1 is not an answer of h2o-compress batch", "allowed: a new file")
    with pytest.raises(InputError, match="not an answer"):
        AnswerFile(output, source)  # what a run opens (after the model loaded): refused as well
    assert notes.read_bytes() == content


def test_a_real_cut_answer_is_still_removed(tmp_path):
    whole = json.dumps(BatchResult(id="é", index=0, text="a\"\\\u2028é", prompt_tokens=3, new_tokens=1,
                                   finish_reason="error", error="x").to_dict(), ensure_ascii=False).encode()
    first = json.dumps(BatchResult(id="p0", index=0, text="t", new_tokens=2).to_dict()).encode() + b"\n"
    for cut in range(1, len(whole)):  # anywhere, also inside a character, a string or an escape
        output = tmp_path / f"out{cut}.jsonl"
        output.write_bytes(first + whole[:cut])
        with AnswerFile(output) as answers:
            assert answers.done == {"p0"}
        assert output.read_bytes() == first


# -- 3. ids: a repeated id never takes another line's id; a killed run resumes every prompt ---------------------------
COLLIDING = ['{"prompt": "w1 w2"}', '{"id": "1", "prompt": "w3"}', '{"id": "2", "prompt": "w4 w5"}']


def test_a_repeated_id_is_answered_under_an_id_no_line_has(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([*COLLIDING, "{not json", '{"id": "line 2", "prompt": "w6"}']) + "\n")
    requests = read_requests(source)
    ids = [r.id if isinstance(r, BatchResult) else r["id"] for r in requests]
    assert len(set(ids)) == len(ids), ids
    assert ids[0] == "1" and ids[2] == "2" and ids[4] == "line 2"  # requests keep their ids
    assert isinstance(requests[1], BatchResult) and f"answered as id {ids[1]!r}" in requests[1].error


def test_a_killed_run_with_a_repeated_id_answers_every_prompt_once(tiny_model_dir, tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(COLLIDING) + "\n")
    settings = dict(max_new_tokens=2, batch_size=2, chat=False, threads=1)
    run_batch(str(source), str(output), tiny_model_dir, CompressionConfig(budget=0.5), **settings)
    lines = output.read_text().splitlines()
    assert len({json.loads(line)["id"] for line in lines}) == len(lines) == 3
    output.write_text(lines[0] + "\n")  # a SIGKILL after the first answer (the repeated id's error is written first)
    run_batch(str(source), str(output), tiny_model_dir, CompressionConfig(budget=0.5), **settings)
    answers = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(a["id"] for a in answers) == sorted(json.loads(line)["id"] for line in lines)
    real = next(a for a in answers if a["id"] == "2")
    assert real["finish_reason"] != "error" and real["prompt_tokens"] == 2


# -- 7. INPUT read as written; OUTPUT values checked ----------------------------------------------------------------
def test_jsonl_lines_split_at_newlines_only(tmp_path):
    prompts = ["a\u2028b", "c\x85d", "e\x0cf", "g\x1ch\x1di\x1ej\x0bk"]
    source = tmp_path / "in.jsonl"
    source.write_text("\r\n".join(json.dumps({"prompt": p}, ensure_ascii=False).replace("\\f", "\x0c")
                                  for p in prompts) + "\n", encoding="utf-8")
    assert [r["prompt"] for r in read_requests(source)] == prompts
    text = tmp_path / "in.txt"
    text.write_text("\n".join([*prompts, "last"]) + "\n", encoding="utf-8")
    assert [(r["id"], r["prompt"]) for r in read_requests(text)] == list(zip("12345", [*prompts, "last"]))


def test_a_txt_file_is_text_and_a_bom_is_dropped(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text('\ufeff{"json-like": 1}\nsecond\n', encoding="utf-8")
    assert read_requests(text) == [{"id": "1", "prompt": '{"json-like": 1}'}, {"id": "2", "prompt": "second"}]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('\ufeff{"id": "a", "prompt": "first"}\n', encoding="utf-8")
    assert read_requests(jsonl) == [{"id": "a", "prompt": "first"}]
    other = tmp_path / "prompts"
    other.write_text('\ufeff{"id": "a", "prompt": "first"}\n', encoding="utf-8")
    assert read_requests(other) == [{"id": "a", "prompt": "first"}]


@pytest.mark.parametrize("change, named", [
    ({"id": 5}, "id 5 is not a text"), ({"new_tokens": "many"}, "new_tokens 'many'"),
    ({"prompt_tokens": -1}, "prompt_tokens -1"), ({"prompt_tokens": True}, "prompt_tokens True"),
    ({"finish_reason": "maybe"}, "finish_reason 'maybe'"), ({"text": None}, "text None"),
    ({"colour": 1}, "key 'colour' unexpected"), ({"finish_reason": "error"}, "key 'error' missing"),
])
def test_an_output_line_with_garbage_values_is_not_an_answer(tmp_path, change, named):
    good = BatchResult(id="a", index=0, text="t", prompt_tokens=2, new_tokens=1).to_dict()
    output = tmp_path / "out.jsonl"
    content = (json.dumps(good) + "\n" + json.dumps({**good, "id": "b", **change}) + "\n").encode()
    output.write_bytes(content)
    with pytest.raises(InputError, match="line 2 is not an answer") as error:
        AnswerFile.check(output)
    assert named in str(error.value)
    assert output.read_bytes() == content


# -- 4. a hand-edited manifest cannot vouch for a user's file ------------------------------------------------------
def test_a_hand_edited_manifest_does_not_let_render_replace_a_users_file(profiled, tmp_path):
    out, report = profiled
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my own notes\n")
    digest = hashlib.sha256(b"my own notes\n").hexdigest()
    for entry in (digest, "hmac-sha256:" + digest):
        (mine / MANIFEST).write_text(json.dumps({"report.md": entry}))
        before = tree(mine)
        with pytest.raises(InputError, match="already holds report.md") as refused:
            check_out_dir(mine)
        assert ("entries for them are unsigned" in str(refused.value)) == (entry == digest)
        one_error_line(runner.invoke(app, ["profile", "--render", str(report), "--out", str(mine)]),
                       "already holds report.md")
        assert tree(mine) == before
    assert set(write_report(json.loads(report.read_text()), out)) >= {"report.md"}  # profile's own: re-rendered


# -- 12. a manifest path that is not a manifest: refused before anything is written --------------------------------
@pytest.mark.parametrize("kind", ["directory", "symlink", "user-file"])
def test_render_into_a_directory_whose_manifest_is_not_one_writes_nothing(profiled, tmp_path, kind):
    _, report = profiled
    mine = tmp_path / "mine"
    mine.mkdir()
    if kind == "directory":
        (mine / MANIFEST).mkdir()
    elif kind == "symlink":
        (tmp_path / "target.json").write_text("{}")
        (mine / MANIFEST).symlink_to(tmp_path / "target.json")
    else:
        (mine / MANIFEST).write_text("my notes\n")
    before = tree(mine)
    one_error_line(runner.invoke(app, ["profile", "--render", str(report), "--out", str(mine)]), MANIFEST)
    with pytest.raises(InputError, match="nothing is written there"):
        write_report(json.loads(report.read_text()), mine)
    assert tree(mine) == before
