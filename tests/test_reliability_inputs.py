"""Issue 34, the input classes: each value below used to end in a traceback (or be accepted silently); now one
clean error. CLI: one ``error: ...`` line, exit code 2. API: an :class:`H2OCompressError` naming the value and what
is allowed."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from h2o_compress.cli import app
from h2o_compress.config import CompressionConfig, layer_weights
from h2o_compress.config_file import load_config
from h2o_compress.models.weights import (check_weight_options, parse_device_map,
                                         parse_max_memory)
from h2o_compress.utils.errors import ConfigError, H2OCompressError

runner = CliRunner()


def assert_cli_error(result, fragment: str):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert fragment in lines[0], lines[0]


# -- 1. layer weights whose sum overflows ------------------------------------------------------------------------
def test_huge_layer_weights_are_refused_before_arithmetic():
    with pytest.raises(ConfigError, match="each at most 1e\\+100"):
        CompressionConfig(budget=64, layer_budgets=(1e308, 1e308))
    with pytest.raises(ConfigError, match="not per-layer weights"):  # an int too large for a float: no OverflowError
        CompressionConfig(budget=64, layer_budgets=(10**400, 1))
    caps = CompressionConfig(budget=64, layer_budgets=(1e100, 1e100, 1e-300)).layer_capacities(64, 3)
    assert sum(caps) == 192 and all(c >= 1 for c in caps)


def test_cli_huge_layer_weights_file(tmp_path):
    path = tmp_path / "w.json"
    path.write_text('{"weights": [1e308, 1e308]}')
    assert_cli_error(runner.invoke(app, ["generate", "--layer-budgets", str(path), "hello"]), "each at most")


# -- 2. huge integers in settings files and --device-map ---------------------------------------------------------
@pytest.mark.parametrize("number", ["9" * 5000, "9" * 400, "1e400"])
def test_huge_numbers_in_layer_weights_file(tmp_path, number):
    path = tmp_path / "w.json"
    path.write_text(f'{{"weights": [{number}, 1]}}')
    with pytest.raises(ConfigError, match="layer_budgets file .* holds (an integer of|the number)"):
        layer_weights(str(path))


@pytest.mark.parametrize("suffix,text", [
    (".json", '{"residual": ' + "9" * 5000 + "}"),
    (".toml", "residual = " + "9" * 5000 + "\n"),
    (".toml", "residual = " + "9" * 40 + "\n"),
    (".json", '{"heavy_ratio": 1e400}'),
    (".toml", "heavy_ratio = inf\n"),
])
def test_huge_numbers_in_config_file(tmp_path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "config file" in message and "set_int_max_str_digits" not in message
    assert "integer" in message or "not finite" in message
    assert_cli_error(runner.invoke(app, ["generate", "--config", str(path), "hello"]), "config file")


@pytest.mark.parametrize("text,fragment", [
    ('{"model": ' + "9" * 5000 + "}", "holds an integer of 5000 digits"),
    ('{"model": "' + "9" * 5000 + '"}', "is invalid"),
    ('{"model": 1e400}', "not finite"),
])
def test_huge_numbers_in_device_map(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_device_map(text)
    assert_cli_error(runner.invoke(app, ["generate", "--device-map", text, "hello"]), fragment)


def test_huge_numbers_in_max_memory():
    for value in ("cpu=" + "9" * 5000, "²=1GiB"):
        with pytest.raises(ConfigError, match="max_memory entry"):
            parse_max_memory(value)


# -- 3. nested layer-weights files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,fragment", [
    ('{"weights": [[1, 2], [3]]}', "not per-layer weights"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"weights": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_nested_layer_weights_file(tmp_path, text, fragment):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        layer_weights(str(path))
    assert_cli_error(runner.invoke(app, ["generate", "--layer-budgets", str(path), "hello"]), fragment)


# -- 4. a lone surrogate in the lookahead request ------------------------------------------------------------------
def test_lookahead_request_must_be_valid_unicode():
    with pytest.raises(ConfigError, match="lookahead_request holds a character that is not valid Unicode"):
        CompressionConfig(policy="lookahead", lookahead_request="facts \ud800")
    assert_cli_error(runner.invoke(app, ["generate", "--policy", "lookahead", "--lookahead-request", "\ud800", "hi"]),
                     "not valid Unicode")


# -- 5. a GPU index written with non-ASCII digits ------------------------------------------------------------------
@pytest.mark.parametrize("index", ["²", "٣", "１"])
def test_device_map_index_must_be_ascii_digits(index):
    text = f'{{"model": "{index}"}}'
    with pytest.raises(ConfigError, match="ASCII digits"):
        parse_device_map(text)
    assert_cli_error(runner.invoke(app, ["generate", "--device-map", text, "hello"]), "ASCII digits")


# -- 6. oversized inputs refused before parsing --------------------------------------------------------------------
def test_large_device_map_is_refused_before_parsing(tmp_path):
    text = "{" + ",".join(f'"m{i}": "cpu"' for i in range(200_000)) + "}"  # ~3 MB
    with pytest.raises(ConfigError, match="is too long"):
        parse_device_map(text)
    path = tmp_path / "map.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="has .* bytes; allowed: at most"):
        parse_device_map(str(path))
    assert_cli_error(runner.invoke(app, ["generate", "--device-map", str(path), "hello"]), "bytes; allowed")


def test_large_layer_weights_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "w.json"
    with open(path, "wb") as handle:  # sparse: 17 MiB of nothing, past the 16 MiB limit
        handle.truncate(17 * 2**20)
    with pytest.raises(ConfigError, match="has 17825792 bytes; allowed: at most"):
        layer_weights(str(path))


# -- 7. offload_folder of the wrong type ---------------------------------------------------------------------------
@pytest.mark.parametrize("device_map", ["auto", None])
def test_offload_folder_type(device_map):
    with pytest.raises(ConfigError, match="offload_folder=5 is of type int; allowed: a directory path"):
        check_weight_options(device_map=device_map, offload_folder=5)


def test_load_model_offload_folder_type():
    from h2o_compress import load_model

    with pytest.raises(H2OCompressError, match="offload_folder=5"):
        load_model("smollm2-135m", device_map="auto", offload_folder=5)


# -- 8. a float for an integer option --------------------------------------------------------------------------------
def test_weights_bits_float_is_refused():
    with pytest.raises(ConfigError, match="weights_bits=4.0 is not supported"):
        check_weight_options(weights_bits=4.0)
    assert check_weight_options(weights_bits=4).bits == 4
    # The CLI's integer options go through typer, which reads "4.0" as the integer 4 (the same value) and refuses
    # "4.5" itself (its usage error, exit code 2) before any of ours runs.
    result = runner.invoke(app, ["generate", "--weights-bits", "4.5", "hello"])
    assert result.exit_code == 2 and "Traceback" not in result.output and "--weights-bits" in result.output


# -- 9. lm-eval model_args ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arg,fragment", [
    ("max_length=" + "9" * 5000, "max_length=inf is invalid"),
    ("max_length=0", "max_length=0 is invalid"),
    ("max_length=2.5", "max_length=2.5 is invalid"),
    ("softmax_dtype=garbage", "softmax_dtype='garbage' is not supported"),
])
def test_lm_eval_model_args_checked(arg, fragment):
    pytest.importorskip("lm_eval")
    from lm_eval.utils import simple_parse_args_string

    from h2o_compress.integrations.lm_eval_model import check_model_args

    with pytest.raises(ConfigError, match=fragment.replace("(", "\\(")):
        check_model_args(simple_parse_args_string(f"pretrained=x,{arg}"))
    result = runner.invoke(app, ["eval", "lm-eval", "--model-args", f"pretrained=x,{arg}", "--tasks", "arc_easy"])
    assert_cli_error(result, fragment)


def test_lm_eval_model_args_good_values_pass():
    pytest.importorskip("lm_eval")
    from h2o_compress.integrations.lm_eval_model import check_model_args

    check_model_args({"pretrained": "x", "max_length": 2048, "softmax_dtype": "float32"})


def test_checkpoint_names_with_odd_digits_sort_without_raising():
    from h2o_compress.models.loading import _some

    assert "layers.2" in _some(["layers.10", "layers.²", "layers.2", "layers." + "9" * 5000])


@pytest.mark.parametrize("field,value", [("sink_tokens", 10**18 - 1), ("score_chunk_size", 10**18 - 1)])
def test_token_counts_past_any_context_are_refused(field, value, tmp_path):
    """(An integer ``budget`` stays unbounded in the API: the cache caps it at what it sees and refuses storage the
    device cannot hold, tests/cache/test_cache.py; ``--budget`` is bounded by parse_budget.)"""
    with pytest.raises(ConfigError, match=f"{field}=.* too large; allowed: .*{2**31 - 1}"):
        CompressionConfig(**{field: value})
    path = tmp_path / "c.json"
    path.write_text(f'{{"{field}": {value!r}}}')
    assert_cli_error(runner.invoke(app, ["generate", "--config", str(path), "hello"]), "too large")
