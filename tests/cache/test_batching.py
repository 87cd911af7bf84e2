"""Batched decoding with left padding: each sequence gets what it gets alone; padding is never kept."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS

from h2o_compress import CompressionConfig, make_cache

PROMPT_LENGTHS = (20, 13, 7)
STEPS = 12


def teacher_forced_logits(model, cache, ids, mask, continuation):
    """Prefill ``ids`` [batch, width] (left-padded per ``mask``) then feed ``continuation`` [batch, steps] one
    token at a time; positions come from the mask as in ``generate``. Returns logits [batch, steps + 1, vocab]."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]]
    for step in range(continuation.shape[1]):
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        positions = positions[:, -1:] + 1
        token = continuation[:, step : step + 1]
        out.append(model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@pytest.mark.parametrize(
    "policy,sinks,bits", [("h2o", 0, 16), ("h2o", 2, 16), ("local", 0, 16), ("sink", 3, 16), ("h2o", 0, 8), ("full", 0, 16)]
)
@torch.inference_mode()
def test_left_padded_batch_equals_sequences_alone(arch, policy, sinks, bits):
    model = TINY_MODELS[arch]()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in PROMPT_LENGTHS]
    continuation = torch.randint(1, 128, (len(prompts), STEPS), generator=generator)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    config = CompressionConfig(policy=policy, budget=10, sink_tokens=sinks, kv_bits=bits, residual=2)
    cache = make_cache(model, config)
    batched = teacher_forced_logits(model, cache, ids, mask, continuation)
    if policy != "full":
        assert cache.kept_length() == 10
    for row, prompt in enumerate(prompts):
        alone = teacher_forced_logits(
            model, make_cache(model, config), prompt[None], torch.ones(1, len(prompt), dtype=torch.long), continuation[row : row + 1]
        )
        assert torch.allclose(batched[row], alone[0], atol=2e-4), f"row {row}: {(batched[row] - alone[0]).abs().max()}"
