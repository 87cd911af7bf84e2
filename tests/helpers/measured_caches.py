"""Measured against predicted cache bytes (the planner tests and the head-budget tests): a cache after what
``generate`` does, the planner's figure for it, and a tiny LLaMA with head_dim 128."""

from __future__ import annotations

import torch
from conftest import tiny_llama

from h2o_compress import make_cache
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes


@torch.inference_mode()
def run_cache(model, config, batch, prompt_len, new_tokens, seed=0):
    """The cache after what ``generate`` does with ``new_tokens`` new tokens: a prefill of ``prompt_len`` random
    tokens, then ``new_tokens - 1`` one-token greedy steps (the last new token is never fed)."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    cache = make_cache(model, config, max_length=prompt_len + new_tokens)
    token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for _ in range(new_tokens - 1):
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert cache.get_seq_length() == prompt_len + new_tokens - 1
    return cache


def predicted(model, config, batch, prompt_len, new_tokens, max_new_tokens=None):
    dtype = next(model.parameters()).dtype
    return cache_bytes(model_dims(model.config), config, batch, prompt_len, new_tokens - 1,
                       prompt_len + (max_new_tokens or new_tokens), dtype)


LLAMA128 = {}


def llama128():
    """Tiny LLaMA with head_dim 128 (every group size divides it), GQA 4 query / 2 KV heads."""
    if not LLAMA128:
        LLAMA128["model"] = tiny_llama(head_dim=128)
    return LLAMA128["model"]
