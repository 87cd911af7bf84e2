"""Issue 47 (reliability round 4), items 8 to 11: each class below used to hang, climb in memory, end in a traceback
or be accepted silently; now one clean error (CLI: one ``error:`` line, exit code 2; API: an
:class:`H2OCompressError` naming the value and what is allowed) or, for a shipped text's name, one warning.
The property test over the whole public API is tests/test_public_api_types.py."""

from __future__ import annotations

import time

import pytest
from conftest import tiny_llama
from helpers.tiny_lm import english_tokenizer
from typer.testing import CliRunner

import h2o_compress
from h2o_compress import CompressionConfig, generate_batch, load_model, make_cache, plan, run_ask, run_batch
from h2o_compress.cli import app
from h2o_compress.planner import fit_batch
from h2o_compress.utils.errors import ConfigError, H2OCompressError, InputError

runner = CliRunner()
HUGE = 10**5000  # beyond Python's 4300-digit limit on writing an integer out


def one_error_line(result, fragment: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    return result.output


class Spy:
    """A tokenizer that records the length of every text it is asked to tokenize (directly or through its chat
    template, a plain join of the messages), and otherwise is ``tokenizer``."""

    chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

    def __init__(self, tokenizer):
        self._tokenizer, self.lengths = tokenizer, []

    def __call__(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self._tokenizer(text, *args, **kwargs)

    def apply_chat_template(self, messages, *args, **kwargs):
        self.lengths.append(sum(len(m["content"]) for m in messages))
        return self._tokenizer.apply_chat_template(messages, *args, chat_template=self.chat_template, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def lm():
    return tiny_llama(), english_tokenizer()


# -- 8. work bounded before it starts ---------------------------------------------------------------------------
def test_batch_refuses_a_prompt_beyond_the_window_before_tokenizing_it(lm):
    """A prompt (or chat) that no tokenization fits in the window is an error result from its length alone: the
    tokenizer never sees it (a 50 MB line was tokenized for minutes); the other prompts are answered."""
    model, tokenizer = lm
    spy = Spy(tokenizer)
    long = "x" * 400_000
    results = {r.id: r for r in generate_batch(model, spy, [long, {"messages": [{"role": "user", "content": long}]},
                                                            "a short one"], max_new_tokens=1, chat=False)}
    for ident, what in (("0", "the prompt"), ("1", "the messages")):
        assert results[ident].finish_reason == "error"
        assert f"{what} has 400,000 characters besides whitespace" in results[ident].error
        assert "beyond the model's window of 4,096 tokens" in results[ident].error
    assert results["2"].finish_reason != "error"
    assert max(spy.lengths) < 1000


def test_plan_refuses_a_grid_too_large_to_weigh():
    """20,000 budgets ran for minutes: a list holds at most 256 values and the grid at most 2,048 settings, refused
    before any is sized."""
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"budgets has 257 values; allowed: 1 to 256"):
        plan("llama-2-7b", "24GiB", budgets=tuple(range(1, 258)))
    with pytest.raises(ConfigError, match=r"the candidate grid would have 4000 settings \(policies 2 x budgets 200 x "
                                          r"bits 2 x group_sizes 5 x residuals 1\); allowed: at most 2048"):
        plan("llama-2-7b", "24GiB", policies=("h2o", "local"), budgets=tuple(range(1, 201)), bits=(16, 4),
             group_sizes=(32, 64, 128, 32, 64))
    with pytest.raises(ConfigError, match=r"budgets=None is invalid; allowed: a list"):
        plan("llama-2-7b", "24GiB", budgets=None)
    assert time.perf_counter() - started < 10


def test_cli_plan_with_20000_budgets_is_one_error_line():
    budgets = ",".join(str(n) for n in range(1, 20_001))
    one_error_line(runner.invoke(app, ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--budgets", budgets]),
                   "budgets has 20000 values; allowed: 1 to 256")


# -- 9. memory ----------------------------------------------------------------------------------------------------
def test_run_ask_refuses_a_huge_context_before_tokenizing_it(lm, monkeypatch):
    """``run_ask(context="x" * 50_000_000)`` tokenized the context (with each question) before anything checked its
    length: 3.6 GB for minutes. Now the context is refused from its length, the tokenizer never sees it."""
    model, tokenizer = lm
    spy = Spy(tokenizer)
    monkeypatch.setattr(h2o_compress.models, "load_model", lambda *args, **kwargs: (model, spy))
    with pytest.raises(InputError, match=r"the context has 400,000 characters besides whitespace: at least .* tokens"):
        run_ask("what is it?", context="x" * 400_000, model="tiny", chat=False)
    assert not spy.lengths or max(spy.lengths) < 1000


def test_batch_auto_counts_what_loading_the_model_holds(tiny_model_dir, tmp_path, monkeypatch):
    """``--batch-size auto --memory-limit 400MiB`` planned 1,986 sequences beside SmolLM2's 257 MiB of weights while
    the process already held 546 MiB once loaded (transformers' modules, the tokenizer): the measured peak was 531
    MiB. The fit counts what loading held (`PeakMemory.held`), here made 10 GiB: nothing fits 1 GiB."""
    from h2o_compress.utils.memory import PeakMemory

    model = tiny_llama()
    assert fit_batch(model, CompressionConfig(), "1GiB", 8, 4, held=0).max_batch > 1000
    assert fit_batch(model, CompressionConfig(), "1GiB", 8, 4, held=2**30).max_batch == 0
    with pytest.raises(ConfigError, match="held=-1 is invalid"):
        fit_batch(model, CompressionConfig(), "1GiB", 8, 4, held=-1)
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello there\n")
    monkeypatch.setattr(PeakMemory, "held", lambda self, model=None: 10 * 2**30)
    with pytest.raises(ConfigError, match=r"not even one sequence .* fits --memory-limit 1.00 GiB .* process memory 10.00 GiB \(weights "):
        run_batch(str(prompts), str(tmp_path / "out.jsonl"), model=tiny_model_dir, batch_size="auto",
                  memory_limit="1GiB", max_new_tokens=2, chat=False)


# -- 10. tracebacks -----------------------------------------------------------------------------------------------
def test_huge_integers_in_requests_are_error_results(lm):
    """A 5,000-digit ``id``, ``max_new_tokens`` or ``seed`` (Python cannot write it out) aborted the whole batch;
    now each is that request's error result and the others are answered."""
    model, tokenizer = lm
    requests = [{"id": HUGE, "prompt": "a b"}, {"prompt": "a b", "max_new_tokens": HUGE},
                {"prompt": "a b", "seed": HUGE, "temperature": 1.0}, "fine"]
    results = sorted(generate_batch(model, tokenizer, requests, max_new_tokens=1, chat=False), key=lambda r: r.index)
    errors = [r.error for r in results]
    assert results[0].id == "0" and "id <an integer of about 5001 digits> is invalid" in errors[0]
    assert "max_new_tokens=<an integer of about 5001 digits> is invalid" in errors[1]
    assert "seed=<an integer of about 5001 digits> is invalid" in errors[2]
    assert errors[3] is None


def test_a_lone_surrogate_in_messages_is_an_error_result(lm):
    """A lone surrogate (what invalid UTF-8 bytes become) in a message's content or role aborted the batch with
    the tokenizer's TypeError; now it is that request's error result."""
    model, tokenizer = lm
    requests = [{"messages": [{"role": "user", "content": "a \udcff b"}]},
                {"messages": [{"role": "user\ud800", "content": "a b"}]}, "fine"]
    results = sorted(generate_batch(model, Spy(tokenizer), requests, max_new_tokens=1, chat=False),
                     key=lambda r: r.index)
    assert "messages[0].content holds a character that is not valid UTF-8 at position 2" in results[0].error
    assert "messages[0].role holds a character that is not valid UTF-8 at position 4" in results[1].error
    assert results[2].error is None


def test_cli_max_memory_beyond_any_float_is_one_error_line():
    one_error_line(runner.invoke(app, ["generate", "--device-map", "auto", "--max-memory", "cpu=1e400GiB", "hello"]),
                   "max_memory['cpu']='1e400GiB' is invalid")


@pytest.mark.parametrize("call,fragment", [
    (lambda m, t: list(generate_batch(m, t, None)), "requests=None is not iterable"),
    (lambda m, t: run_batch(5, "out.jsonl"), "input file 5 is of type int; allowed: a file path"),
    (lambda m, t: run_batch("in.txt", None), "output None is of type NoneType"),
    (lambda m, t: run_ask(5, context="a document"), "questions=5 is a int; allowed: a question"),
    (lambda m, t: h2o_compress.run_generate("hello", colour=1), "unknown setting 'colour' for GenerateJob"),
    (lambda m, t: make_cache(None), "model=None is not a loaded transformers model"),
    (lambda m, t: h2o_compress.model_dims(None), "config=None is not a transformers config"),
    (lambda m, t: h2o_compress.load_config(5), "config file 5 is of type int"),
    (lambda m, t: h2o_compress.CompressedCache(None, None), "layers=None is invalid"),
    (lambda m, t: h2o_compress.ask(m, t, h2o_compress.compress(m, t, "a b c", CompressionConfig(), chat=False), "q",
                                   max_new_tokens={}), "max_new_tokens={} is invalid"),
    (lambda m, t: load_model(device=b"\x9b"), "unknown device b'\\x9b'"),
    (lambda m, t: load_model(dtype={"a": 1}), "unknown dtype {'a': 1}"),
])
def test_api_arguments_of_the_wrong_type_are_our_errors(lm, tmp_path, monkeypatch, call, fragment):
    """Wrong types given to the Python API raised TypeError or AttributeError (or read file descriptor 5)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("hello\n")
    with pytest.raises(H2OCompressError) as caught:
        call(*lm)
    assert fragment in str(caught.value)


# -- 11. accepted silently ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device_map,fragment", [
    ({"model.nope": "cpu"}, "device_map names 'model.nope', which this model does not have; allowed: its module names"),
    ({"model": "cpu", "lm_head": "cpu", "extra": "cpu"}, "device_map names 'extra'"),
    ({"model.embed_tokens": "cpu"}, "device_map places only part of the model: 'model.layers.0."),
])
def test_device_maps_are_checked_against_the_model(tiny_model_dir, device_map, fragment):
    with pytest.raises(ConfigError) as caught:
        load_model(tiny_model_dir, device_map=device_map)
    assert fragment in str(caught.value)
    model, _ = load_model(tiny_model_dir, device_map={"model": "cpu", "lm_head": "cpu"})  # covering every module
    assert model.lm_head.weight.device.type == "cpu"


@pytest.mark.parametrize("call,fragment", [
    (lambda m, t: load_model(max_memory={"cpu": True}, device_map="auto"), "max_memory['cpu']=True is invalid"),
    (lambda m, t: load_model(max_memory=True, device_map="auto"), "max_memory=True is invalid"),
    (lambda m, t: list(generate_batch(m, t, {"a b": 1})), "requests is a dict ({'a b': 1}), whose keys would be taken"),
    (lambda m, t: list(generate_batch(m, t, ["a"], in_order="no")), "in_order='no' is invalid; allowed: True or False"),
    (lambda m, t: list(generate_batch(m, t, ["a"], refill=0)), "refill=0 is invalid"),
    (lambda m, t: list(generate_batch(m, t, ["a"], longest_first=None)), "longest_first=None is invalid"),
    (lambda m, t: run_ask([], context="a document"), "questions is empty: there is nothing to answer"),
    (lambda m, t: make_cache(m, max_length=10**15), "max_length=1000000000000000 is invalid; allowed: an integer >= 1 "
                                                    "(tokens), at most 4096 (the model's context window)"),
])
def test_values_accepted_silently_are_refused(lm, call, fragment):
    with pytest.raises(H2OCompressError) as caught:
        call(*lm)
    assert fragment in str(caught.value)


def test_a_shipped_text_name_that_is_also_a_file_here_is_said(tmp_path, monkeypatch):
    """``--text-file persuasion`` read the shipped text and said nothing of the file ``persuasion`` in the current
    folder: now a warning says which is read and how to read the file (``./persuasion``)."""
    from h2o_compress.evaluation.corpus import TextNameWarning, load_text, reporting_text

    monkeypatch.chdir(tmp_path)
    (tmp_path / "persuasion").write_text("my own text, not Austen's\n")
    with pytest.warns(TextNameWarning, match=r"the file 'persuasion' in the current folder is not read \(give "
                                             r"\./persuasion to read it\)"):
        assert load_text("persuasion") == reporting_text("persuasion")
    assert load_text("./persuasion") == "my own text, not Austen's\n"
    result = runner.invoke(app, ["eval", "perplexity", "--text-file", "persuasion", "--model", str(tmp_path / "none")])
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "text 'persuasion' is the shipped text" in warnings[0], result.output
    one_error_line(result, "unknown model")


def test_batch_job_checks_its_load_options_and_switches_before_loading(tmp_path):
    import inspect

    from h2o_compress.jobs.checks import LOAD_KEYS

    assert set(inspect.signature(load_model).parameters) == {"name_or_path", "trust_remote_code", *LOAD_KEYS}
    prompts = tmp_path / "in.txt"
    prompts.write_text("hello\n")
    for settings, fragment in (({"load": {"colour": 1}}, "load has the unknown key 'colour'"),
                               ({"load": {"device": "tpu"}}, "unknown device 'tpu'"),
                               ({"chat": "no"}, "chat='no' is invalid; allowed: True or False"),
                               ({"trust_remote_code": 1}, "trust_remote_code=1 is invalid")):
        with pytest.raises(ConfigError) as caught:
            h2o_compress.BatchJob(str(prompts), str(tmp_path / "out.jsonl"), **settings)
        assert fragment in str(caught.value)
        assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("call", ["save", "load"])
def test_cache_files_refuse_a_non_bool_overwrite_and_unencodable_paths(call, tmp_path):
    import h2o_compress

    if call == "save":
        with pytest.raises(h2o_compress.H2OCompressError, match=r"overwrite='yes' is invalid; allowed: True or False"):
            h2o_compress.save_cache(None, tmp_path / "c.safetensors", overwrite="yes")
    for path in ("\ud800", 10**5000):  # a lone surrogate the file system cannot encode; an int (a file descriptor)
        with pytest.raises(h2o_compress.H2OCompressError, match=r"cache path"):
            if call == "save":
                h2o_compress.save_cache(None, path)
            else:
                h2o_compress.load_cache(path, None)
