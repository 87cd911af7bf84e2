"""Property test (hypothesis, issue 47): every public callable of ``h2o_compress`` (its ``__all__``: functions and
classes) given arguments of wrong types raises nothing but :class:`H2OCompressError` subclasses (or returns).

Each example takes a call that works (a tiny LLaMA with a small BPE tokenizer, a tiny model directory, files in a
fresh folder), replaces one to three of its arguments by values drawn from ``strategies.wrong_values`` (``None``,
bools, 5,000-digit integers, NaN, texts with a lone surrogate, bytes, lists, dicts, a tensor, an object...) and makes
the call, consuming what it returns (a batch's results). A drawn value that is valid and slow (``compile=True``,
thousands of new tokens, 8/4-bit weights) is replaced by the working one: only the time is saved, not a check.

Settings (``strategies.fuzz``): 25 examples per callable (``H2O_HYPOTHESIS_SCALE`` multiplies them), no deadline,
derandomized. About 10 s in all (most calls stop at their first check).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers.strategies import fuzz, wrong_values
from helpers.tiny_lm import tiny_lm

import h2o_compress
from h2o_compress import CompressionConfig, H2OCompressError
from h2o_compress.cache.span import FULL_SPAN
from h2o_compress.formats import make_quantizer

_counter = itertools.count()


class Fresh:
    """A working argument made anew for each call (a cache that a call fills, an output file that must not exist)."""

    def __init__(self, make):
        self.make = make


def _slow(name: str, value) -> bool:
    """A valid value that would only make the call slow (compiling, thousands of tokens, bitsandbytes weights)."""
    integer = isinstance(value, int) and not isinstance(value, bool)
    return ((name in ("compile", "compiled") and value is True)
            or (name in ("max_new_tokens", "batch_size", "threads") and integer and value > 8)
            or (name == "weights_bits" and integer and value in (4, 8)))


#: Callables for which the extreme values (a lone surrogate, a 5,000-digit integer) are not drawn: none left
#: (save_cache/load_cache check their paths as utils.files.check_path does and name values with short()).
KNOWN_GAPS: set[str] = set()


def _calls(api) -> dict:
    """Name -> (callable, {argument: working value}) for every public callable; positional order as declared."""
    model, tokenizer, d = api["model"], api["tokenizer"], api["dir"]
    ok = dict(max_new_tokens=2, chat=False)
    policy = CompressionConfig(budget=0.5).eviction_policy()
    quantizer = make_quantizer(16, "int", 32, 32, False)
    job = dict(model=api["model_dir"], max_new_tokens=2, chat=False, threads=None, load={"device": "cpu"})
    new_output = Fresh(lambda: str(d / f"out{next(_counter)}.jsonl"))
    return {
        "generate": (h2o_compress.generate, dict(model=model, tokenizer=tokenizer, prompt="hello there", config=None,
                                                 temperature=0.0, seed=None, on_text=None, cache=None, **ok)),
        "stream": (h2o_compress.stream, dict(model=model, tokenizer=tokenizer, prompt="hello there", config=None,
                                             temperature=0.0, seed=None, cache=None, **ok)),
        "generate_batch": (h2o_compress.generate_batch, dict(
            model=model, tokenizer=tokenizer, requests=["hello there", {"id": "b", "prompt": "a b c"}], config=None,
            batch_size=2, temperature=0.0, seed=None, in_order=False, on_step=None, longest_first=True,
            refill=True, **ok)),
        "make_cache": (h2o_compress.make_cache, dict(model=model, config=None, max_length=16,
                                                     layer_capacities=None)),
        "save_cache": (h2o_compress.save_cache, dict(cache=Fresh(api["filled_cache"]),
                                                     path=Fresh(lambda: str(d / f"c{next(_counter)}.safetensors")),
                                                     model=model, overwrite=False)),
        "load_cache": (h2o_compress.load_cache, dict(path=api["cache_file"], model=model, config=None)),
        "compress": (h2o_compress.compress, dict(model=model, tokenizer=tokenizer, context="a short document here",
                                                 config=api["ask_config"], chat=False, on_progress=None)),
        "ask": (h2o_compress.ask, dict(model=model, tokenizer=tokenizer, context=api["context"], question="what?",
                                       max_new_tokens=2, temperature=0.0, seed=None, on_text=None)),
        "CompressedContext": (h2o_compress.CompressedContext, dict(cache=api["context"].cache, text="a b",
                                                                   chat=False)),
        "run_generate": (h2o_compress.run_generate, dict(prompt="hello", config=None, on_text=None, on_plan=None,
                                                         **job)),
        "GenerateJob": (h2o_compress.GenerateJob, dict(prompt="hello", config=None, **job)),
        "run_batch": (h2o_compress.run_batch, dict(input=api["prompts"], output=new_output, config=None,
                                                   batch_size=2, **job)),
        "BatchJob": (h2o_compress.BatchJob, dict(input=api["prompts"], output=new_output, config=None, **job)),
        "run_ask": (h2o_compress.run_ask, dict(questions=["what?"], context="a short document here",
                                               context_file=None, config=api["ask_config"], on_text=None,
                                               on_progress=None, **job)),
        "AskJob": (h2o_compress.AskJob, dict(questions=["what?"], context="a document", config=None, **job)),
        "load_model": (h2o_compress.load_model, dict(name_or_path=api["model_dir"], device="cpu", dtype=None,
                                                     trust_remote_code=False, weights_bits=16, device_map=None,
                                                     max_memory=None, offload_folder=None)),
        "model_dims": (h2o_compress.model_dims, dict(config=model.config)),
        "plan": (h2o_compress.plan, dict(model=model, memory="1GiB", batch=1, prompt_len=16, gen_len=4,
                                         weights_bits=16, dtype=None, profile=None, policies=("h2o",),
                                         budgets=(1.0, 0.5), bits=(16, 4), group_sizes=(32,), residuals=(3,),
                                         quant="int", heavy_ratio=0.5, sink_tokens=None, headroom=0,
                                         high_bits_fraction=0.0, head_budgets="uniform", layer_budgets="uniform",
                                         compiled=False)),
        "choose": (h2o_compress.choose, dict(model=model, memory="1GiB", batch=1, prompt_len=16, gen_len=4)),
        "choose_for_prompt": (h2o_compress.choose_for_prompt, dict(model=model, tokenizer=tokenizer, prompt="a b",
                                                                   memory="1GiB", max_new_tokens=4, chat=False,
                                                                   base=None)),
        "load_config": (h2o_compress.load_config, dict(path=api["config_file"], overrides=None, defaults=None)),
        "CompressionConfig": (CompressionConfig, dict(policy="h2o", budget=0.5, kv_bits=4, group_size=32,
                                                      residual=2, rotate=False, heavy_ratio=0.5, sink_tokens=1)),
        "CompressedCache": (h2o_compress.CompressedCache, dict(layers=Fresh(lambda: h2o_compress.make_cache(
            model, max_length=8).layers), config=CompressionConfig(), model_id="m", capacity=None)),
        "CompressedLayer": (h2o_compress.CompressedLayer, dict(
            layer_idx=0, policy=policy, capacity=8, key_quantizer=quantizer, value_quantizer=quantizer, residual=0,
            score_chunk_size=64, attention_kernel="auto", max_tokens=16, span=FULL_SPAN)),
    }


RECORDS = ["GenerationResult", "BatchRequest", "BatchResult", "BatchStats", "BatchReport", "GenerateReport",
           "AskReport", "PlanReport", "PlanRow"]
NOT_CALLED = {"H2OCompressError", "ConfigError", "ModelLoadError", "UnsupportedModelError", "InputError",
              "CacheStateError", "CacheFileError", "ASK_DEFAULTS", "DEFAULT_MODEL", "__version__",
              "serve"}  # serve runs until SIGTERM: tests/serving/test_server.py runs its app
CALLS = ["generate", "stream", "generate_batch", "make_cache", "save_cache", "load_cache", "compress", "ask",
         "CompressedContext", "run_generate", "GenerateJob", "run_batch", "BatchJob", "run_ask", "AskJob",
         "load_model", "model_dims", "plan", "choose", "choose_for_prompt", "load_config", "CompressionConfig",
         "CompressedCache", "CompressedLayer"]


def test_every_public_name_is_covered():
    """A name added to ``__all__`` gets a row here (or is listed as a record or as not callable)."""
    assert set(h2o_compress.__all__) == set(CALLS) | set(RECORDS) | NOT_CALLED


class Api(dict):
    """The working arguments (a dict) with a short repr, so a failing example prints the values drawn, not a model."""

    def __repr__(self) -> str:
        return "api"


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_model_dir):
    """The working arguments: a tiny LLaMA and tokenizer, a model directory, a saved cache, a compressed context,
    a prompts file and a config file, in a fresh folder."""
    from h2o_compress import compress, make_cache, save_cache

    model, tokenizer = tiny_lm()
    folder = tmp_path_factory.mktemp("api")

    def filled_cache():
        cache = make_cache(model, max_length=16)
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=cache)
        return cache

    (folder / "prompts.txt").write_text("hello there\nname a colour\n")
    (folder / "config.json").write_text('{"budget": 0.5, "kv_bits": 4}')
    ask_config = CompressionConfig(policy="h2o", budget=0.5)
    return Api({"model": model, "tokenizer": tokenizer, "dir": folder, "model_dir": tiny_model_dir,
            "filled_cache": filled_cache, "cache_file": str(save_cache(filled_cache(), folder / "saved.safetensors")),
            "context": compress(model, tokenizer, "a short document here", ask_config, chat=False),
            "ask_config": ask_config, "prompts": str(folder / "prompts.txt"), "config_file": str(folder / "config.json")})


def _call(function, arguments: dict):
    """``function`` with ``arguments`` (positional where it declares them so, as a caller would write it), its result
    consumed; torch's threads and random state are put back afterwards."""
    names = inspect.signature(function).parameters
    positional = [arguments[n] for n, p in names.items() if n in arguments
                  and p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    keywords = {n: v for n, v in arguments.items() if n not in names or names[n].default is not names[n].empty}
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            result = function(*positional, **keywords)
            if inspect.isgenerator(result) or type(result).__name__ in ("BatchRun", "GenerationStream"):
                list(result)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("name", CALLS)
@settings(fuzz(25), suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                            HealthCheck.data_too_large])
@given(data=st.data())
def test_wrong_types_raise_only_our_errors(api, name, data, monkeypatch, tmp_path):
    """One to three arguments of a working call replaced by wrong values: the call returns or raises an
    H2OCompressError subclass, never a TypeError, AttributeError, ValueError, OverflowError... (in a fresh folder,
    so a text drawn as a path names nothing of the repository)."""
    monkeypatch.chdir(tmp_path)
    function, good = _calls(api)[name]
    chosen = data.draw(st.lists(st.sampled_from(sorted(good)), min_size=1, max_size=3, unique=True), label="replaced")
    arguments = {}
    for argument, value in good.items():
        if argument in chosen:
            drawn = data.draw(wrong_values(extremes=name not in KNOWN_GAPS), label=argument)
            value = value if _slow(argument, drawn) else drawn
        arguments[argument] = value.make() if isinstance(value, Fresh) else value
    try:
        _call(function, arguments)
    except H2OCompressError:
        pass


@pytest.mark.parametrize("name", RECORDS)
@fuzz(5)
@given(data=st.data())
def test_result_records_take_any_values(name, data):
    """The result records (dataclasses filled by the library) are built from whatever they are given: no check of
    their own to raise anything else."""
    record = getattr(h2o_compress, name)
    fields = [f for f in dataclasses.fields(record) if f.init]
    values = [data.draw(wrong_values(), label=f.name) for f in fields]
    try:
        record(*values)
    except H2OCompressError:
        pass
