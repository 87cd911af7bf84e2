"""The ``h2o_compress`` attention function: SDPA for the layer output, plus the attention probabilities
the H2O scorer needs (DESIGN.md §1), and the one hand-off from a cache layer to it.

The hand-off: attention functions do not receive ``past_key_values``, so a cache layer's ``update`` announces
what the attention call of its layer needs (`announce`) in a thread-local slot keyed by ``layer_idx``; the
attention function of the same layer, called next in the same thread, takes it. Two caches or two threads never see
each other's entries. What is announced:

- a one-token step: a `DecodeCall` (`h2o_compress.attention.decode_step`), plain tensors and sizes; the attention
  function runs it here, in ``attention/``, and returns to the model: the decode token crosses the cache/attention
  boundary once per layer (the announcement; the kernel call is on this side);
- a multi-token step (prefill, a chunk): the layer itself, whose ``attend`` runs the chunk's attention and eviction
  in the cache (`h2o_compress.cache.chunk`).

Nothing is registered on import: [`use_h2o_attention`][h2o_compress.attention.use_h2o_attention] registers the name
and switches one model to it.
"""

from __future__ import annotations

import threading

import torch

from h2o_compress.utils.errors import UnsupportedModelError
from h2o_compress.attention.decode_step import DecodeCall
from h2o_compress.attention.variant import AttentionVariant, softmax_probabilities

ATTENTION_NAME = "h2o_compress"

_channel = threading.local()


def _pending() -> dict:
    pending = getattr(_channel, "pending", None)
    if pending is None:
        pending = _channel.pending = {}
    return pending


def announce(layer_idx: int, step) -> None:
    """Called by a cache layer's ``update``: the next attention call of ``layer_idx`` in this thread runs ``step``
    (a `DecodeCall`, or the layer of a multi-token step)."""
    _pending()[layer_idx] = step
    _channel.last = layer_idx


# Model types whose attention module updates a cache layer other than its ``layer_idx``: HRM-Text runs its stacks
# several times per forward pass (cache layer ``layer_idx + cycle_offset``), Zamba and Zamba2 call one shared
# attention block from several layers (the cache layer given at call time; the module's own is None or -1). The
# attention call takes the announcement of the cache layer its module updated last, in this thread.
CYCLED_MODEL_TYPES = {"hrm_text", "zamba", "zamba2"}
# Model types whose attention module tiles the cached KV heads itself before the attention function
# (``key.repeat(1, r, 1, 1)``: query head ``h`` reads KV head ``h % kv_heads``, JetMoE's mixture of attention heads).
TILED_KV_MODEL_TYPES = {"jetmoe"}


def withdraw(layer_idx: int):
    """Forget a pending announcement (used when a forward pass fails half-way); returns it, or ``None``."""
    return _pending().pop(layer_idx, None)


def attention_probability_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    chunk_size: int = 256,
    decay: float = 1.0,
    variant: AttentionVariant | None = None,
) -> torch.Tensor:
    """Sum of post-softmax attention each key receives from ``query``, GQA query heads summed per KV head.

    Computed in fp32 one KV head at a time, in chunks of ``chunk_size`` queries, so at most ``[batch, group,
    chunk, keys]`` logits are materialised (``group`` = the query heads of one KV head): never the full ``queries
    x keys`` matrix of a long prompt, nor every KV head's chunk at once. Keys hidden from every query (padding)
    receive nothing; the cache layer marks them for eviction (`CompressedLayer.after_attention`).

    Args:
        query: ``[batch, q_heads, queries, head_dim]``.
        key: ``[batch, kv_heads, keys, head_dim]``; ``q_heads`` must be a multiple of ``kv_heads``.
        attention_mask: ``None`` (causal, bottom-right aligned: query ``i`` sees keys up to
            ``keys - queries + i``), boolean (``True`` = visible) or additive float, ``[batch | 1, kv_heads | 1,
            queries, keys]`` (a per-KV-head mask applies to every query head of that KV head).
        scaling: softmax scale; ``None`` means ``head_dim ** -0.5``.
        chunk_size: queries per chunk (>= 1).
        decay: query ``i`` of ``n`` weighs ``decay ** (n - 1 - i)`` (1: the plain sum; A2SF's forgetting factor,
            arXiv 2407.20485 §3, applied over the chunk's queries in order).
        variant: soft-cap / sink logits of the layer's softmax (`h2o_compress.attention.variant`), or ``None``.

    Returns:
        fp32 ``[batch, kv_heads, keys]`` (H2O, arXiv 2306.14048 §4: the accumulated attention score).
    """
    batch, q_heads, _, _ = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    sums = []
    for head in range(kv_heads):
        mask = attention_mask
        if mask is not None and mask.shape[1] != 1:
            mask = mask[:, head : head + 1]
        sinks = None if variant is None or variant.sinks is None else variant.sinks[head * group : (head + 1) * group]
        head_variant = variant if sinks is None else AttentionVariant(variant.softcap, sinks)
        sums.append(_head_sums(query[:, head * group : (head + 1) * group], key[:, head : head + 1], mask, scaling,
                               chunk_size, decay, head_variant))
    return torch.cat(sums, dim=1)


