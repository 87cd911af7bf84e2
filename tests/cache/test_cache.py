"""CompressedCache against the uncompressed DynamicCache, positions after eviction, memory that shrinks."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY_MODELS, tiny_llama
from transformers import DynamicCache

from h2o_compress import CacheStateError, CompressionConfig, InputError, make_cache
from h2o_compress.cache import CompressedLayer, backends, chunk
from h2o_compress.policies import POLICIES, H2OPolicy, LocalPolicy
from h2o_compress.formats import IntQuantizer, NoQuantizer


def run_steps(model, cache, prompt, steps):
    """Prefill ``prompt`` then ``steps`` greedy decode steps; returns the list of logits tensors."""
    logits = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits]
    token = logits[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits)
        token = logits[-1][:, -1:].argmax(-1)
    return logits


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@pytest.mark.parametrize("policy", sorted(POLICIES))
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


def counter_bytes(batch: int) -> int:
    """Per-layer counters: int64 seen, int64 first real token per sequence, two bool flags."""
    return 8 + 8 * batch + 1 + 1


@torch.inference_mode()
def test_h2o_eviction_frees_memory_to_capacity():
    model = tiny_llama()
    dims_heads, head_dim, layers = 2, 32, 2
    prompt = torch.randint(0, 128, (3, 64))
    full = make_cache(model, CompressionConfig(policy="full"), max_length=69)
    model(input_ids=prompt, past_key_values=full)
    capacity = 16
    cache = make_cache(model, CompressionConfig(budget=capacity), max_length=69)
    model(input_ids=prompt, past_key_values=cache)
    for _ in range(5):
        model(input_ids=prompt[:, :1], past_key_values=cache)
    slots = capacity + 1  # a 16-bit store has room for the step's new token
    for layer in cache.layers:
        assert layer.kept_length() == capacity and layer.store.slots == slots
        assert layer.store.keys.parts["x"].shape == (3, dims_heads, slots, head_dim)
        assert layer.store.scores.shape == (3, dims_heads, slots)
        assert int((layer.store.positions >= 0).sum()) == 3 * dims_heads * capacity
    kv_bytes = 2 * layers * 3 * dims_heads * slots * head_dim * 4  # fp32 model, 16-bit path stores fp32
    slot_bytes = layers * 3 * dims_heads * slots * (4 + 4)  # int32 position + fp32 score per slot
    assert cache.nbytes() == kv_bytes + slot_bytes + layers * counter_bytes(3)
    full_slots = 69  # built for 69 tokens: no spare slot, no scores (nothing is evicted)
    assert full.nbytes() == layers * (3 * dims_heads * full_slots * (2 * head_dim * 4 + 4) + counter_bytes(3))
    assert cache.nbytes() < full.nbytes() / 3
    assert cache.storage_nbytes() == cache.nbytes()  # no view pins a larger buffer


@torch.inference_mode()
def test_int4_cache_bytes_match_layout_and_stay_bounded():
    model = tiny_llama(head_dim=64, heads=2, kv_heads=1)
    capacity, residual = 24, 4
    cache = make_cache(model, CompressionConfig(budget=capacity, kv_bits=4, group_size=32, residual=residual))
    prompt = torch.randint(0, 128, (1, 100))
    model(input_ids=prompt, past_key_values=cache)
    slots = capacity - residual + 1
    # every slot: packed int4 data (32 B) + 2 groups x fp16 (scale, zero) for keys and values, int32 position,
    # fp32 score; the ring: fp16 keys and values, int32 position, fp32 score per slot
    per_layer = 2 * slots * (32 + 2 * 2 * 2) + slots * (4 + 4) + residual * (2 * 64 * 2 + 4 + 4) + counter_bytes(1)
    for _ in range(20):
        model(input_ids=prompt[:, :1], past_key_values=cache)
        layer = cache.layers[0]
        assert layer.kept_length() == capacity and layer.store.slots == slots
        assert int((layer.ring.positions >= 0).sum()) == residual  # always exactly `residual` fp16 tokens
        assert int((layer.store.positions >= 0).sum()) == capacity - residual
        assert cache.nbytes() == 2 * per_layer
    layer = cache.layers[0]
    assert layer.store.keys.parts["data"].dtype == torch.uint8
    assert layer.store.keys.parts["data"].shape[-1] == 32
    assert layer.ring.keys.dtype == torch.float16


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
    """Records the position (encoded as channel 0 = position + 1 of each key; 0 = an empty slot) of every token
    it quantizes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.positions: list[int] = []

    def quantize(self, x):
        self.positions += [p - 1 for p in x[0, 0, :, 0].round().long().tolist() if p > 0]
        return super().quantize(x)


