"""The contract every registered eviction policy keeps, run for each name in :data:`h2o_compress.policies.POLICIES`
(a policy added to the registry runs through here with no change to this file; kvpress runs every press through
one test the same way).

On a tiny random LLaMA (GQA, 2 layers), a left-padded batch of 2 (``kvzip``/``lookahead``: one unpadded sequence,
after their scoring pass), int4 storage with a 2-token ring, capacity 10, 2 sinks; a prefill then greedy decode
steps, each evicting. After the prefill and after every step, in every layer, sequence and KV head:

- the tokens held are a subset of those held before plus the step's new tokens, never padding;
- exactly ``min(capacity, real tokens seen)`` are held (no layer over its budget, none evicting early);
- the sinks (the first ``sink_tokens`` real tokens) and the recent window (the newest ``recent_window(capacity)``)
  are held.

The decode kernels (the CPU kernel, ``attention_kernel="auto"``; the Triton op where it runs: CUDA, or the
interpreter under ``TRITON_INTERPRET=1``) keep the same tokens as the torch form at every step, with the same
logits to float summation order. At budget 1.0 and 16 bits the cache is exact: logits equal transformers'
``DynamicCache`` to 1e-5 over a prefill and greedy steps.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama
from transformers import DynamicCache

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.attention import cpu, slot_attention
from h2o_compress.policies import POLICIES
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.runtime.generation import make_scored_cache

PROMPT, STEPS, CAPACITY, SINKS = 20, 6, 10, 2
TRITON_STEPS = 2  # the Triton interpreter takes about a second a step on the CPU
EVERY_POLICY = sorted(POLICIES)  # the registry itself: a new policy is tested without touching this file


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CharTokenizer:
    """Enough of a tokenizer for the scoring passes of ``kvzip`` and ``lookahead`` (no chat template)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 100 for c in text]]))


@lru_cache(maxsize=None)
def model(device: str = "cpu"):
    return tiny_llama().to(device)


def config(policy: str, kernel: str) -> CompressionConfig:
    return CompressionConfig(policy=policy, budget=CAPACITY, kv_bits=4, residual=2, sink_tokens=SINKS,
                             attention_kernel=kernel)


def held(cache) -> list[list[list[set[int]]]]:
    """Per layer, sequence and KV head: the positions held now."""
    return [[[{p for p in row.tolist() if p >= 0} for row in sequence] for sequence in layer.positions()]
            for layer in cache.layers]


@lru_cache(maxsize=None)
def drill(policy: str, kernel: str, steps: int = STEPS, device: str = "cpu"):
    """The prefill then ``steps`` greedy decode steps through ``decode_step`` (the cache sized for
    :data:`STEPS`, so fewer steps are a prefix of the full drill). Returns ``(pads, logits of every step
    [steps + 1, batch, vocab] on the CPU, held positions after every step, the cache)``."""
    scored = bool(POLICIES[policy].scorer)
    pads = (0,) if scored else (3, 0)
    batch = len(pads)
    ids = torch.randint(0, 100, (batch, PROMPT), generator=torch.Generator().manual_seed(5)).to(device)
    mask = torch.ones(batch, PROMPT, dtype=torch.long, device=device)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        if scored:  # their real path: the scoring pass, then a prefill ranked by its scores
            cache = make_scored_cache(model(device), CharTokenizer(), ids, config(policy, kernel), PROMPT + STEPS)
        else:
            cache = make_cache(model(device), config(policy, kernel), max_length=PROMPT + STEPS)
        if cache.seen_tokens() == PROMPT:  # snapkv: the reading pass laid the prompt in, with its next logits
            logits = cache.prompt_state.next_logits
        else:
            logits = model(device)(input_ids=ids, attention_mask=mask, position_ids=positions,
                                   past_key_values=cache).logits[:, -1]
        out, history = [logits], [held(cache)]
        position = positions[:, -1:]
        for _ in range(steps):
            position = position + 1
            logits = decode_step(model(device), logits.argmax(-1, keepdim=True), cache, position)
            out.append(logits)
            history.append(held(cache))
    return pads, torch.stack(out).float().cpu(), history, cache


