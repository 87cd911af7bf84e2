"""The ``h2o_compress`` attention function: SDPA for the layer output, plus the attention probabilities
the H2O scorer needs (DESIGN.md §1).

Attention functions do not receive ``past_key_values``, so the cache layer announces itself in a
thread-local side channel keyed by ``layer_idx`` when ``update`` runs; the attention function of the same
layer, called next in the same thread, picks it up. Two caches or two threads never see each other's
entries. Nothing is registered on import: :func:`use_h2o_attention` registers the name and switches one
model to it.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .errors import CacheStateError, UnsupportedModelError

ATTENTION_NAME = "h2o_compress"

_channel = threading.local()


def _pending() -> dict:
    pending = getattr(_channel, "pending", None)
    if pending is None:
        pending = _channel.pending = {}
    return pending


def announce(layer_idx: int, layer) -> None:
    """Called by a cache layer's ``update``: the next attention call of ``layer_idx`` in this thread
    belongs to ``layer``."""
    _pending()[layer_idx] = layer


def withdraw(layer_idx: int) -> None:
    """Forget a pending announcement (used when a forward pass fails half-way)."""
    _pending().pop(layer_idx, None)


def attention_probability_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Sum of post-softmax attention each key receives from ``query``, GQA query heads summed per KV head.

    Computed in fp32 in chunks of ``chunk_size`` queries, so at most ``[batch, heads, chunk, keys]`` is
    materialised (never the full ``queries x keys`` matrix for a long prompt). Keys hidden from every query
    (padding) receive nothing; the cache layer marks them for eviction (:meth:`CompressedLayer.after_attention`).

    Args:
        query: ``[batch, q_heads, queries, head_dim]``.
        key: ``[batch, kv_heads, keys, head_dim]``; ``q_heads`` must be a multiple of ``kv_heads``.
        attention_mask: ``None`` (causal, bottom-right aligned: query ``i`` sees keys up to
            ``keys - queries + i``), boolean (``True`` = visible) or additive float, broadcastable to
            ``[batch, 1, queries, keys]``.
        scaling: softmax scale; ``None`` means ``head_dim ** -0.5``.

    Returns:
        fp32 ``[batch, kv_heads, keys]`` (H2O, arXiv 2306.14048 §4: the accumulated attention score).
    """
    batch, q_heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    key_t = key.float().transpose(-1, -2)  # [batch, kv_heads, head_dim, keys]
    total = torch.zeros(batch, kv_heads, keys, dtype=torch.float32, device=key.device)
    for start in range(0, queries, chunk_size):
        stop = min(start + chunk_size, queries)
        q = query[:, :, start:stop].float().reshape(batch, kv_heads, group * (stop - start), head_dim)
        logits = torch.matmul(q, key_t).mul_(scale).view(batch, kv_heads, group, stop - start, keys)
        visible = _visible(attention_mask, start, stop, queries, keys, key.device)
        if visible is not None:
            logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if visible is not None:
            probs = probs.nan_to_num_(0.0)  # queries that see nothing (padding rows) add nothing
        total += probs.sum(dim=(2, 3))
    return total


def _visible(mask, start, stop, queries, keys, device) -> torch.Tensor | None:
    """Boolean visibility ``[batch|1, 1, 1, stop-start, keys]`` for query rows ``start:stop``."""
    if mask is None:
        if stop - start == 1 and start == queries - 1:
            return None  # the last query sees every key
        rows = torch.arange(start, stop, device=device)[:, None] + (keys - queries)
        return (torch.arange(keys, device=device)[None, :] <= rows).view(1, 1, 1, stop - start, keys)
    rows = mask[..., start:stop, :]
    if rows.dtype != torch.bool:
        rows = rows > torch.finfo(rows.dtype).min / 2
    return rows.reshape(rows.shape[0], 1, 1, stop - start, keys)


def h2o_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention function registered as ``"h2o_compress"``: transformers' SDPA for the output, then hands
    the attention probabilities to the compressed cache layer that returned ``key`` (if any).

    Shapes: query ``[batch, q_heads, queries, head_dim]``, key/value ``[batch, kv_heads, keys, head_dim]``;
    returns ``([batch, queries, q_heads, head_dim], None)`` like every transformers attention function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _pending().pop(getattr(module, "layer_idx", None), None)
    if layer is None:  # no compressed cache involved: plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if layer.bound_module is None:
        layer.bound_module = weakref.ref(module)
    elif layer.bound_module() is not module:
        layer.returned_keys = None
        raise CacheStateError(
            f"layer {module.layer_idx}: this cache was filled by another model; a cache holds one model's keys "
            "and values, so build a new one with make_cache(model, ...)"
        )
    if layer.returned_keys is not key:
        raise CacheStateError(
            f"layer {module.layer_idx}: the keys reaching attention are not the ones the compressed cache "
            "returned; this model changes keys after the cache, which h2o-compress does not support"
        )
    if layer.key_basis is not None:  # keys are held as k @ H: q.k = (q @ H).(k @ H), H orthonormal
        query = (query.float() @ layer.key_basis).to(query.dtype)
    probs = padding = None
    if layer.fused_step:  # one query, no padding held: attention and H2O scores in one pass over packed tokens
        output, probs = layer.fused_attention(query, scaling)
        output = output.transpose(1, 2).contiguous()
    else:
        output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if layer.policy.needs_scores:
            probs = attention_probability_sums(query, key, attention_mask, scaling, layer.score_chunk_size)
        if attention_mask is not None:  # keys the last query cannot see are (left) padding
            queries, keys = query.shape[2], key.shape[2]
            padding = ~_visible(attention_mask, queries - 1, queries, queries, keys, key.device).reshape(-1, keys)
    if layer.value_basis is not None:  # values are held as v @ H: P.v = (P.(v @ H)) @ H, H symmetric
        output = (output.float() @ layer.value_basis).to(output.dtype)
    layer.after_attention(probs, padding)
    return output, None


def register_attention() -> None:
    """Register ``"h2o_compress"`` with transformers' ``AttentionInterface`` (and SDPA's mask builder)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, h2o_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_h2o_attention(model) -> None:
    """Switch ``model`` to the ``h2o_compress`` attention function (outputs identical to SDPA).

    Raises:
        UnsupportedModelError: the model's attention does not go through ``AttentionInterface``.
    """
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"model class {type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, so h2o-compress cannot score it; supported: LLaMA-like (LLaMA, Mistral, Qwen2, "
            "SmolLM), OPT, GPT-NeoX and other models with _supports_attention_backend=True"
        )
    register_attention()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
