"""The fused decode kernel inside the compressed cache: same tokens kept and the same logits as the torch path
(dequantize + SDPA + a scoring pass), on tiny random models (CUDA, or Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from h2o_compress import CompressionConfig, ConfigError, make_cache
from h2o_compress.cache import CompressedLayer

pytest.importorskip("triton")


def decode_run(model, config, prompt, steps, device):
    cache = make_cache(model, config)
    logits = [model(input_ids=prompt, past_key_values=cache).logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(input_ids=token, past_key_values=cache).logits[:, -1])
    return torch.stack(logits), cache


@pytest.mark.parametrize(
    "settings",
    [dict(kv_bits=4), dict(kv_bits=8, group_size=32), dict(kv_bits=16), dict(k_bits=8, v_bits=4), dict(kv_bits=4, rotate=False)],
    ids=["int4", "int8", "16bit", "k8v4", "int4-norotate"],
)
@pytest.mark.parametrize("policy", ["h2o", "sink"])
@torch.inference_mode()
def test_fused_kernel_keeps_the_same_tokens_and_logits(policy, settings, device, monkeypatch):
    model = tiny_llama(heads=4, kv_heads=2, head_dim=32).to(device)
    prompt = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(5)).to(device)
    fused_calls = []
    original = CompressedLayer.fused_attention
    monkeypatch.setattr(CompressedLayer, "fused_attention", lambda self, *a: fused_calls.append(1) or original(self, *a))
    base = dict(policy=policy, budget=24, residual=2, **settings)
    fused_logits, fused = decode_run(model, CompressionConfig(**base, attention_kernel="triton"), prompt, 8, device)
    assert len(fused_calls) == 8 * len(fused.layers)  # every decode step of every layer ran the kernel
    torch_logits, reference = decode_run(model, CompressionConfig(**base, attention_kernel="torch"), prompt, 8, device)
    for a, b in zip(fused.layers, reference.layers):
        assert torch.equal(a.positions().sort(-1).values, b.positions().sort(-1).values)
        if b.scores is not None:
            order_a, order_b = a.positions().argsort(-1), b.positions().argsort(-1)
            torch.testing.assert_close(a.scores.gather(2, order_a), b.scores.gather(2, order_b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_logits, torch_logits, atol=2e-4, rtol=2e-4)


@torch.inference_mode()
def test_padding_held_falls_back_to_the_torch_path(device, monkeypatch):
    """Left padding still held needs the attention mask, which the kernel does not read."""
    model = tiny_llama().to(device)
    calls = []
    monkeypatch.setattr(CompressedLayer, "fused_attention", lambda self, *a: calls.append(1))
    cache = make_cache(model, CompressionConfig(budget=64, kv_bits=4, attention_kernel="triton"))
    mask = torch.ones(2, 10, dtype=torch.long, device=device)
    mask[0, :4] = 0
    ids = torch.randint(0, 128, (2, 10), device=device)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    model(input_ids=ids[:, :1], attention_mask=torch.cat((mask, mask[:, :1]), 1), past_key_values=cache)
    assert calls == []


def test_triton_kernel_refuses_formats_it_cannot_read():
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=16, kv_bits=4, quant="nf4", attention_kernel="triton"))
    with pytest.raises(ConfigError, match="attention_kernel='triton' reads int4/int8/16-bit"):
        model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_auto_uses_the_kernel_only_on_cuda(where):
    # the kernel choice follows the device the model (and so the cache) is on, not whether CUDA exists
    model = tiny_llama().to(where)
    cache = make_cache(model, CompressionConfig(budget=16, kv_bits=4))
    model(input_ids=torch.randint(0, 128, (1, 8), device=where), past_key_values=cache)
    assert all(layer.fused is (where == "cuda") for layer in cache.layers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_triton_kernel_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=16, kv_bits=4, attention_kernel="triton"))
    with pytest.raises(ConfigError, match=r"attention_kernel='triton' runs on CUDA devices \(got cpu\)"):
        model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache)