def _head_sums(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
               chunk_size: int, decay: float, variant: AttentionVariant | None) -> torch.Tensor:
    """`attention_probability_sums` of one KV head, fp32 ``[batch, 1, keys]``: ``query`` ``[batch, group, queries,
    head_dim]``, ``key`` ``[batch, 1, keys, head_dim]``, ``attention_mask`` ``[batch | 1, 1, queries, keys]`` or
    ``None``, ``variant``'s sinks ``[group]`` (this head's)."""
    batch, group, queries, head_dim = query.shape
    keys = key.shape[2]
    total = torch.zeros(batch, 1, keys, dtype=torch.float32, device=key.device)
    scale = head_dim**-0.5 if scaling is None else scaling
    key_t = key.float().transpose(-1, -2)  # [batch, 1, head_dim, keys]
    for start in range(0, queries, chunk_size):
        stop = min(start + chunk_size, queries)
        # causal (no mask): these rows see keys up to `keys - queries + stop - 1` only; skip the rest
        seen = keys if attention_mask is not None else keys - queries + stop
        q = query[:, :, start:stop].float().reshape(batch, 1, group * (stop - start), head_dim)
        logits = torch.matmul(q, key_t[..., :seen]).mul_(scale).view(batch, 1, group, stop - start, seen)
        visible = _visible(attention_mask, start, stop, queries, keys, key.device)
        probs = softmax_probabilities(logits, None if visible is None else visible[..., :seen], variant,
                                      (1, 1, group, 1, 1))
        if attention_mask is not None:
            probs = probs.nan_to_num_(0.0)  # queries that see nothing (padding rows) add nothing
        if decay != 1.0:
            weights = decay ** torch.arange(queries - 1 - start, queries - 1 - stop, -1, device=key.device,
                                            dtype=torch.float64)
            probs = probs * weights.float().view(1, 1, 1, stop - start, 1)
        total[..., :seen] += probs.sum(dim=(2, 3))
    return total


def _visible(mask, start, stop, queries, keys, device) -> torch.Tensor | None:
    """Boolean visibility ``[batch|1, kv_heads|1, 1, stop-start, keys]`` for query rows ``start:stop``."""
    if mask is None:
        if stop - start == 1 and start == queries - 1:
            return None  # the last query sees every key
        rows = torch.arange(start, stop, device=device)[:, None] + (keys - queries)
        return (torch.arange(keys, device=device)[None, :] <= rows).view(1, 1, 1, stop - start, keys)
    rows = mask[..., start:stop, :]
    if rows.dtype != torch.bool:
        rows = rows > torch.finfo(rows.dtype).min / 2
    return rows.reshape(rows.shape[0], rows.shape[1], 1, stop - start, keys)


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                     scaling: float | None, variant: AttentionVariant | None) -> torch.Tensor:
    """Attention of ``n`` queries in torch (fp32 softmax), for the multi-token steps of layers whose softmax has a
    ``variant`` SDPA does not run (soft-cap, sink logits): ``query`` ``[batch, q_heads, n, head_dim]``, ``keys``
    ``[batch, kv_heads, keys, head_dim]``, ``values`` ``[batch, kv_heads, keys, value_dim]``, bool ``visible``
    ``[batch | 1, kv_heads | 1, n, keys]`` or ``None`` (all). Returns ``[batch, q_heads, n, value_dim]``."""
    batch, q_heads, n, head_dim = query.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, group, n, head_dim)
    logits = torch.matmul(q.float(), keys.float().unsqueeze(2).transpose(-1, -2)) * scale
    probs = softmax_probabilities(logits, None if visible is None else visible.unsqueeze(2), variant,
                                  (1, kv_heads, group, 1, 1))
    output = torch.matmul(probs.to(values.dtype), values.unsqueeze(2))
    return output.reshape(batch, q_heads, n, values.shape[-1])


