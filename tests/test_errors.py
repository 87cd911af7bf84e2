"""Bad input, everywhere: every class of docs/errors.md has a test here (persisted-cache files: test_persistence).

Python API: the error is one of ours (a ``ValueError`` subclass), one line, naming the bad value and what is
allowed. CLI: ``error: ...`` on one line, exit code 2, no traceback. Cases marked ``xfail(strict=True)`` need a
core change (listed in the reason); they start passing, and must then be unmarked, when the core adds the check.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import save_tiny_model_dir, tiny_llama
from typer.testing import CliRunner

from h2o_compress import (
    CacheStateError,
    CompressionConfig,
    ConfigError,
    H2OCompressError,
    InputError,
    ModelLoadError,
    UnsupportedModelError,
    generate,
    load_model,
    make_cache,
)
from h2o_compress.attention import use_h2o_attention
from h2o_compress.cli import app
from h2o_compress.config import check_format_options
from h2o_compress.config_file import load_config
from h2o_compress.models import resolve_device, resolve_dtype

runner = CliRunner()


def core(reason: str):
    """Marks a case that needs a core change (see the report); strict, so it is noticed once fixed."""
    return pytest.mark.xfail(strict=True, reason=f"core: {reason}")


def assert_ours(excinfo, fragment: str):
    """Our own ValueError subclass, one line, containing ``fragment``."""
    error = excinfo.value
    assert isinstance(error, H2OCompressError) and isinstance(error, ValueError), type(error)
    message = str(error)
    assert "\n" not in message, message
    assert fragment in message, message


# -- 1. compression settings (Python API) ---------------------------------------------------------------------
CONFIG_CASES = [
    ("budget-zero", dict(budget=0), "budget=0 is invalid; allowed: a fraction in (0, 1]"),
    ("budget-negative", dict(budget=-0.5), "budget=-0.5 is invalid"),
    ("budget-non-integer-above-1", dict(budget=2.5), "budget=2.5 is invalid"),
    ("budget-string", dict(budget="0.5"), "budget='0.5' is not a number"),
    ("budget-bool", dict(budget=True), "budget=True is not a number"),
    ("budget-nan", dict(budget=math.nan), "budget=nan is not finite"),
    ("budget-inf", dict(budget=math.inf), "budget=inf is not finite"),
    ("heavy-ratio-range", dict(heavy_ratio=1.5), "heavy_ratio=1.5 is out of range; allowed: [0, 1]"),
    ("heavy-ratio-type", dict(heavy_ratio=None), "heavy_ratio=None is not a number"),
    ("heavy-ratio-nan", dict(heavy_ratio=math.nan), "heavy_ratio=nan is not finite"),
    ("kv-bits", dict(kv_bits=3), "kv_bits=3 is not supported; allowed: 4, 8, 16"),
    ("k-bits", dict(k_bits=2), "k_bits=2 is not supported"),
    ("v-bits-type", dict(v_bits="4"), "v_bits='4' is not supported"),
    ("group-size", dict(group_size=48), "group_size=48 is not supported; allowed: 32, 64, 128"),
    ("residual-negative", dict(residual=-1), "residual=-1 is invalid; allowed: an integer >= 0"),
    ("residual-type", dict(residual=2.5), "residual=2.5 is invalid"),
    ("sink-tokens", dict(sink_tokens=-1), "sink_tokens=-1 is invalid; allowed: an integer >= 0"),
    ("score-chunk-size", dict(score_chunk_size=0), "score_chunk_size=0 is invalid; allowed: an integer >= 1"),
    ("attention-kernel", dict(attention_kernel="cuda"), "attention_kernel='cuda' is not supported; allowed: auto, torch, triton"),
    ("policy-unknown", dict(policy="lru"), "unknown policy 'lru'; allowed: a2sf, calibrated, full, h2o, h2o-mean, kvzip, local, lookahead, sink, snapkv, strided, tova"),
    ("policy-none", dict(policy=None), "unknown policy None"),
    ("lookahead-request-policy", dict(policy="h2o", lookahead_request="Names?"),
     "lookahead_request is set but policy='h2o'; allowed: lookahead_request with policy 'lookahead' only"),
    ("lookahead-request-empty", dict(policy="lookahead", lookahead_request="  "), "lookahead_request='  ' is invalid"),
    ("lookahead-request-type", dict(policy="lookahead", lookahead_request=3), "lookahead_request=3 is invalid"),
    ("quant-unknown", dict(quant="int3"), "unknown quant backend 'int3'; allowed: int, nf4, fp4, int8-blockwise"),
    ("quant-bits-combination", dict(quant="int8-blockwise", kv_bits=4), "allowed kv bits with it: 8, 16"),
    pytest.param("group-size-float", dict(group_size=32.0), "group_size=32.0 is not supported"),
    pytest.param("kv-bits-float", dict(kv_bits=4.0), "kv_bits=4.0 is not supported"),
    pytest.param("rotate-type", dict(rotate="yes"), "rotate='yes' is invalid"),
    pytest.param("policy-unhashable", dict(policy=["h2o"]), "unknown policy ['h2o']"),
]


@pytest.mark.parametrize("name,kwargs,fragment", CONFIG_CASES, ids=[
    c.values[0] if hasattr(c, "values") else c[0] for c in CONFIG_CASES
])
def test_bad_compression_setting(name, kwargs, fragment):
    with pytest.raises(ConfigError) as excinfo:
        CompressionConfig(**kwargs)
    assert_ours(excinfo, fragment)


# -- 2. config files -------------------------------------------------------------------------------------------
FILE_CASES = [
    ("missing", "none.json", None, "does not exist"),
    ("suffix", "settings.yaml", "budget: 0.5", "unsupported type; allowed: .json, .toml"),
    ("json-syntax", "s.json", '{"budget": 0.5,', "is not valid JSON"),
    ("toml-syntax", "s.toml", "budget = = 1", "is not valid TOML"),
    ("not-an-object", "s.json", "[1, 2]", "holds a list; allowed: an object of settings"),
    ("unknown-key", "s.json", '{"budgt": 0.5}', "unknown key(s) 'budgt'"),
    ("bad-value", "s.toml", "kv_bits = 5", "kv_bits=5 is not supported; allowed: 4, 8, 16 (in config file"),
    ("wrong-type", "s.json", '{"budget": "half"}', "budget='half' is not a number"),
    ("null-value", "s.json", '{"residual": null}', "residual=None is invalid"),
]


@pytest.mark.parametrize("name,filename,text,fragment", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_config_file(tmp_path, name, filename, text, fragment):
    path = tmp_path / filename
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    assert_ours(excinfo, fragment)
    result = runner.invoke(app, ["generate", "--config", str(path), "hello"])
    assert_cli_error(result, fragment)


def test_config_file_with_cli_overrides(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('policy = "sink"\nbudget = 0.25\nkv_bits = 4\n')
    assert load_config(path, {"kv_bits": 8}) == CompressionConfig(policy="sink", budget=0.25, kv_bits=8)


# -- 3. CLI options and prompts --------------------------------------------------------------------------------
def assert_cli_error(result, fragment: str):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert fragment in lines[0], lines[0]


LONG_PROMPT = " ".join(["w1"] * 4100)
CLI_CASES = [
    ("budget-range", ["--budget", "1.5"], "budget=1.5 is invalid"),
    ("budget-text", ["--budget", "half"], "budget='half' is not a number"),
    ("budget-nan", ["--budget", "nan"], "budget=nan is not finite"),
    ("heavy-ratio", ["--heavy-ratio", "-0.1"], "heavy_ratio=-0.1 is out of range"),
    ("heavy-ratio-inf", ["--heavy-ratio", "inf"], "heavy_ratio=inf is not finite"),
    ("kv-bits", ["--kv-bits", "3"], "kv_bits=3 is not supported"),
    ("v-bits", ["--v-bits", "2"], "v_bits=2 is not supported"),
    ("group-size", ["--group-size", "16"], "group_size=16 is not supported"),
    ("residual", ["--residual", "-3"], "residual=-3 is invalid"),
    ("sink-tokens", ["--sink-tokens", "-1"], "sink_tokens=-1 is invalid"),
    ("policy", ["--policy", "lru"], "unknown policy 'lru'"),
    ("quant", ["--quant", "q4_0"], "unknown quant backend 'q4_0'"),
    ("quant-bits", ["--quant", "int8-blockwise", "--kv-bits", "4"], "'int8-blockwise' is an 8-bit format"),
    ("quant-16-bits", ["--quant", "nf4"], "quant='nf4' quantizes nothing with 16-bit keys and values"),
    ("model-unknown", ["--model", "no/such/model"], "unknown model 'no/such/model'"),
    ("device", ["--device", "tpu"], "unknown device 'tpu'; allowed: auto, cpu, cuda, cuda:N"),
    ("device-unavailable", ["--device", "cuda:0"], "CUDA is not available"),
    ("dtype", ["--dtype", "float8"], "unknown dtype 'float8'; allowed: float32"),
]


def test_a_format_option_the_bits_make_moot_is_refused_where_it_was_given(tmp_path):
    """``--quant nf4`` without 4 or 8 bits, or ``rotate`` (config file) at 16 bits or with a bitsandbytes format,
    would be ignored: refused by every command, from a flag or a config file; what the user did not give is not
    checked (``rotate`` defaults to True), and the same options with quantized bits pass."""
    fragment = "quant='fp4' quantizes nothing with 16-bit keys and values"
    assert_cli_error(runner.invoke(app, ["eval", "perplexity", "--quant", "fp4"]), fragment)
    context = tmp_path / "context.txt"
    context.write_text("A short document.")
    assert_cli_error(runner.invoke(app, ["ask", "--quant", "fp4", "--kv-bits", "16", "--context-file", str(context),
                                         "--question", "q"]), fragment)
    for text, moot in (('{"rotate": true}', "16-bit keys and values"), ('{"rotate": true, "kv_bits": 4, "quant": '
                                                                       '"nf4"}', "quant='nf4'")):
        path = tmp_path / "c.json"
        path.write_text(text)
        result = runner.invoke(app, ["generate", "--config", str(path), "hello"])
        assert_cli_error(result, f"rotate=True rotates before int quantization, which {moot} does not run")
    config = CompressionConfig(quant="nf4", kv_bits=4)
    check_format_options(config, {"quant"})  # nf4 runs; rotate=True is the default, not given
    check_format_options(CompressionConfig(rotate=True), set())
    with pytest.raises(ConfigError, match="quant='nf4' quantizes nothing"):
        check_format_options(CompressionConfig(quant="nf4", kv_bits=16), {"quant"})


@pytest.mark.parametrize("name,args,fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_cli_option(name, args, fragment):
    if name == "device-unavailable" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert_cli_error(runner.invoke(app, ["generate", *args, "hello"]), fragment)


MODEL_CLI_CASES = [
    ("max-new-tokens", ["--max-new-tokens", "0"], "w1 w2", "max_new_tokens=0 is invalid; allowed: an integer >= 1"),
    ("temperature-negative", ["--temperature", "-1"], "w1 w2", "temperature=-1.0 is invalid"),
    ("temperature-inf", ["--temperature", "inf"], "w1 w2", "temperature=inf is invalid"),
    ("group-size-head-dim", ["--kv-bits", "4", "--group-size", "64"], "w1", "does not divide the model's head_dim=32"),
    ("prompt-too-long", [], LONG_PROMPT, "prompt of 4100 tokens exceeds the model's context of 4096 tokens; allowed: a shorter text"),
]


@pytest.mark.parametrize("name,args,prompt,fragment", MODEL_CLI_CASES, ids=[c[0] for c in MODEL_CLI_CASES])
def test_bad_cli_input_on_a_model(tiny_model_dir, name, args, prompt, fragment):
    result = runner.invoke(app, ["generate", "--model", tiny_model_dir, "--device", "cpu", "--no-chat", *args, prompt])
    assert_cli_error(result, fragment)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"], ids=["empty", "spaces", "whitespace"])
def test_empty_prompt(prompt):
    assert_cli_error(runner.invoke(app, ["generate", prompt]), "is empty; allowed: a non-empty text")


def test_wrong_type_flag_is_a_usage_error_without_traceback():
    result = runner.invoke(app, ["generate", "--kv-bits", "abc", "hello"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Invalid value for '--kv-bits'" in result.output


# -- 4. models and devices (Python API) ----------------------------------------------------------------------
@pytest.fixture
def broken_model_dir(tmp_path):
    """Factory: a copy of the tiny model directory with one file replaced by ``content`` (None: removed)."""

    def make(name: str, content: bytes | None):
        path = tmp_path / "model"
        save_tiny_model_dir(path)
        if content is None:
            (path / name).unlink()
        else:
            (path / name).write_bytes(content(path / name) if callable(content) else content)
        return str(path)

    return make


def test_unknown_and_empty_model_names():
    for name, fragment in [("nope", "unknown model 'nope'; allowed: an alias (smollm2-135m)"),
                           ("  ", "model name '  ' is empty"), (None, "model name None is empty")]:
        with pytest.raises(ModelLoadError) as excinfo:
            load_model(name, device="cpu")
        assert_ours(excinfo, fragment)


def test_missing_model_file(broken_model_dir):
    path = broken_model_dir("model.safetensors", None)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(path, device="cpu")
    assert_ours(excinfo, "cannot load model")
    assert_cli_error(runner.invoke(app, ["generate", "--model", path, "w1"]), "cannot load model")


def test_corrupt_model_config(broken_model_dir):
    path = broken_model_dir("config.json", b"{not json")
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(path, device="cpu")
    assert_ours(excinfo, "cannot load model")
    assert_cli_error(runner.invoke(app, ["generate", "--model", path, "w1"]), "cannot load model")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_model_weights(broken_model_dir, damage):
    content = b"garbage" * 10 if damage == "garbage" else (lambda p: p.read_bytes()[: p.stat().st_size // 2])
    path = broken_model_dir("model.safetensors", content)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(path, device="cpu")
    assert_ours(excinfo, "cannot load model")


@pytest.mark.parametrize("device,fragment", [
    ("tpu", "unknown device 'tpu'"), ("cuda:x", "unknown device 'cuda:x'"), (5, "unknown device 5"),
])
def test_bad_device(device, fragment):
    with pytest.raises(ConfigError) as excinfo:
        resolve_device(device)
    assert_ours(excinfo, fragment)


@pytest.mark.parametrize("dtype", ["float8", 5, "int8"])
def test_bad_dtype(dtype):
    with pytest.raises(ConfigError) as excinfo:
        resolve_dtype(dtype, torch.device("cpu"))
    assert_ours(excinfo, f"unknown dtype {dtype!r}; allowed: float32")


def test_model_without_attention_interface():
    with pytest.raises(UnsupportedModelError) as excinfo:
        make_cache(torch.nn.Linear(2, 2))
    assert_ours(excinfo, "model class Linear does not route attention through transformers' AttentionInterface")


# -- 5. make_cache / generate arguments ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_length=0), "max_length=0 is invalid; allowed: an integer >= 1"),
    (dict(max_length="10"), "max_length='10' is invalid"),
    (dict(config=CompressionConfig(budget=0.5)), "budget=0.5 is a fraction, so the cache needs the sequence length"),
    (dict(config=CompressionConfig(kv_bits=4, group_size=64)), "group_size=64 does not divide the model's head_dim=32"),
    pytest.param(dict(config="h2o"), "config='h2o' is invalid"),
])
def test_bad_make_cache_arguments(model, kwargs, fragment):
    with pytest.raises(ConfigError) as excinfo:
        make_cache(model, **kwargs)
    assert_ours(excinfo, fragment)


def test_generate_refuses_objects_of_the_wrong_kind(model, tokenizer):
    """A name where the model goes, no tokenizer, a non-callable on_text: one ConfigError each (they were an
    AttributeError / TypeError from deep inside)."""
    for args, kwargs, fragment in [(("smollm2-135m", tokenizer), {}, "model='smollm2-135m' is not a loaded"),
                                   ((model, None), {}, "tokenizer=None is not a tokenizer"),
                                   ((model, tokenizer), dict(on_text=1), "on_text=1 is not callable")]:
        with pytest.raises(ConfigError) as excinfo:
            generate(*args, "w1 w2", max_new_tokens=2, chat=False, **kwargs)
        assert_ours(excinfo, fragment)


@pytest.mark.parametrize("prompt,kwargs,error,fragment", [
    ("", {}, InputError, "prompt '' is empty"),
    (" \n ", {}, InputError, "is empty; allowed: a non-empty text"),
    (None, {}, InputError, "prompt None is a NoneType, not a text"),
    (b"hi", {}, InputError, "is a bytes, not a text; allowed: a non-empty str"),
    (LONG_PROMPT, {}, InputError, "prompt of 4100 tokens exceeds the model's context of 4096"),
    ("w1", dict(max_new_tokens=0), ConfigError, "max_new_tokens=0 is invalid"),
    ("w1", dict(max_new_tokens=2.5), ConfigError, "max_new_tokens=2.5 is invalid"),
    ("w1", dict(temperature=-0.5), ConfigError, "temperature=-0.5 is invalid"),
    ("w1", dict(temperature=math.nan), ConfigError, "temperature=nan is invalid"),
    pytest.param("w1", dict(temperature=1.0, seed="x"), ConfigError, "seed='x' is invalid"),
], ids=["empty", "whitespace", "none", "bytes", "too-long", "max-new-tokens-0", "max-new-tokens-float", "temperature",
        "temperature-nan", "seed-type"])
def test_bad_generate_arguments(model, tokenizer, prompt, kwargs, error, fragment):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(error) as excinfo:
        generate(model, tokenizer, prompt, chat=False, **kwargs)
    assert_ours(excinfo, fragment)


# -- 6. a cache reused where it does not belong ---------------------------------------------------------------
def prefilled(model, batch=1):
    cache = make_cache(model, CompressionConfig(budget=8, kv_bits=4))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (batch, 5)), past_key_values=cache)
    return cache


def step(model, cache, batch=1):
    with torch.no_grad():
        return model(input_ids=torch.randint(0, 128, (batch, 1)), past_key_values=cache).logits


def test_cache_reused_with_another_batch_size(model):
    with pytest.raises(CacheStateError) as excinfo:
        step(model, prefilled(model), batch=2)
    assert_ours(excinfo, "cache holds batch=1, kv_heads=2, head_dim=32 but got batch=2")


def test_cache_reused_with_a_model_of_other_kv_heads(model):
    other = tiny_llama(seed=0, kv_heads=1, heads=2)
    use_h2o_attention(other)
    with pytest.raises(CacheStateError) as excinfo:
        step(other, prefilled(model))
    assert_ours(excinfo, "cache holds batch=1, kv_heads=2, head_dim=32 but got batch=1, kv_heads=1")


def test_cache_reused_with_a_model_of_other_head_dim(model):
    other = tiny_llama(seed=0, head_dim=64)
    use_h2o_attention(other)
    with pytest.raises(CacheStateError) as excinfo:
        step(other, prefilled(model))
    assert_ours(excinfo, "head_dim")


def test_cache_reused_with_a_model_of_more_layers(model):
    other = tiny_llama(seed=0, layers=3)
    use_h2o_attention(other)
    with pytest.raises(CacheStateError) as excinfo:
        step(other, prefilled(model))
    assert_ours(excinfo, "another model")  # bound to the first model before the layer count matters


def test_cache_reused_with_another_model_of_the_same_shape(model):
    other = tiny_llama(seed=3)
    use_h2o_attention(other)
    with pytest.raises(CacheStateError) as excinfo:
        step(other, prefilled(model))
    assert_ours(excinfo, "another model")


# -- 7. NaN / Inf in inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_inputs_are_refused(model, bad):
    cache = make_cache(model, CompressionConfig(budget=8, kv_bits=4))
    embeds = model.model.embed_tokens(torch.randint(0, 128, (1, 5))).detach()
    embeds[0, 2, 0] = bad
    with pytest.raises(InputError) as excinfo, torch.no_grad():
        model(inputs_embeds=embeds, past_key_values=cache)
    assert_ours(excinfo, "not finite")
    assert cache.get_seq_length() == 0  # refused before anything was stored


def test_non_finite_keys_in_a_direct_update_are_refused(model):
    cache = make_cache(model, CompressionConfig(budget=8, kv_bits=4))
    keys = torch.zeros(1, 2, 3, 32)
    keys[0, 1, 2, 5] = math.nan
    with pytest.raises(InputError) as excinfo:
        cache.layers[0].update(keys, torch.zeros_like(keys))
    assert_ours(excinfo, "not finite")


def test_every_error_class_is_a_value_error():
    from h2o_compress.utils import errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) >= 7
    assert all(issubclass(c, H2OCompressError) and issubclass(c, ValueError) for c in classes)
