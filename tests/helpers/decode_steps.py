"""The decode-step drill shared by the compile, CPU-kernel, Triton and head-budget tests: a left-padded prompt of
:data:`PROMPT` tokens prefilled eagerly, then :data:`STEPS` greedy decode steps through a given step function
(``decode_step`` eagerly or compiled), with the cache's buffer addresses before and after."""

from __future__ import annotations

import torch
import torch._dynamo
import torch._dynamo.testing

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.policies import POLICIES as REGISTERED

PROMPT, STEPS = 20, 24
POLICIES = sorted(REGISTERED)  # every registered policy


def setting(policy: str, bits: int, kernel: str = "auto") -> CompressionConfig:
    """Capacity 12 of 44 tokens: about two evictions per three steps, the ring (2 tokens) turning every step.
    ``kernel="auto"`` runs the CPU kernel's step (attention/cpu.py), ``"torch"`` the torch form."""
    budget = 1.0 if policy == "full" else 12
    return CompressionConfig(
        policy=policy, budget=budget, kv_bits=bits, residual=2, sink_tokens=None, attention_kernel=kernel
    )


def run(model, config, step, batch=2, pads=(3, 0), cache=None):
    """Prefill a left-padded prompt eagerly, then STEPS greedy decode steps through ``step``. Returns (logits
    ``[steps, batch, vocab]``, the cache, data pointers of its buffers after the prefill and at the end)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (batch, PROMPT), generator=generator)
    mask = torch.ones(batch, PROMPT, dtype=torch.long)
    for row, pad in enumerate(pads[:batch]):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = make_cache(model, config, max_length=PROMPT + STEPS) if cache is None else cache
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]
    before = pointers(cache)
    out = []
    position = positions[:, -1:]
    for _ in range(STEPS):
        token = logits.argmax(-1, keepdim=True)
        mask = torch.cat((mask, torch.ones(batch, 1, dtype=torch.long)), 1)
        position = position + 1
        logits = step(model, token, cache, position, mask)
        out.append(logits)
    return torch.stack(out), cache, before, pointers(cache)


def pointers(cache) -> dict:
    if not hasattr(cache.layers[0], "tensors"):  # DynamicCache: grows by concatenation
        return {}
    return {(i, name): t.data_ptr() for i, layer in enumerate(cache.layers) for name, t in layer.tensors().items()}


def eager_and_compiled(model, config, backend):
    """The same prompt and decode steps (:func:`run`) through ``decode_step`` eagerly and through
    ``torch.compile(decode_step, fullgraph=True, backend=backend)``: ``(eager logits, compiled logits, the compiled
    run's cache, its buffer addresses before and after the steps, compiled graph count)``."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(decode_step, fullgraph=True, backend=counter)
    with torch.inference_mode(), torch._dynamo.config.patch(capture_scalar_outputs=False):
        eager, _, _, _ = run(model, config, decode_step)
        ours, cache, before, after = run(model, config, compiled)
    return eager, ours, cache, before, after, counter.frame_count