def h2o_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention function registered as ``"h2o_compress"``: runs the step the compressed cache layer that returned
    ``key`` announced (a decode step's `DecodeCall`, here; a multi-token step through the layer's
    [`attend`][h2o_compress.cache.CompressedLayer.attend]: attention, scores, eviction), or transformers' SDPA
    when no compressed cache is involved.

    Shapes: query ``[batch, q_heads, queries, head_dim]``, key/value ``[batch, kv_heads, keys, head_dim]``;
    returns ``([batch, queries, q_heads, head_dim], None)`` like every transformers attention function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model_type = getattr(getattr(module, "config", None), "model_type", None)
    layer_idx = getattr(module, "layer_idx", None)
    if model_type in CYCLED_MODEL_TYPES:
        layer_idx = getattr(_channel, "last", layer_idx)
    step = _pending().pop(layer_idx, None)
    if step is None:  # no compressed cache involved: plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kv_heads = step.kv_heads if isinstance(step, DecodeCall) else step.geometry.kv_heads
    if model_type in TILED_KV_MODEL_TYPES and key.shape[1] != kv_heads:
        return _untiled(step, kv_heads, module, query, key, value, attention_mask, scaling, kwargs), None
    return _run_step(step, module, query, key, value, attention_mask, scaling, kwargs), None


def _run_step(step, module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor:
    """Run an announced ``step`` (a `DecodeCall`, or a layer's multi-token `attend`): ``[batch, queries, q_heads,
    value_dim]``."""
    if isinstance(step, DecodeCall):
        return step.run(module, query, key, value, scaling, kwargs)
    return step.attend(module, query, key, value, attention_mask, scaling, **kwargs)


def _untiled(step, kv_heads: int, module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor:
    """``step`` for a module that tiled the cache's ``kv_heads`` KV heads ``r`` times (``key`` ``[batch, r x kv_heads,
    keys, head_dim]``, query head ``h`` reading KV head ``h % kv_heads``): the untiled keys and values, the query
    heads reordered so that each KV head's ``r`` query heads are adjacent (the cache's grouped layout, GQA), and the
    output ``[batch, queries, q_heads, value_dim]`` put back in the module's head order. Exact: the same products."""
    batch, q_heads, queries, head_dim = query.shape
    tiles = q_heads // kv_heads
    grouped = query.view(batch, tiles, kv_heads, queries, head_dim).transpose(1, 2).reshape(query.shape)
    output = _run_step(step, module, grouped, key[:, :kv_heads], value[:, :kv_heads], attention_mask, scaling, kwargs)
    width = output.shape[-1]
    return output.view(batch, queries, kv_heads, tiles, width).transpose(2, 3).reshape(batch, queries, q_heads, width)


def register_attention() -> None:
    """Register ``"h2o_compress"`` with transformers' ``AttentionInterface`` (and SDPA's mask builder)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, h2o_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# Model types whose attention goes through AttentionInterface but computes what a compressed cache cannot follow
# (tests/models/test_architectures.py checks every other decoder class transformers ships is exact at budget 1.0).
UNSUPPORTED_MODEL_TYPES = {
    "diffllama": "differential attention reads each KV head's keys with other KV heads' values, which per-head "
                 "eviction holds at other tokens",
    "doge": "its dynamic mask is projected from every KV head's cached values at each key position (per-head "
            "eviction holds them at other tokens) and keeps its own top keys",
}


def check_attention_backend(model) -> None:
    """Refuse a ``model`` whose attention does not go through transformers' ``AttentionInterface`` (nothing to
    switch to the ``h2o_compress`` function, so nothing to score), or whose attention does more around it than a
    compressed cache can follow (`UNSUPPORTED_MODEL_TYPES`).

    Raises:
        UnsupportedModelError: naming the model class (or type) and what is supported.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: {UNSUPPORTED_MODEL_TYPES[model_type]}; h2o-compress needs "
            "one attention call per layer and step over the cache's own keys"
        )
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if model_type == "minimax" and window is not None:
        raise UnsupportedModelError(
            f"model type 'minimax' with sliding_window={window!r} is not supported: its mask slides over the "
            "full_attention layers that its layer types and MiniMaxCache hold whole; allowed: sliding_window=None"
        )
    if not (getattr(model, "_supports_attention_backend", False) or hybrid_through_interface(model)
            or own_module_through_interface(model)):
        raise UnsupportedModelError(
            f"model class {type(model).__name__} does not route attention through transformers' "
            "AttentionInterface, so h2o-compress cannot score it; supported: models whose attention goes through it "
            "(_supports_attention_backend=True, or one of transformers' own classes that looks its attention up in "
            "ALL_ATTENTION_FUNCTIONS; docs/guide/models.md lists them)"
        )


