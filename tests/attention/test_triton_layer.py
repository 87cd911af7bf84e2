"""The compressed layer's decode step through the Triton op (``attention_kernel='triton'``) against its torch form.

On the CPU the op runs under the Triton interpreter (``TRITON_INTERPRET=1``, tests/conftest.py), so the models
are the tiny ones and the runs short. What is checked: the same logits as the torch form (one token per step
read at full precision in its new slot, as there) and the same tokens kept, eagerly and captured by Dynamo with
``fullgraph=True`` (one graph, buffers written in place); and a clear error where the op cannot run.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import TINY_MODELS
from helpers import decode_steps
from helpers.decode_steps import eager_and_compiled, run, setting

from h2o_compress import CompressionConfig, ConfigError, make_cache
from h2o_compress.runtime.compiled import INDUCTOR_OPTIONS, decode_step
from h2o_compress.attention import slot_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and slot_attention.supported(torch.device("cpu"), 32, ()) is not None,
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@pytest.fixture(autouse=True)
def short_runs(monkeypatch):
    """8 decode steps (capacity 12 of 28 tokens: an eviction every step): the interpreter is slow."""
    monkeypatch.setattr(decode_steps, "STEPS", 8)


def kept(cache) -> list[torch.Tensor]:
    return [layer.positions() for layer in cache.layers]


@pytest.mark.parametrize("policy,bits", [("h2o", 4), ("tova", 8), ("h2o", 16)])
def test_triton_step_matches_torch_form(policy, bits):
    model = TINY_MODELS["llama"]()
    with torch.inference_mode():
        reference, torch_cache, _, _ = run(model, setting(policy, bits, "torch"), decode_step)
        ours, cache, before, after = run(model, setting(policy, bits, "triton"), decode_step)
    assert all((layer.backend.name == "triton") and not (layer.backend.name == "cpu") for layer in cache.layers)
    assert after == before
    torch.testing.assert_close(ours, reference, atol=2e-4, rtol=0)
    for a, b in zip(kept(cache), kept(torch_cache)):
        assert torch.equal(a, b)
    if cache.layers[0].setting.with_scores:
        for a, b in zip(cache.layers, torch_cache.layers):
            torch.testing.assert_close(a.store.scores, b.store.scores, atol=1e-4, rtol=0)


def test_triton_step_captures_in_one_graph():
    model = TINY_MODELS["llama"]()
    config = setting("h2o", 4, "triton")
    eager, ours, cache, before, after, graphs = eager_and_compiled(model, config, "aot_eager")
    assert graphs <= 2
    assert after == before
    scratch = [layer.backend.scratch.part_acc.data_ptr() for layer in cache.layers]
    assert all((layer.backend.name == "triton") for layer in cache.layers)
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)
    assert scratch == [layer.backend.scratch.part_acc.data_ptr() for layer in cache.layers]  # allocated once


def test_triton_step_under_inductor_matches_eager():
    """Inductor (not only Dynamo) compiles the fused step, with the new token's rotation fused into its ring-write
    kernel (a product + sum instead of the eager matmul): the same tokens kept and the eager logits to float
    reassociation (5e-4, as tests/runtime/test_compile.py allows a quantized cache under Inductor)."""
    model = TINY_MODELS["llama"]()
    config = setting("h2o", 4, "triton")
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, options=dict(INDUCTOR_OPTIONS))
    with torch.inference_mode():
        eager, eager_cache, _, _ = run(model, config, decode_step)
        ours, cache, before, after = run(model, config, compiled)
    assert all((layer.backend.name == "triton") for layer in cache.layers)
    assert after == before
    torch.testing.assert_close(ours, eager, atol=5e-4, rtol=0)
    for a, b in zip(kept(cache), kept(eager_cache)):
        assert torch.equal(a, b)


def test_triton_refused_where_it_cannot_run(monkeypatch):
    """``make_cache`` refuses the op for a format it does not read, or a device it does not run on, before it
    switches the model's attention; a cache whose layers meet a device the op cannot run on (built here while the
    op could) refuses at its first token, naming the layer."""
    model = TINY_MODELS["llama"]()
    before = model.config._attn_implementation
    with pytest.raises(ConfigError, match="attention_kernel='triton' cannot run: the NF4Quantizer format"):
        make_cache(model, CompressionConfig(budget=12, kv_bits=4, quant="nf4", attention_kernel="triton"), max_length=40)
    assert model.config._attn_implementation == before  # refused before the model was touched
    config = CompressionConfig(budget=12, kv_bits=4, attention_kernel="triton")
    cache = make_cache(model, config, max_length=40)
    monkeypatch.setattr(slot_attention, "device_reason", lambda device: f"no GPU here ({device})")
    with pytest.raises(ConfigError, match=r"cannot run: no GPU here \(cpu\); allowed: .*or a CUDA device"):
        make_cache(model, config, max_length=40)
    with pytest.raises(ConfigError, match=r"attention_kernel='triton' cannot run layer 0: no GPU here \(cpu\)"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), past_key_values=cache)


def test_cli_refuses_triton_on_a_device_it_cannot_run_on_before_loading(monkeypatch, tmp_path):
    """``--kernel triton`` is checked against the device with the other options: nothing is loaded."""
    from typer.testing import CliRunner

    from h2o_compress import models
    from h2o_compress.cli import app

    monkeypatch.setattr(slot_attention, "device_reason", lambda device: f"no GPU here ({device})")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    context = tmp_path / "context.txt"
    context.write_text("A short document.", encoding="utf-8")
    commands = (["generate", "some text"], ["ask", "--context-file", str(context), "--question", "What?"],
                ["eval", "perplexity"], ["eval", "needle"], ["eval", "agreement"],
                ["profile", "--out", str(tmp_path / "profile")])
    for command in commands:
        result = CliRunner().invoke(app, [*command, "--kernel", "triton", "--device", "cpu"])
        assert result.exit_code == 2, (command, result.output)
        assert "attention_kernel='triton' cannot run: no GPU here (cpu)" in result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "profile").exists()


def test_profile_runs_every_configuration_with_the_kernel_asked_for(monkeypatch):
    from h2o_compress.profiling.sweep import ProfileSettings

    settings = ProfileSettings(device="cpu", policies=("h2o",), budgets=(0.5, 1.0), kv_bits=(16, 4),
                               attention_kernel="torch")
    assert {config.attention_kernel for config in settings.configs()} == {"torch"}
    monkeypatch.setattr(slot_attention, "device_reason", lambda device: f"no GPU here ({device})")
    with pytest.raises(ConfigError, match=r"attention_kernel='triton' cannot run: no GPU here \(cpu\)"):
        ProfileSettings(device="cpu", attention_kernel="triton")


def test_auto_on_cpu_keeps_the_cpu_kernel():
    model = TINY_MODELS["llama"]()
    with torch.inference_mode():
        _, cache, _, _ = run(model, setting("h2o", 4, "auto"), decode_step)
    assert not any((layer.backend.name == "triton") for layer in cache.layers)


class _CountRecords(logging.Handler):
    """Counts log records whose message holds ``prefix``."""

    def __init__(self, prefix: str):
        super().__init__(logging.INFO)
        self.prefix, self.count = prefix, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += self.prefix in record.getMessage()


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [4, 16])
def test_compiled_gpu_step_matches_eager_torch_form_over_64_steps(bits):
    """The CUDA default (Triton op, compiled with mode='reduce-overhead') against the eager torch form, fp16, 64
    teacher-forced steps with evictions: the same logits within fp16 tolerance and the same tokens kept, and one CUDA
    graph recorded for all 64 steps (Inductor's CUDA-graph trees log each recording)."""
    from conftest import tiny_llama

    from h2o_compress.runtime.compiled import compiled_decode_step, decode_one

    model = tiny_llama().to("cuda", torch.float16)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (2, 40), generator=generator).cuda()
    tokens = torch.randint(0, 128, (2, 64), generator=generator).cuda()
    base = CompressionConfig(budget=24, kv_bits=bits, residual=2)

    def go(kernel, step):
        cache = make_cache(model, dataclasses.replace(base, attention_kernel=kernel), max_length=104)
        with torch.inference_mode():
            model(input_ids=prompt, past_key_values=cache)
            logits = [decode_one(step, model, cache, tokens[:, i:i + 1], 40 + i).clone() for i in range(64)]
        return torch.stack(logits).float(), cache

    reference, torch_cache = go("torch", decode_step)
    recordings = _CountRecords("Recording cudagraph tree")
    cudagraph_log = logging.getLogger("torch._inductor.cudagraph_trees")
    level = cudagraph_log.level
    cudagraph_log.addHandler(recordings)
    cudagraph_log.setLevel(logging.INFO)
    try:
        ours, cache = go("auto", compiled_decode_step(model, "cuda"))
    finally:
        cudagraph_log.removeHandler(recordings)
        cudagraph_log.setLevel(level)
    assert recordings.count == 1, f"{recordings.count} CUDA graphs recorded over 64 steps (one is replayed)"
    assert all((layer.backend.name == "triton") for layer in cache.layers)
    torch.testing.assert_close(ours, reference, atol=2e-2, rtol=2e-2)
    for a, b in zip(kept(cache), kept(torch_cache)):
        assert torch.equal(a, b)


def test_fused_token_rotation_equals_the_matmul():
    """Compiled fused steps rotate the new token as a product + sum over head_dim (Inductor fuses it into the
    ring-write kernel): ``x @ basis`` to float reassociation, eagerly and compiled, for a non-symmetric basis too (a
    transposed sum would fail there; the Hadamard basis is symmetric)."""
    from h2o_compress.cache.state import rotate as _rotate, rotate_token as _rotate_token
    from h2o_compress.formats import hadamard_matrix

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 1, 128, generator=gen).half()
    compiled = torch.compile(_rotate_token, fullgraph=True)
    for basis in (hadamard_matrix(128, "cpu"), torch.randn(128, 128, generator=gen) / 128**0.5):
        expected = _rotate(x, basis)
        for rotated in (_rotate_token(x, basis), compiled(x, basis)):
            assert rotated.dtype == torch.float32 and rotated.shape == x.shape
            torch.testing.assert_close(rotated, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(_rotate_token(x, basis), _rotate(x, basis.T), atol=1e-3)