@pytest.mark.parametrize("policy", EVERY_POLICY)
def test_eviction_keeps_a_subset_within_capacity_with_sinks_and_recent_window(policy):
    pads, _, history, cache = drill(policy, "torch")
    assert all(layer.backend is None or layer.backend.name == "torch" for layer in cache.layers)
    for index, layer in enumerate(cache.layers):
        capacity, rule = layer.setting.capacity, layer.setting.policy
        window = PROMPT + STEPS if capacity is None else rule.recent_window(capacity)
        sinks = rule.sink_tokens if capacity is None else min(rule.sink_tokens, capacity)
        for step in range(STEPS + 1):
            seen = PROMPT + step
            for b, pad in enumerate(pads):
                real = seen - pad
                new = set(range(pad, seen)) if step == 0 else {seen - 1}
                for head, now in enumerate(history[step][index][b]):
                    before = set() if step == 0 else history[step - 1][index][b][head]
                    where = f"{policy}: layer {index}, sequence {b}, head {head}, step {step}"
                    assert now <= before | new, f"{where}: holds {sorted(now - before - new)}, never given or evicted"
                    assert min(now) >= pad, f"{where}: holds padding"
                    assert len(now) == (real if capacity is None else min(capacity, real)), where
                    assert set(range(max(seen - window, pad), seen)) <= now, f"{where}: recent window evicted"
                    assert set(range(pad, pad + sinks)) <= now, f"{where}: a sink evicted"
    if cache.layers[0].setting.capacity is not None:  # every policy but `full` evicted on every decode step
        assert cache.kept_length() == CAPACITY
    assert cache.get_seq_length() == PROMPT + STEPS


def kernels():
    yield pytest.param("auto", 1e-3, STEPS, marks=pytest.mark.skipif(cpu.library() is None, reason="no C compiler"),
                       id="cpu")
    triton_here = torch.cuda.is_available() or slot_attention.supported(torch.device("cpu"), 32, ()) is None
    steps = STEPS if torch.cuda.is_available() else TRITON_STEPS
    yield pytest.param("triton", 2e-4, steps, marks=pytest.mark.skipif(not triton_here, reason="needs CUDA or "
                                                                "TRITON_INTERPRET=1"), id="triton")


@pytest.mark.parametrize("kernel,atol,steps", list(kernels()))
@pytest.mark.parametrize("policy", EVERY_POLICY)
def test_decode_kernels_keep_the_torch_forms_tokens_and_logits(policy, kernel, atol, steps):
    """Int4 storage: a value on a code rounding boundary can land one code apart (tests/attention/test_cpu_kernel.py),
    hence 1e-3 for the CPU kernel; the tokens kept must be identical. The Triton interpreter runs
    :data:`TRITON_STEPS` steps only (on a GPU: all of them)."""
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"
    _, reference, reference_history, _ = drill(policy, "torch", STEPS, device)
    _, ours, history, cache = drill(policy, kernel, steps, device)
    reference, reference_history = reference[: steps + 1], reference_history[: steps + 1]
    expected = "cpu" if kernel == "auto" else kernel
    assert all(layer.backend.name == expected for layer in cache.layers), [l.backend.name for l in cache.layers]
    assert history == reference_history
    torch.testing.assert_close(ours, reference, atol=atol, rtol=0)


@pytest.mark.parametrize("policy", EVERY_POLICY)
@torch.inference_mode()
def test_budget_one_at_16_bits_equals_dynamic_cache(policy):
    steps = 4
    prompt = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))

    def greedy(cache):
        logits = [model()(input_ids=prompt, past_key_values=cache).logits]
        for _ in range(steps):
            logits.append(model()(input_ids=logits[-1][:, -1:].argmax(-1), past_key_values=cache).logits)
        return logits

    reference = greedy(DynamicCache(config=model().config))
    cache = make_cache(model(), CompressionConfig(policy=policy, budget=1.0, kv_bits=16), max_length=16 + steps + 1)
    ours = greedy(cache)
    for step, (a, b) in enumerate(zip(reference, ours)):
        assert (a - b).abs().max().item() <= 1e-5, f"{policy}: step {step}"
    assert cache.kept_length() == 16 + steps
