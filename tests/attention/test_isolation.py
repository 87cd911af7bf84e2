"""Caches never mix: two caches and two models in one process, and two threads each with its own cache, give
exactly what each gives alone. The side channel between cache layer and attention function is keyed by layer
index *and* thread; a negative control replaces it with a process-wide dict and shows the threaded test fails."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from conftest import tiny_llama

from h2o_compress import CacheStateError, CompressionConfig, make_cache
from h2o_compress.attention import interface as attention_module
from h2o_compress.cache import CompressedLayer

CONFIG = CompressionConfig(budget=10, kv_bits=4, residual=2)
STEPS = 8


def prompt(seed, batch=1, length=12):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def snapshot(cache):
    """Every buffer of every layer (tokens, positions, scores, counters)."""
    return [{name: t.clone() for name, t in layer.tensors().items()} for layer in cache.layers]


def assert_same(a, b):
    for held_a, held_b in zip(a, b, strict=True):
        assert held_a.keys() == held_b.keys()
        assert all(torch.equal(held_a[name], held_b[name]) for name in held_a)


class Run:
    """A greedy decode over its own model and cache, one step at a time."""

    def __init__(self, model, seed, config=CONFIG, batch=1):
        self.model, self.cache = model, make_cache(model, config)
        self.next_ids, self.logits = prompt(seed, batch), []

    @torch.no_grad()
    def step(self):
        logits = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True).logits[:, -1]
        self.logits.append(logits)
        self.next_ids = logits.argmax(-1, keepdim=True)


def alone(model, seed, **kwargs):
    run = Run(model, seed, **kwargs)
    for _ in range(STEPS):
        run.step()
    return run


@pytest.fixture(scope="module")
def models():
    """Two models with the same layer indices: one LLaMA GQA geometry, one different (1 KV head, head_dim 64)."""
    return tiny_llama(seed=0), tiny_llama(seed=1, kv_heads=1, heads=2, head_dim=64, layers=3)


def test_two_models_and_two_caches_interleaved_in_one_thread(models):
    first, second = models
    references = [alone(first, 1), alone(second, 2), alone(first, 3, batch=2)]
    runs = [Run(first, 1), Run(second, 2), Run(first, 3, batch=2)]  # two caches on the same model too
    for _ in range(STEPS):
        for run in runs:
            run.step()
    for run, reference in zip(runs, references):
        assert all(torch.equal(a, b) for a, b in zip(run.logits, reference.logits, strict=True))
        assert_same(snapshot(run.cache), snapshot(reference.cache))


def run_interleaved_threads(first, second):
    """Thread A pauses inside every step of layer 0 (after its cache announced itself, before its attention
    ran) while thread B runs a whole step of its own cache on the same layer index. Returns (runs, errors)."""
    runs = {"A": Run(first, 1), "B": Run(second, 2)}
    go, done = threading.Event(), threading.Event()
    errors: dict[str, BaseException] = {}
    real_update = CompressedLayer.update

    def update(self, *args, **kwargs):
        out = real_update(self, *args, **kwargs)
        if threading.current_thread().name == "A" and self.layer_idx == 0 and "B" not in errors:
            done.clear()
            go.set()
            done.wait(timeout=30)
        return out

    def thread_a():
        try:
            for _ in range(STEPS):
                runs["A"].step()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors["A"] = exc
        finally:
            go.set()

    def thread_b():
        try:
            for _ in range(STEPS):
                if not go.wait(timeout=30) or "A" in errors:
                    return
                go.clear()
                runs["B"].step()
                done.set()
        except BaseException as exc:  # noqa: BLE001
            errors["B"] = exc
        finally:
            done.set()

    CompressedLayer.update = update
    try:
        threads = [threading.Thread(target=thread_a, name="A"), threading.Thread(target=thread_b, name="B")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        CompressedLayer.update = real_update
    return runs, errors


def matches(run, reference):
    return len(run.logits) == len(reference.logits) and all(
        torch.equal(a, b) for a, b in zip(run.logits, reference.logits)
    )


@pytest.mark.parametrize("same_model", [True, False], ids=["one-model", "two-models"])
def test_two_threads_with_their_own_caches_never_mix(models, same_model):
    first, second = models
    second = first if same_model else second
    references = {"A": alone(first, 1), "B": alone(second, 2)}
    runs, errors = run_interleaved_threads(first, second)
    assert not errors, errors
    for name in "AB":
        assert matches(runs[name], references[name]), name
        assert_same(snapshot(runs[name].cache), snapshot(references[name].cache))


def test_negative_control_a_process_wide_channel_mixes_threads(models, monkeypatch):
    """The same interleaving with the side channel made process-wide: thread A's announcement is overwritten by
    thread B's, so A's attention misses its cache. The test above would catch such a regression."""
    first, _ = models
    references = {"A": alone(first, 1), "B": alone(first, 2)}
    monkeypatch.setattr(attention_module, "_channel", types.SimpleNamespace())
    runs, errors = run_interleaved_threads(first, first)
    assert errors or not all(matches(runs[name], references[name]) for name in "AB")


@torch.no_grad()
def test_a_failed_forward_does_not_disturb_another_cache(models):
    first, _ = models
    reference = alone(first, 5)
    broken = Run(first, 4)
    broken.step()
    hook = first.model.layers[0].mlp.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            broken.step()
    finally:
        hook.remove()
    healthy = alone(first, 5)  # same thread, same layer indices, right after the failure
    assert matches(healthy, reference)


@torch.no_grad()
def test_a_cache_whose_forward_failed_half_way_refuses_to_continue(models):
    first, _ = models
    broken = Run(first, 4)
    broken.step()
    hook = first.model.layers[0].mlp.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            broken.step()  # layer 0 saw the token, layer 1 did not
    finally:
        hook.remove()
    assert int(broken.cache.layers[0].counters.seen) != int(broken.cache.layers[1].counters.seen)
    broken.step()  # a decode step syncs with nothing: it flags the mismatch on the device
    with pytest.raises(CacheStateError, match="half-way"):
        broken.cache.check()  # read once per generation (and before a save or a multi-token step)