def feed(layer, keys, generator):
    """One step through a bare layer: update, then attention through the layer (as the attention function does)."""
    returned, values = layer.update(keys, keys.clone())
    query = torch.randn(1, 1, keys.shape[2], keys.shape[3], generator=generator)
    layer.attend(MODULE, query, returned, values, None, None)


MODULE = torch.nn.Module()


@pytest.mark.parametrize("capacity", [None, 10])
def test_each_token_is_quantized_exactly_once(capacity):
    quantizer = CountingQuantizer(8, 32, 32, rotate=False)
    policy = H2OPolicy() if capacity else LocalPolicy()
    layer = CompressedLayer(0, policy, capacity, quantizer, NoQuantizer(), residual=4)
    generator = torch.Generator().manual_seed(0)
    seen = 0
    for size in [7, 1, 1, 3, 1, 1, 1, 5, 1, 1]:
        keys = torch.zeros(1, 1, size, 32)
        keys[..., 0] = torch.arange(seen + 1, seen + size + 1, dtype=torch.float32)
        seen += size
        feed(layer, keys, generator)
        if capacity:
            assert layer.kept_length() <= capacity
    residual = layer.setting.residual
    # every token that left the fp16 ring was quantized once, in order; the ring holds the newest `residual`
    assert quantizer.positions == list(range(seen - residual))
    assert sorted(layer.ring.positions[0].tolist()) == list(range(seen - residual, seen))


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
    """local policy, capacity 7, residual 4: the ring is capped at half the recent window and keeps turning over."""
    layer = CompressedLayer(0, LocalPolicy(), 7, IntQuantizer(4, 32, 32), IntQuantizer(4, 32, 32), residual=4)
    assert layer.setting.residual == 3
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        feed(layer, torch.randn(1, 1, 1, 32, generator=generator), generator)
    assert layer.kept_length() == 7
    assert sorted(layer.ring.positions[0].tolist()) == [27, 28, 29]
    assert sorted(layer.store.positions[0, 0][layer.store.positions[0, 0] >= 0].tolist()) == [23, 24, 25, 26]


def test_layer_index_beyond_the_cache_is_refused():
    cache = make_cache(tiny_llama(), CompressionConfig())
    keys = torch.zeros(1, 2, 1, 32)
    with pytest.raises(CacheStateError, match="layer_idx=2 but this cache has 2 layers"):
        cache.update(keys, keys, 2)


