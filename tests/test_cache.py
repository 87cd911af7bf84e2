"""CompressedCache against the uncompressed DynamicCache, positions after eviction, memory that shrinks."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_MODELS, tiny_llama
from transformers import DynamicCache

from h2o_compress import CacheStateError, CompressionConfig, InputError, make_cache
from h2o_compress.cache import CompressedLayer
from h2o_compress.eviction import H2OPolicy, LocalPolicy
from h2o_compress.quantization import IntQuantizer, NoQuantizer, StoredTensor


def run_steps(model, cache, prompt, steps):
    """Prefill ``prompt`` then ``steps`` greedy decode steps; returns the list of logits tensors."""
    logits = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits]
    token = logits[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits)
        token = logits[-1][:, -1:].argmax(-1)
    return logits


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@pytest.mark.parametrize("policy", ["h2o", "full", "local", "sink"])
@torch.inference_mode()
def test_budget_one_16bit_reproduces_dynamic_cache(arch, policy):
    model = TINY_MODELS[arch]()
    prompt = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    reference = run_steps(model, DynamicCache(config=model.config), prompt, 32)
    cache = make_cache(model, CompressionConfig(policy=policy, budget=1.0), max_length=24 + 33)
    ours = run_steps(model, cache, prompt, 32)
    for step, (a, b) in enumerate(zip(reference, ours)):
        assert (a - b).abs().max().item() <= 1e-5, f"step {step}"
    assert cache.get_seq_length() == 24 + 32
    assert cache.kept_length() == 24 + 32


def masked_reference_logits(model, ids, prompt_len, visible_fn):
    """One full forward pass where query row p sees exactly ``visible_fn(p)`` (its view in the incremental run)."""
    total = ids.shape[1]
    mask = torch.zeros(1, 1, total, total, dtype=torch.bool)
    for p in range(total):
        cols = range(p + 1) if p < prompt_len else visible_fn(p)
        mask[0, 0, p, list(cols)] = True
    positions = torch.arange(total)[None]
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@pytest.mark.parametrize("policy,sinks", [("local", 0), ("sink", 3)])
@torch.inference_mode()
def test_positions_after_eviction_match_masked_reference(arch, policy, sinks):
    """After eviction, kept keys keep their original positions: the output equals a full pass in which each
    query sees exactly the tokens the cache kept for it (RoPE, OPT learned positions, NeoX partial rotary)."""
    model = TINY_MODELS[arch]()
    capacity, prompt_len, steps = 12, 20, 10
    ids = torch.randint(0, 128, (1, prompt_len + steps), generator=torch.Generator().manual_seed(2))
    cache = make_cache(model, CompressionConfig(policy=policy, budget=capacity, sink_tokens=sinks))
    ours = [model(input_ids=ids[:, :prompt_len], past_key_values=cache).logits[:, -1]]
    for p in range(prompt_len, prompt_len + steps):
        ours.append(model(input_ids=ids[:, p : p + 1], past_key_values=cache).logits[:, -1])
        assert cache.kept_length() == capacity

    def visible(p):  # sinks + the newest capacity - sinks tokens before p, and p itself
        return sorted(set(range(sinks)) | set(range(p - (capacity - sinks), p + 1)))

    reference = masked_reference_logits(model, ids, prompt_len, visible)
    expected = reference[:, prompt_len - 1 : prompt_len + steps]
    assert torch.allclose(torch.stack(ours, 1), expected, atol=1e-5)


@torch.inference_mode()
def test_h2o_eviction_frees_memory_to_capacity():
    model = tiny_llama()
    dims_heads, head_dim, layers = 2, 32, 2
    prompt = torch.randint(0, 128, (3, 64))
    full = make_cache(model, CompressionConfig(policy="full"))
    model(input_ids=prompt, past_key_values=full)
    capacity = 16
    cache = make_cache(model, CompressionConfig(budget=capacity))
    model(input_ids=prompt, past_key_values=cache)
    for _ in range(5):
        model(input_ids=prompt[:, :1], past_key_values=cache)
    slots = capacity + 1  # a 16-bit buffer has room for the step's new token
    for layer in cache.layers:
        assert layer.kept_length() == capacity and layer.slots == slots
        assert layer.stored_keys.parts["x"].shape == (3, dims_heads, slots, head_dim)
        assert layer.scores.shape == (3, dims_heads, capacity)
    kv_bytes = 2 * layers * 3 * dims_heads * slots * head_dim * 4  # fp32 model, 16-bit path stores fp32
    slot_bytes = layers * 3 * dims_heads * slots * (4 + 4)  # int32 position + fp32 score per slot
    assert cache.nbytes() == kv_bytes + slot_bytes
    assert full.nbytes() == 2 * layers * 3 * dims_heads * 64 * head_dim * 4
    assert cache.nbytes() < full.nbytes() / 3


@torch.inference_mode()
def test_int4_cache_bytes_match_layout_and_stay_bounded():
    model = tiny_llama(head_dim=64, heads=2, kv_heads=1)
    capacity, residual = 24, 4
    cache = make_cache(model, CompressionConfig(budget=capacity, kv_bits=4, group_size=32, residual=residual))
    prompt = torch.randint(0, 128, (1, 100))
    model(input_ids=prompt, past_key_values=cache)
    windows = set()
    for _ in range(20):
        model(input_ids=prompt[:, :1], past_key_values=cache)
        layer = cache.layers[0]
        window = layer.residual_length
        windows.add(window)
        stored, slots = capacity - window, capacity - residual
        assert layer.kept_length() == capacity and layer.stored_length == stored and layer.slots == slots
        # every slot: packed int4 data (32 B) + 2 groups x fp16 (scale, zero), int32 position, fp32 score;
        # the fp16 window and its fp32 scores
        per_layer = 2 * slots * (32 + 2 * 2 * 2) + slots * (4 + 4) + window * (2 * 64 * 2 + 4)
        assert cache.nbytes() == 2 * per_layer
    assert windows == set(range(residual, 2 * residual))  # quantized in blocks, never fewer than `residual` fp16
    layer = cache.layers[0]
    assert layer.stored_keys.parts["data"].dtype == torch.uint8
    assert layer.stored_keys.parts["data"].shape[-1] == 32
    assert layer.residual_keys.dtype == torch.float16


@pytest.mark.parametrize("rotate", [True, False])
@torch.inference_mode()
def test_quantized_cache_stays_close_to_full_cache(rotate):
    """Bounded error against the full cache; with rotation, q and the output carry the Hadamard basis."""
    model = tiny_llama(head_dim=64, heads=4, kv_heads=2)
    prompt = torch.randint(0, 128, (1, 40))
    reference = run_steps(model, DynamicCache(config=model.config), prompt, 8)
    for bits, tolerance in ((8, 0.02), (4, 0.3)):
        cache = make_cache(model, CompressionConfig(kv_bits=bits, residual=4, rotate=rotate))
        ours = run_steps(model, cache, prompt, 8)
        worst = max((a[:, -1] - b[:, -1]).abs().max().item() for a, b in zip(reference, ours))
        assert 0 < worst <= tolerance, (bits, worst)


class CountingQuantizer(IntQuantizer):
    """Records the position (encoded in channel 0 of each key) of every token it quantizes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.positions: list[int] = []

    def quantize(self, x):
        self.positions += x[0, 0, :, 0].round().long().tolist()
        return super().quantize(x)


