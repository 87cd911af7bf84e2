"""The compressed cache on a CUDA GPU: exactness at budget 1.0, agreement with the CPU, accelerate device maps.

Every test is marked ``cuda`` (``pytest -m cuda`` on a GPU machine; skipped elsewhere by conftest.py). Token
sequences are fed teacher-forced (fixed ids, not argmax), so a last-digit difference between devices cannot
change what the next step sees.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, tiny_llama
from transformers import AutoModelForCausalLM, DynamicCache

from h2o_compress import CompressionConfig, make_cache

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda", 0)


def feed(model, cache, prompt: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill ``prompt`` ``[batch, p]``, then one decode step per column of ``tokens`` ``[batch, n]``; the logits
    of every step (prefill: all positions), on the CPU in fp32."""
    with torch.inference_mode():
        logits = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits]
        for i in range(tokens.shape[1]):
            logits.append(model(input_ids=tokens[:, i : i + 1], past_key_values=cache, use_cache=True).logits)
    return [x.float().cpu() for x in logits]


def inputs(batch: int = 2, prompt_len: int = 24, steps: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 128, (batch, prompt_len), generator=generator),
            torch.randint(0, 128, (batch, steps), generator=generator))


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
@pytest.mark.parametrize("policy", ["h2o", "full"])
def test_budget_one_16bit_reproduces_dynamic_cache_on_cuda(arch, dtype, tolerance, policy):
    """Budget 1.0 + 16 bits on the GPU gives DynamicCache's logits (prefill + 16 decode steps), fp32 and fp16."""
    model = TINY_MODELS[arch]().to(CUDA, dtype)
    prompt, tokens = (t.to(CUDA) for t in inputs())
    reference = feed(model, DynamicCache(config=model.config), prompt, tokens)
    cache = make_cache(model, CompressionConfig(policy=policy, budget=1.0), max_length=24 + 16)
    ours = feed(model, cache, prompt, tokens)
    for step, (a, b) in enumerate(zip(reference, ours)):
        assert (a - b).abs().max().item() <= tolerance, f"step {step}"
    assert cache.get_seq_length() == cache.kept_length() == 24 + 16
    assert all(t.device == CUDA for layer in cache.layers for t in layer.tensors())


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_budget_half_int4_on_cuda_matches_cpu(arch):
    """Budget 0.5 + int4, same weights and tokens on CPU and GPU (fp32): same capacity and kept tokens, the same
    bytes to the byte, logits within a bound (int4 rounding and eviction order may differ in the last digit; a
    1e-4 relative weight perturbation on CPU moves them by < 0.006)."""
    config = CompressionConfig(budget=0.5, kv_bits=4)
    prompt, tokens = inputs(prompt_len=40)
    results = {}
    for device in ("cpu", CUDA):
        model = TINY_MODELS[arch]().to(device)
        cache = make_cache(model, config, max_length=40 + 16)
        logits = feed(model, cache, prompt.to(device), tokens.to(device))
        results[str(device)] = (torch.stack([x[:, -1] for x in logits]), cache)
    (cpu_logits, cpu_cache), (gpu_logits, gpu_cache) = results["cpu"], results[str(CUDA)]
    assert gpu_cache.capacity == cpu_cache.capacity == 28
    assert [layer.kept_length() for layer in gpu_cache.layers] == [layer.kept_length() for layer in cpu_cache.layers]
    assert gpu_cache.nbytes() == cpu_cache.nbytes()
    assert all(t.device == CUDA for layer in gpu_cache.layers for t in layer.tensors())
    difference = (gpu_logits - cpu_logits).abs()
    assert difference.max().item() <= 0.05 and difference.mean().item() <= 0.005, difference.max().item()


def execution_device(module) -> torch.device:
    """Where ``module`` computes: the execution device of accelerate's hook (a layer mapped to ``"cpu"`` next to
    a GPU is CPU-offloaded: weights kept on the CPU, computed on the main GPU), else its parameters' device."""
    hook = getattr(module, "_hf_hook", None)
    for one in getattr(hook, "hooks", [hook]):
        device = getattr(one, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(module.parameters()).device


def generate_with_cache(model, steps: int = 16):
    """Greedy generation of ``steps`` tokens from a fixed 24-token prompt through a budget-0.5 int4 cache."""
    ids = inputs(batch=1, prompt_len=24)[0].to(execution_device(model.model.embed_tokens))
    cache = make_cache(model, CompressionConfig(budget=0.5, kv_bits=4), max_length=24 + steps)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, 24:].tolist(), cache


def assert_cache_on_layer_devices(model, cache) -> list[torch.device]:
    """Every tensor each layer's cache holds is on the device that layer computes on; returns those devices."""
    devices = [execution_device(layer) for layer in model.model.layers]
    for index, (layer, device) in enumerate(zip(cache.layers, devices)):
        held = {t.device for t in layer.tensors()}
        assert held == {device}, f"layer {index}: cache on {held}, layer computes on {device}"
    return devices