@pytest.mark.parametrize("kv_bits", [16, 4])
@pytest.mark.parametrize("policy", ["h2o", "h2o-mean", "local", "sink"])
@torch.inference_mode()
def test_decode_step_keeps_its_buffers_and_the_tokens_of_the_chunk_rule(policy, kv_bits, monkeypatch):
    """Decode steps write into the buffers allocated at the prefill (every data pointer unchanged) and keep exactly
    the tokens the eager chunk step keeps for the same one-token input (masked argmin == top-capacity)."""
    model = tiny_llama()
    prompt = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    steps = 12

    def run(decode_path: bool):
        if not decode_path:
            for backend in (backends.TorchDecode, backends.CpuDecode):  # a one-token step as a chunk
                monkeypatch.setattr(backend, "update",  # announcing the layer: its attend runs the chunk
                                    lambda self, layer, k, v: (*chunk.update(layer, *layer.geometry.to_storage(k, v)),
                                                               layer))
        cache = make_cache(model, CompressionConfig(policy=policy, budget=20, kv_bits=kv_bits, residual=2))
        logits = [model(input_ids=prompt, past_key_values=cache).logits[:, -1]]
        buffers = {name: t.data_ptr() for name, t in cache.layers[0].tensors().items()}
        for _ in range(steps):
            token = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(input_ids=token, past_key_values=cache).logits[:, -1])
            assert all(layer.kept_length() == 20 for layer in cache.layers)
            assert {name: t.data_ptr() for name, t in cache.layers[0].tensors().items()} == buffers
        monkeypatch.undo()
        return torch.stack(logits), [layer.positions() for layer in cache.layers]

    fast_logits, fast_positions = run(True)
    slow_logits, slow_positions = run(False)
    assert all(torch.equal(a, b) for a, b in zip(fast_positions, slow_positions))
    torch.testing.assert_close(fast_logits, slow_logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_non_finite_decode_steps_are_flagged_and_read_once():
    """A decode step records finiteness without a host sync; cache.check() (end of generate, save, the next
    multi-token step) raises. A multi-token step with NaN raises at once."""
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=16, kv_bits=4))
    model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache)
    cache.check()
    cache.layers[1].counters.finite.fill_(False)  # what a decode step with a NaN key leaves behind
    model(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache)  # no sync, no raise
    with pytest.raises(InputError, match="not finite"):
        cache.check()
    with pytest.raises(InputError, match="not finite"):
        model(input_ids=torch.randint(0, 128, (1, 2)), past_key_values=cache)


@torch.inference_mode()
def test_capacity_is_capped_at_what_the_cache_can_see_and_huge_storage_is_refused():
    """An integer budget above prompt + new tokens stores no more than that; storage the device cannot hold is
    refused before any allocation, with both sizes in the message."""
    model = tiny_llama()
    capped = make_cache(model, CompressionConfig(budget=100_000, kv_bits=4), max_length=30)
    assert capped.capacity == 30
    model(input_ids=torch.randint(0, 128, (1, 10)), past_key_values=capped)
    assert capped.layers[0].store.slots == 30 - capped.layers[0].setting.residual + 1
    huge = make_cache(model, CompressionConfig(budget=10**12))
    with pytest.raises(InputError, match=r"the cache needs .* GiB .* but cpu has .* GiB free"):
        model(input_ids=torch.randint(0, 128, (1, 10)), past_key_values=huge)
    assert not huge.layers[0].is_initialized


@torch.inference_mode()
def test_model_cast_after_prefill_is_refused():
    model = tiny_llama()
    cache = make_cache(model, CompressionConfig(budget=8, kv_bits=4))
    model(input_ids=torch.randint(0, 128, (1, 10)), past_key_values=cache)
    model.half()
    with pytest.raises(CacheStateError, match="model.half"):
        model(input_ids=torch.randint(0, 128, (1, 1)), past_key_values=cache)


def test_a_prefill_beyond_max_length_is_refused():
    """``make_cache(max_length=4)`` then a 9-token prompt: the capacity (a fraction of 4) would be wrong for what
    the cache sees, silently; now refused, naming max_length. A prompt within it still runs."""
    model = tiny_llama()
    ids = torch.arange(1, 10).unsqueeze(0)
    cache = make_cache(model, CompressionConfig(budget=0.5), max_length=4)
    with pytest.raises(InputError, match=r"brings the cache to 9 tokens but it was made with max_length=4"):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    cache = make_cache(model, CompressionConfig(budget=0.5), max_length=12)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    with pytest.raises(InputError, match="brings the cache to 13 tokens"):
        model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
