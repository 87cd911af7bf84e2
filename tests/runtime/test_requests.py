"""One validated request per command: `GenerationRequest` (what `generate` and the jobs build), `CacheRequest`
(what `make_cache` builds) and the jobs' `JobRequest` door check every value once, when made, with the messages
the public functions give; the runtime takes a request and has no switch that skips a check."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from h2o_compress import CompressionConfig
from h2o_compress.jobs import GenerateJob
from h2o_compress.jobs.checks import JobRequest
from h2o_compress.runtime import ask, batch, compiled, generation
from h2o_compress.runtime.generation import CacheRequest, GenerationRequest
from h2o_compress.utils.errors import ConfigError


@pytest.mark.parametrize(("values", "message"), [
    (dict(max_new_tokens=0), r"max_new_tokens=0 is invalid; allowed: an integer >= 1"),
    (dict(temperature=True), r"temperature=True is invalid; allowed: a number >= 0"),
    (dict(temperature=1e9), r"temperature=1000000000.0 is invalid"),
    (dict(seed=-1), r"seed=-1 is invalid; allowed: an integer in \[0, 2\*\*64\) or None"),
    (dict(chat="no"), r"chat='no' is invalid; allowed: True or False"),
    (dict(compile="yes"), r"compile='yes' is invalid; allowed: True, False or None \(auto\)"),
    (dict(config="h2o"), r"config='h2o' is invalid; allowed: a CompressionConfig or None"),
    (dict(config=CompressionConfig(budget=12, kv_bits=4, quant="nf4"), compile=True),
     r"compile=True with quant='nf4': the bitsandbytes formats .* run eagerly only"),
])
def test_a_generation_request_refuses_each_bad_value_when_made(values, message):
    with pytest.raises(ConfigError, match=message):
        GenerationRequest(**values)


def test_a_generation_request_is_frozen_and_fills_the_default_setting():
    request = GenerationRequest(max_new_tokens=3, temperature=0.5, seed=7)
    assert request.config == CompressionConfig() and request.compile is None and request.chat is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_new_tokens = 0  # a validated request cannot be made invalid afterwards


def test_a_cache_request_refuses_what_make_cache_refuses():
    with pytest.raises(ConfigError, match=r"model='gpt2' is not a loaded transformers model"):
        CacheRequest("gpt2", None, 16)


def test_the_runtime_has_no_switch_that_skips_validation():
    """The runtime takes a validated request; no parameter says a check was done elsewhere."""
    functions = [generation.run_generation, ask.ask_checked, batch.generate_batch_checked, compiled.resolve_compile,
                 batch._Batch.__init__]
    for function in functions:
        names = set(inspect.signature(function).parameters)
        assert not {name for name in names if "checked" in name}, function.__qualname__
    assert not hasattr(generation, "generate_checked")


def test_a_job_is_the_commands_request(tmp_path):
    """A job validates its generation settings when made and keeps them as its request; ``from_call`` refuses an
    unknown setting and a callback that is not callable, with one message each."""
    job = GenerateJob("hello", config=CompressionConfig(budget=8), max_new_tokens=3, chat=False)
    assert isinstance(job, JobRequest)
    assert job.request == GenerationRequest(job.config, 3, False, job.temperature, None, None)
    with pytest.raises(ConfigError, match=r"temperature=-1 is invalid"):
        GenerateJob("hello", temperature=-1)
    with pytest.raises(ConfigError, match=r"unknown setting 'budget' for GenerateJob; allowed: .*max_new_tokens"):
        GenerateJob.from_call(("prompt", "model", "config"), ("hello",), {"budget": 8})
    with pytest.raises(ConfigError, match=r"on_text=1 is not callable; allowed: a function taking each new piece"):
        GenerateJob.from_call(("prompt", "model", "config"), ("hello",), {}, on_text=1)
    with pytest.raises(ConfigError, match=r"on_plan=1 is not callable; allowed: a function or None"):
        GenerateJob.from_call(("prompt", "model", "config"), ("hello",), {}, on_plan=1)


def test_the_lm_eval_request_refuses_an_output_that_exists(tmp_path):
    """``eval lm-eval``'s request: ``--output`` a new file (nothing the user has is overwritten), checked when made."""
    pytest.importorskip("lm_eval")
    from h2o_compress.cli.lm_eval_command import LmEvalRequest
    from h2o_compress.utils.errors import InputError

    taken = tmp_path / "scores.json"
    taken.write_text("{}")
    with pytest.raises(InputError, match=r"--output '.*scores.json' exists; allowed: a new file"):
        LmEvalRequest({"pretrained": "x"}, "some_task", None, None, str(taken))
    with pytest.raises(InputError, match=r"its folder is not a writable directory"):
        LmEvalRequest({"pretrained": "x"}, "some_task", None, None, str(tmp_path / "no" / "scores.json"))
    request = LmEvalRequest({"pretrained": "x"}, " a, b ", 2, None, str(tmp_path / "new.json"))
    assert request.tasks == ["a", "b"]