@pytest.fixture(scope="module")
def single_device_tokens(four_layer_dir):
    model = AutoModelForCausalLM.from_pretrained(four_layer_dir, dtype=torch.float32).to(CUDA).eval()
    return generate_with_cache(model)[0]


def test_device_map_gpu_and_cpu_keeps_each_layers_cache_on_its_device(four_layer_dir, single_device_tokens):
    """Issue item 4: layers 0-1 on GPU 0, layers 2-3, norm and head mapped to the CPU (accelerate offloads them:
    they compute on GPU 0). Each layer's cache sits where that layer computes; tokens equal the one-GPU run."""
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(four_layer_dir, device_map=device_map, dtype=torch.float32).eval()
    tokens, cache = generate_with_cache(model)
    assert_cache_on_layer_devices(model, cache)
    assert tokens == single_device_tokens


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_map_two_gpus_keeps_each_layers_cache_on_its_gpu(four_layer_dir, single_device_tokens):
    """Layers 0-1 on GPU 0, layers 2-3 on GPU 1: each layer's cache on its own GPU, tokens as on one GPU."""
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    model = AutoModelForCausalLM.from_pretrained(four_layer_dir, device_map=device_map, dtype=torch.float32).eval()
    tokens, cache = generate_with_cache(model)
    assert assert_cache_on_layer_devices(model, cache)[2:] == [torch.device("cuda", 1)] * 2
    assert tokens == single_device_tokens


def test_device_map_auto_keeps_each_layers_cache_on_its_device(four_layer_dir, single_device_tokens):
    """``device_map="auto"``: on one GPU accelerate puts the tiny model on GPU 0, on several it may split it;
    either way each layer's cache is on that layer's device and the tokens equal the one-GPU run."""
    model = AutoModelForCausalLM.from_pretrained(four_layer_dir, device_map="auto", dtype=torch.float32).eval()
    tokens, cache = generate_with_cache(model)
    devices = assert_cache_on_layer_devices(model, cache)
    assert all(device.type == "cuda" for device in devices)
    assert tokens == single_device_tokens


def test_fp16_quantized_cache_stays_close_to_full_on_cuda():
    """int8/int4 on the GPU in fp16 (residual window and scales in the model dtype): bounded error against
    DynamicCache, as on CPU (tests/cache/test_cache.py)."""
    model = tiny_llama(head_dim=64, heads=4, kv_heads=2).to(CUDA, torch.float16)
    prompt, tokens = (t.to(CUDA) for t in inputs(batch=1, prompt_len=40, steps=8))
    reference = feed(model, DynamicCache(config=model.config), prompt, tokens)
    for bits, tolerance in ((8, 0.02), (4, 0.3)):
        ours = feed(model, make_cache(model, CompressionConfig(kv_bits=bits)), prompt, tokens)
        worst = max((a[:, -1] - b[:, -1]).abs().max().item() for a, b in zip(reference, ours))
        assert 0 < worst <= tolerance, (bits, worst)


def test_nan_in_a_cuda_decode_step_is_caught_by_the_check():
    """Decode steps defer the finiteness check (no host sync per layer or step): cache.check() raises."""
    from h2o_compress import InputError

    model = tiny_llama().to(CUDA)
    cache = make_cache(model, CompressionConfig(budget=16, kv_bits=4))
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 128, (1, 8), device=CUDA), past_key_values=cache)
        layer = model.model.layers[0].self_attn
        original = layer.k_proj.weight.clone()
        layer.k_proj.weight.fill_(float("nan"))
        model(input_ids=torch.randint(0, 128, (1, 1), device=CUDA), past_key_values=cache)  # recorded, not raised
        layer.k_proj.weight.copy_(original)
        model(input_ids=torch.randint(0, 128, (1, 1), device=CUDA), past_key_values=cache)  # still no sync
        with pytest.raises(InputError, match="earlier step were not finite"):
            cache.check()


def test_compiled_perplexity_equals_eager_on_cuda():
    """Issue 14's quality check: ``eval perplexity --device cuda`` gives the same figure with the compiled step
    (Triton op, CUDA graph) as with ``--no-compile`` (eager, same op), fp16, with evictions and int4 storage."""
    from h2o_compress.evaluation import streaming_perplexity

    model = tiny_llama().to(CUDA, torch.float16)
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(3))
    config = CompressionConfig(budget=24, kv_bits=4, residual=2)
    eager = streaming_perplexity(model, ids, config, compile=False)
    compiled = streaming_perplexity(model, ids, config, compile=True)
    assert compiled.perplexity == pytest.approx(eager.perplexity, rel=2e-3)
