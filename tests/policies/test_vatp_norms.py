"""VATP's value norms are stored per slot when a token enters the store (not recomputed from every stored value
at each eviction): the same norms, the same choices and logits as recomputing them, on every decode path."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from h2o_compress import CompressionConfig, load_cache, make_cache, save_cache
from h2o_compress.cache.slots import SlotStore, value_l1_norms
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes

PROMPT, STEPS = 24, 12
PATHS = [("uniform", 4, "torch"), ("uniform", 4, "auto"), ("uniform", 16, "auto"), ("adaptive", 4, "torch"),
         ("adaptive", 4, "auto")]


def vatp(head_budgets: str, bits: int, kernel: str) -> CompressionConfig:
    return CompressionConfig(policy="vatp", budget=10, kv_bits=bits, residual=2, attention_kernel=kernel,
                             head_budgets=head_budgets)


def fresh_norms(layer) -> torch.Tensor:
    """What the norms were before they were stored: every stored value dequantized, in the model's basis."""
    store = layer.store
    return value_l1_norms(store.quantizers[1].dequantize(store.values, torch.float32), layer.geometry.value_basis)


def held_norms(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored norms, fresh norms) of the slots that hold a token."""
    held = layer.store.positions >= 0
    return layer.store.norms[held], fresh_norms(layer)[held]


@torch.inference_mode()
def decode(model, cache, steps: int = STEPS, check=None) -> torch.Tensor:
    """Greedy logits ``[steps + 1, vocab]`` of a fixed prompt, ``check(cache)`` after every step."""
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    logits = [model(input_ids=ids, past_key_values=cache).logits[:, -1]]
    for _ in range(steps):
        if check is not None:
            check(cache)
        logits.append(model(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1])
    return torch.cat(logits)


@pytest.mark.parametrize("head_budgets,bits,kernel", PATHS)
def test_stored_norms_are_the_stored_values_norms_after_every_step(head_budgets, bits, kernel):
    """After the prefill and every decode step (the native kernel moves the ring's token into the store itself),
    each held slot's norm is its stored value's (to float rounding: one token's basis product against every slot's)."""
    model = tiny_llama()
    cache = make_cache(model, vatp(head_budgets, bits, kernel), max_length=PROMPT + STEPS + 1)
    checked = []

    def check(cache):
        for layer in cache.layers:
            stored, fresh = held_norms(layer)
            assert stored.numel() > 0
            torch.testing.assert_close(stored, fresh, rtol=1e-6, atol=0)  # one token's matmul vs all slots'

        checked.append(True)

    decode(model, cache, check=check)
    check(cache)
    assert len(checked) == STEPS + 1
    assert all(isinstance(layer.store, SlotStore) and layer.store.norms is not None for layer in cache.layers)
    if kernel == "auto" and head_budgets == "uniform":
        from h2o_compress.attention import cpu

        assert {layer.backend.name for layer in cache.layers} == {"cpu" if cpu.library() is not None else "torch"}


@pytest.mark.parametrize("head_budgets,bits,kernel", [p for p in PATHS if p[2] == "torch"])
def test_same_logits_as_recomputing_the_norms_at_each_eviction(head_budgets, bits, kernel, monkeypatch):
    """The stored norms change nothing but the cost: the logits equal, bit for bit, those of the store recomputing
    every norm from the stored values at each eviction (the behaviour before they were stored)."""
    model = tiny_llama()
    config = vatp(head_budgets, bits, kernel)
    stored = decode(model, make_cache(model, config, max_length=PROMPT + STEPS + 1))
    with monkeypatch.context() as patch:
        patch.setattr(SlotStore, "value_norms", lambda self: value_l1_norms(
            self.quantizers[1].dequantize(self.values, torch.float32), self.value_basis))
        recomputed = decode(model, make_cache(model, config, max_length=PROMPT + STEPS + 1))
    assert torch.equal(stored, recomputed)
    h2o = decode(model, make_cache(model, CompressionConfig(**{**config.to_dict(), "policy": "h2o"}),
                                   max_length=PROMPT + STEPS + 1))
    assert not torch.equal(stored, h2o)  # the norms do change the ranking on this prompt


@pytest.mark.parametrize("head_budgets", ["uniform", "adaptive"])
def test_native_step_evicts_as_the_torch_form(head_budgets):
    """The native CPU step writes the norm of the token it moves into the store and (per-head slots) evicts by
    scores x norms itself: after every step each layer holds the same positions as the torch form."""
    from h2o_compress.attention import cpu

    if cpu.library() is None:
        pytest.skip("no C compiler: the native CPU kernel is not built")
    model = tiny_llama()
    torch_cache = make_cache(model, vatp(head_budgets, 4, "torch"), max_length=PROMPT + STEPS + 1)
    native = make_cache(model, vatp(head_budgets, 4, "auto"), max_length=PROMPT + STEPS + 1)
    held = {"torch": [], "native": []}

    def record(name):
        def check(cache):
            if not held[name]:  # after the prefill: norms far apart, so they, not the scores, decide each eviction
                for i, layer in enumerate(cache.layers):
                    spread = torch.rand(layer.store.norms.shape, generator=torch.Generator().manual_seed(i))
                    layer.store.norms.copy_(10.0 ** (4 * spread - 2))
            held[name].append([layer.positions().clone() for layer in cache.layers])
        return check

    decode(model, torch_cache, check=record("torch"))
    decode(model, native, check=record("native"))
    assert {layer.backend.name for layer in native.layers} == {"cpu"}
    assert len(held["native"]) == STEPS
    for mine, theirs in zip(held["native"], held["torch"]):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)


def test_norms_are_counted_planned_and_rebuilt_on_load(tmp_path):
    """One fp32 norm per slot: in ``nbytes`` and the planner's figure to the byte (as the scores); not written to a
    cache file (derived from the values) but rebuilt on load, so the loaded cache decodes as the saved one."""
    model = tiny_llama()
    config = vatp("uniform", 4, "auto")
    length = PROMPT + STEPS + 1
    cache = make_cache(model, config, max_length=length)
    decode(model, cache, steps=2)
    h2o = make_cache(model, CompressionConfig(**{**config.to_dict(), "policy": "h2o"}), max_length=length)
    decode(model, h2o, steps=2)
    slots = sum(layer.store.norms.numel() for layer in cache.layers)
    assert cache.nbytes() == h2o.nbytes() + 4 * slots
    planned = cache_bytes(model_dims(model.config), config, batch=1, prompt_len=PROMPT, decode_steps=2,
                          max_length=length, kv_dtype=torch.float32)
    assert planned.total == cache.nbytes()
    path = save_cache(cache, tmp_path / "vatp.safetensors", model)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert not any("value_norms" in name for name in f.keys())
    loaded = load_cache(path, model)
    for mine, theirs in zip(loaded.layers, cache.layers):
        assert torch.equal(mine.store.norms, fresh_norms(mine))
        torch.testing.assert_close(held_norms(mine)[0], held_norms(theirs)[0], rtol=1e-6, atol=0)
    assert torch.equal(decode_more(model, loaded), decode_more(model, cache))


@torch.inference_mode()
def decode_more(model, cache) -> torch.Tensor:
    """Logits of three more greedy steps from token 5."""
    token, logits = torch.tensor([[5]]), []
    for _ in range(3):
        logits.append(model(input_ids=token, past_key_values=cache).logits[:, -1])
        token = logits[-1].argmax(-1, keepdim=True)
    return torch.cat(logits)
