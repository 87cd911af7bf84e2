"""A decode token's path per layer crosses the cache/attention boundary at most twice (issue 48): the cache's
``update`` announces the step (one crossing) and the ``h2o_compress`` attention function runs it in ``attention/``
and returns to the model (the second is the model's own call of the attention function): nothing the attention
function runs on a decode step is code of ``h2o_compress/cache/``.

Counted with a profiler hook: every Python call made while an ``h2o_attention_forward`` frame is running, by the
file of its code. The prefill (a multi-token step) still goes back to the layer's ``attend``; the hook shows that
too, as a control that the counting sees such calls.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.attention import interface, slot_attention

CACHE = str(Path(interface.__file__).resolve().parents[1] / "cache")
FORWARD = interface.h2o_attention_forward.__code__


class Crossings:
    """Profiler hook: the attention function's calls, and the cache functions called while one runs."""

    def __init__(self):
        self.depth, self.attention_calls, self.into_cache = 0, 0, []

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if code is FORWARD:
            self.depth += 1 if event == "call" else -1
            self.attention_calls += event == "call"
        elif event == "call" and self.depth and code.co_filename.startswith(CACHE):
            self.into_cache.append(f"{Path(code.co_filename).name}:{code.co_name}")

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def crossings(config: CompressionConfig, steps: int = 3) -> tuple[Crossings, Crossings, object]:
    """The crossings of a 12-token prefill and of ``steps`` greedy decode steps of the tiny llama into ``config``'s
    cache (capacity below the prompt: every step evicts)."""
    model = TINY_MODELS["llama"]()
    cache = make_cache(model, config)
    prompt = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        with Crossings() as prefill:
            logits = model(input_ids=prompt, past_key_values=cache).logits[:, -1]
        with Crossings() as decode:
            for _ in range(steps):
                logits = model(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
    return prefill, decode, cache


SETTINGS = {
    "cpu kernel": CompressionConfig(budget=6, kv_bits=4, residual=2),
    "cpu kernel, custom ranking": CompressionConfig(policy="h2o-mean", budget=6, kv_bits=4),
    "cpu kernel, value norms": CompressionConfig(policy="vatp", budget=6, kv_bits=4),
    "torch form": CompressionConfig(budget=6, kv_bits=4, residual=2, attention_kernel="torch"),
    "torch form, a2sf": CompressionConfig(policy="a2sf", budget=6, kv_bits=8, attention_kernel="torch"),
    "head-adaptive pool": CompressionConfig(budget=6, kv_bits=4, head_budgets="adaptive"),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_decode_step_runs_its_attention_without_calling_back_into_the_cache(name):
    prefill, decode, cache = crossings(SETTINGS[name])
    layers = len(cache.layers)
    assert decode.attention_calls == 3 * layers
    assert decode.into_cache == [], sorted(set(decode.into_cache))
    assert prefill.attention_calls == layers and "layer.py:attend" in prefill.into_cache  # the control
    assert all(layer.kept_length() == 6 for layer in cache.layers)  # the deferred eviction, run when read


@pytest.mark.skipif(not torch.cuda.is_available() and slot_attention.supported(torch.device("cpu"), 32, ()) is not None,
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_decode_step_runs_without_calling_back_into_the_cache():
    _, decode, cache = crossings(CompressionConfig(budget=6, kv_bits=4, attention_kernel="triton"), steps=2)
    assert all(layer.backend.name == "triton" for layer in cache.layers)
    assert decode.attention_calls == 2 * len(cache.layers)
    assert decode.into_cache == [], sorted(set(decode.into_cache))