def own_module_through_interface(model) -> bool:
    """Whether ``model`` is one of transformers' own classes (module ``transformers.models.*``; the architecture
    matrix runs each of them) whose modeling module looks its attention function up with
    ``ALL_ATTENTION_FUNCTIONS.get_interface`` though the class leaves ``_supports_attention_backend`` unset
    (BioGPT, StableLM in transformers 5.23): some function or method defined in that module reads the global
    ``ALL_ATTENTION_FUNCTIONS`` and its ``get_interface`` (`_reads_interface`: the compiled code's names, not the
    source text)."""
    import sys

    module = sys.modules.get(type(model).__module__)
    if module is None or not module.__name__.startswith("transformers.models."):
        return False
    return any(_reads_interface(code) for code in _module_code(module))


_INTERFACE_NAMES = frozenset({"ALL_ATTENTION_FUNCTIONS", "get_interface"})


def _module_code(module):
    """The code objects of the functions and of the classes' methods defined in ``module`` (decorators unwrapped)."""
    import inspect
    import types

    def defined_here(obj) -> bool:
        return getattr(obj, "__module__", None) == module.__name__

    for obj in vars(module).values():
        members = vars(obj).values() if isinstance(obj, type) and defined_here(obj) else (obj,)
        for member in members:
            function = inspect.unwrap(getattr(member, "__func__", member))
            if isinstance(function, types.FunctionType) and defined_here(function):
                yield function.__code__


def _reads_interface(code) -> bool:
    """Whether ``code`` (or a function nested in it) names ``ALL_ATTENTION_FUNCTIONS`` and ``get_interface``."""
    if _INTERFACE_NAMES <= set(code.co_names):
        return True
    return any(_reads_interface(const) for const in code.co_consts if hasattr(const, "co_names"))


def hybrid_through_interface(model) -> bool:
    """Whether ``model`` is a hybrid (some layers of type ``linear_attention``, ``conv`` or ``hybrid`` in its config, read as
    transformers' ``get_layer_types_and_kwargs`` does) whose modeling module looks its attention function up in
    ``ALL_ATTENTION_FUNCTIONS``: transformers leaves ``_supports_attention_backend`` unset on Qwen3-Next, Jamba,
    Bamba, Falcon-H1 and kin, though their attention layers go through ``AttentionInterface``."""
    import sys

    from transformers.cache_utils import get_layer_types_and_kwargs

    config = getattr(model, "config", None)
    module = sys.modules.get(type(model).__module__)
    if config is None or module is None or not hasattr(module, "ALL_ATTENTION_FUNCTIONS"):
        return False
    try:
        types, _ = get_layer_types_and_kwargs(config.get_text_config())
    except Exception:  # noqa: BLE001 - a config transformers cannot read layer types from: not a hybrid it knows
        return False
    return bool({"linear_attention", "conv", "hybrid", "hybrid_sliding"} & set(types))


def use_h2o_attention(model) -> None:
    """Switch ``model`` to the ``h2o_compress`` attention function (outputs identical to SDPA).

    Raises:
        UnsupportedModelError: the model's attention does not go through ``AttentionInterface``.
    """
    check_attention_backend(model)
    register_attention()
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