@pytest.mark.parametrize("capacity", [None, 10])
def test_each_token_is_quantized_exactly_once(capacity):
    quantizer = CountingQuantizer(8, 32, 32, rotate=False)
    policy = H2OPolicy() if capacity else LocalPolicy()
    layer = CompressedLayer(0, policy, capacity, quantizer, NoQuantizer(), residual=4)
    generator = torch.Generator().manual_seed(0)
    seen = 0
    for chunk in [7, 1, 1, 3, 1, 1, 1, 5, 1, 1]:
        keys = torch.zeros(1, 1, chunk, 32)
        keys[..., 0] = torch.arange(seen, seen + chunk, dtype=torch.float32)
        seen += chunk
        returned, _ = layer.update(keys, keys.clone())
        probs = torch.rand(1, 1, returned.shape[2], generator=generator) if policy.needs_scores else None
        layer.after_attention(probs)
        if capacity:
            assert layer.kept_length() <= capacity
    assert len(quantizer.positions) == len(set(quantizer.positions))
    assert quantizer.positions == sorted(quantizer.positions)
    if capacity is None:  # everything but the fp16 window (4..7 newest tokens) was quantized, in order
        assert quantizer.positions == list(range(seen - layer.residual_length))
        assert 4 <= layer.residual_length < 8


@torch.inference_mode()
def test_attention_that_bypasses_the_function_is_detected():
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=8))
    model.set_attn_implementation("sdpa")
    prompt = torch.randint(0, 128, (1, 10))
    model(input_ids=prompt, past_key_values=cache)
    with pytest.raises(CacheStateError, match="did not go through"):
        model(input_ids=prompt[:, :1], past_key_values=cache)


