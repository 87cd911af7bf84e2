"""CLI: one-line errors with exit code 2 for bad input; the --json figures on a tiny local model."""

from __future__ import annotations

import json

import pytest
from conftest import save_tiny_model_dir
from typer.testing import CliRunner

from h2o_compress.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny LLaMA (head_dim 32) with a word-level tokenizer, as a local Hugging Face directory."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--budget", "0"], "budget=0 is invalid"),
        (["--budget", "-0.5"], "budget=-0.5 is invalid"),
        (["--budget", "1.5"], "budget=1.5 is invalid"),
        (["--budget", "abc"], "budget='abc' is not a number"),
        (["--heavy-ratio", "1.5"], "heavy_ratio=1.5 is out of range"),
        (["--kv-bits", "3"], "kv_bits=3 is not supported; allowed: 4, 8, 16"),
        (["--k-bits", "2"], "k_bits=2 is not supported"),
        (["--group-size", "48"], "group_size=48 is not supported; allowed: 32, 64, 128"),
        (["--policy", "random"], "unknown policy 'random'; allowed: a2sf, calibrated, full, h2o, h2o-mean, kvzip, local, lookahead, sink, snapkv, strided, tova"),
        (["--quant", "int3"], "unknown quant backend 'int3'"),
        (["--residual", "-1"], "residual=-1 is invalid"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--device", "tpu"], "device"),
    ],
)
def test_bad_options_give_one_line_and_exit_2(args, message):
    result = runner.invoke(app, ["generate", *args, "hello"])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_empty_prompt_is_refused():
    result = runner.invoke(app, ["generate", "   "])
    assert result.exit_code == 2 and "prompt '   ' is empty" in result.output


def test_group_size_must_divide_head_dim(tiny_dir):
    result = runner.invoke(app, ["generate", "--model", tiny_dir, "--kv-bits", "4", "--group-size", "64", "w1 w2"])
    assert result.exit_code == 2
    assert "group_size=64 does not divide the model's head_dim=32; allowed: 32" in result.output


def test_json_figures_on_a_local_model(tiny_dir):
    result = runner.invoke(
        app,
        ["generate", "--model", tiny_dir, "--no-chat", "--budget", "0.5", "--kv-bits", "4", "--max-new-tokens",
         "12", "--json", " ".join(f"w{i}" for i in range(20))],
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    for key in ("text", "prompt_tokens", "new_tokens", "kv_bytes", "kv_bytes_full_fp16", "decode_tokens_per_s", "prefill_s"):
        assert key in figures
    assert figures["prompt_tokens"] == 20
    assert figures["capacity"] == 16  # ceil(0.5 x (20 + 12))
    assert 0 < figures["kv_bytes"] < figures["kv_bytes_full_fp16"]
    assert figures["compiled"] is False and figures["decode_kernel"] == "cpu"  # CPU default: the C kernel, eager


def test_summary_names_the_decode_kernel(tiny_dir):
    words = " ".join(f"w{i}" for i in range(20))
    for kernel in ("auto", "torch"):
        result = runner.invoke(app, ["generate", "--model", tiny_dir, "--no-chat", "--budget", "0.5", "--kv-bits", "4",
                                     "--max-new-tokens", "4", "--kernel", kernel, words])
        assert result.exit_code == 0, result.output
        expected = "cpu" if kernel == "auto" else "torch"
        assert f"tokens/s eager, {expected} attention]" in result.stderr


def test_unsupported_model_is_refused():
    """GPT-J computes attention in its own module, outside AttentionInterface (a model the cache cannot score)."""
    from transformers import GPTJConfig, GPTJForCausalLM

    from h2o_compress import UnsupportedModelError, make_cache

    config = GPTJConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, rotary_dim=8, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    with pytest.raises(UnsupportedModelError, match="GPTJForCausalLM does not route attention through"):
        make_cache(GPTJForCausalLM(config))


def test_unreachable_hub_id_fails_fast_with_one_line(monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    start = time.perf_counter()
    result = runner.invoke(app, ["generate", "--model", "no-such-org/no-such-model", "hello"])
    assert result.exit_code == 2
    assert "cannot load model 'no-such-org/no-such-model'" in result.output
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("flags,named", [(["--budget", "0.5"], "--budget"), (["--kv-bits", "8"], "--kv-bits"),
                                         (["--group-size", "64", "--v-bits", "4"], "--v-bits, --group-size")])
def test_memory_limit_refuses_the_settings_it_picks(flags, named):
    """``--memory-limit`` picks budget, bits and group size: given ones used to be replaced silently."""
    result = runner.invoke(app, ["generate", "--model", "/no/such/model", "--memory-limit", "2GiB", *flags, "hi"])
    assert result.exit_code == 2 and f"so {named} (given on the command line or in --config) would be ignored" in result.output


def test_memory_limit_and_load_cache_are_exclusive(tmp_path):
    result = runner.invoke(app, ["generate", "--memory-limit", "2GiB", "--load-cache", str(tmp_path / "c.safetensors"), "hi"])
    assert result.exit_code == 2 and "cannot be combined" in result.output


def test_prompt_from_a_file_or_standard_input_equals_the_argument(tiny_dir, tmp_path):
    words = " ".join(f"w{i}" for i in range(20))
    base = ["generate", "--model", tiny_dir, "--no-chat", "--budget", "8", "--kv-bits", "4", "--max-new-tokens", "4",
            "--json"]
    path = tmp_path / "prompt.txt"
    path.write_text(words, encoding="utf-8")
    texts = []
    for extra, given in (([words], None), (["--prompt-file", str(path)], None), (["--prompt-file", "-"], words)):
        result = runner.invoke(app, base + extra, input=given)
        assert result.exit_code == 0, result.output
        texts.append((json.loads(result.stdout)["text"], json.loads(result.stdout)["prompt_tokens"]))
    assert texts[0] == texts[1] == texts[2] and texts[0][1] == 20
    for extra in ([], [words, "--prompt-file", str(path)]):
        refused = runner.invoke(app, base + extra)
        assert refused.exit_code == 2 and "give the prompt as the argument or with --prompt-file" in refused.output


def test_version_is_printed():
    from h2o_compress.utils.version import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"h2o-compress {__version__}"