@torch.inference_mode()
def test_batch_change_is_refused():
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=8))
    model(input_ids=torch.randint(0, 128, (2, 10)), past_key_values=cache)
    with pytest.raises(CacheStateError, match="batch=2"):
        model(input_ids=torch.randint(0, 128, (3, 1)), past_key_values=cache)


@torch.inference_mode()
def test_works_inside_model_generate_with_beam_search():
    model = tiny_llama()
    prompt = torch.randint(0, 128, (1, 12))
    reference = model.generate(prompt, max_new_tokens=8, do_sample=False, num_beams=2)
    cache = make_cache(model, CompressionConfig(budget=1.0))
    ours = model.generate(prompt, max_new_tokens=8, do_sample=False, num_beams=2, past_key_values=cache)
    assert torch.equal(reference, ours)
    evicting = make_cache(model, CompressionConfig(budget=0.5), max_length=20)
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, past_key_values=evicting)
    assert out.shape == (1, 20) and evicting.kept_length() == math.ceil(0.5 * 20)


def test_window_is_quantized_even_when_recent_window_is_the_whole_odd_capacity():
    """local policy, capacity 7, residual 4: the window must still reach its flush size and be quantized."""
    layer = CompressedLayer(0, LocalPolicy(), 7, IntQuantizer(4, 32, 32), IntQuantizer(4, 32, 32), residual=4)
    assert layer.residual == 3
    for _ in range(30):
        layer.update(torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32))
        layer.after_attention(None)
    assert layer.kept_length() == 7 and 3 <= layer.residual_length < 6 and layer.stored_length >= 2


def test_layer_index_beyond_the_cache_is_refused():
    cache = make_cache(tiny_llama(), CompressionConfig())
    keys = torch.zeros(1, 2, 1, 32)
    with pytest.raises(CacheStateError, match="layer_idx=2 but this cache has 2 layers"):
        cache.update(keys, keys, 2)


@pytest.mark.parametrize("kv_bits", [16, 4])
@pytest.mark.parametrize("policy", ["h2o", "local", "sink"])
@torch.inference_mode()
def test_decode_evicts_in_place_like_the_gathering_path(policy, kv_bits, monkeypatch):
    """Decode steps overwrite slots of the preallocated buffer (no reallocation, no O(capacity) copy) and keep
    exactly the tokens the gathering path keeps."""
    model = tiny_llama()
    prompt = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    steps = 12

    def run(in_place: bool):
        if not in_place:
            monkeypatch.setattr(CompressedLayer, "_evict_one_in_place", lambda self: False)
        cache = make_cache(model, CompressionConfig(policy=policy, budget=20, kv_bits=kv_bits, residual=2))
        logits = [model(input_ids=prompt, past_key_values=cache).logits[:, -1]]
        buffers = [t.data_ptr() for t in cache.layers[0].tensors() if t.dim() >= 3 and t.shape[2] == cache.layers[0].slots]
        if in_place:  # from here on, no gather into a fresh buffer
            monkeypatch.setattr(StoredTensor, "select", lambda *a, **k: pytest.fail("a decode step gathered"))
        for i in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(input_ids=token, past_key_values=cache).logits[:, -1])
            assert all(layer.kept_length() == 20 for layer in cache.layers)
            if in_place:  # the same buffers throughout: nothing was reallocated
                now = [t.data_ptr() for t in cache.layers[0].tensors() if t.dim() >= 3 and t.shape[2] == cache.layers[0].slots]
                assert now == buffers
        monkeypatch.undo()
        return torch.stack(logits), [layer.positions().sort(-1).values for layer in cache.layers]

    fast_logits, fast_positions = run(True)
    slow_logits, slow_positions = run(False)
    assert all(torch.equal(a, b) for a, b in zip(fast_positions, slow_positions))
    torch.testing.assert_close(fast_logits, slow_logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_deferred_finiteness_flags_are_checked_at_the_next_step():
    """On CUDA, one-token steps record finiteness without a host sync; the next step (or save) raises."""
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=16, kv_bits=4))
    model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache)
    cache.layers[1].finite = torch.tensor(False)  # what a CUDA decode step with a NaN key leaves behind
    with pytest.raises(InputError, match="keys or values of an earlier decode step were not finite"):
        model(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache)
    assert all(layer.finite is None for layer in cache.layers)
