"""`LayerSpan`: which tokens a query of one layer may see (the layer type: full, sliding or chunked attention).

transformers models declare their layer types in ``config.layer_types`` (``full_attention``, ``sliding_attention``,
``chunked_attention``) or with a model-wide ``sliding_window`` / ``attention_chunk_size``; `layer_spans` reads
them as transformers' own ``DynamicCache(config=...)`` does (``cache_utils.get_layer_types_and_kwargs``). A hybrid
model's ``linear_attention`` and ``conv`` layers (Mamba, gated DeltaNet, short convolutions) are ``"state"`` spans:
their constant-size states stay in transformers' own layers; a ``hybrid`` / ``hybrid_sliding`` layer (both in one
layer, Falcon-H1) is a full / sliding span with ``paired`` set. Layer types that share KV between layers
(``dummy``) or index their attention are refused.

A sliding layer of window ``W`` lets the query at position ``p`` see positions ``p - W + 1 .. p`` (transformers'
``sliding_window_overlay``); a chunked layer of chunk ``C`` the positions of ``p``'s chunk (Llama 4's
``chunked_overlay``, chunks counted from each sequence's first real token). A compressed layer of either type
never holds a token its next query cannot see ([`LayerSpan.expire`][h2o_compress.cache.LayerSpan.expire], whatever its score), so it holds at most
``W - 1`` tokens between steps ([`LayerSpan.cap`][h2o_compress.cache.LayerSpan.cap], as transformers' ``DynamicSlidingWindowLayer``); a budget
below that applies inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_compress.utils.errors import UnsupportedModelError

FULL, SLIDING, CHUNKED, STATE, HELD = "full", "sliding", "chunked", "state", "held_window"
# Model types whose mask is full causal over a step while transformers' cache layers for them slide (Moshi: its
# DynamicCache(config) keeps the last sliding_window - 1 tokens between steps): "held_window" spans.
_WINDOW_HELD_BY_CACHE = {"moshi"}
_KINDS = {"full_attention": FULL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED,
          "linear_attention": STATE, "conv": STATE}
_PAIRED = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}  # a state and keys in one layer


@dataclass(frozen=True)
class LayerSpan:
    """The tokens a layer's query sees: ``kind`` ``"full"``, ``"sliding"`` (the last ``size`` positions, the query's
    own included) or ``"chunked"`` (its chunk of ``size`` positions); ``size`` in tokens, ``None`` for full.
    ``"state"``: no attention over keys at all (a hybrid model's linear-attention, SSM or convolution layer, whose
    constant-size ``states`` states transformers' own ``LinearAttentionLayer`` holds, uncompressed).
    ``"held_window"``: a sliding cache layer under a full causal mask (Moshi): the layer holds the last ``size - 1``
    tokens between steps, and each query of a step sees those and the step's own tokens up to itself."""

    kind: str = FULL
    size: int | None = None
    states: int = 1
    #: the layer also holds ``states`` linear states beside its keys (transformers' ``hybrid`` layer types)
    paired: bool = False

    @property
    def windowed(self) -> bool:
        """The layer forgets tokens by position (sliding or chunked)."""
        return self.kind in (SLIDING, CHUNKED, HELD)

    @property
    def stateful(self) -> bool:
        """The layer holds a constant-size state, not keys (linear attention, SSM, convolution)."""
        return self.kind == STATE

    def cap(self, capacity: int | None) -> int | None:
        """Tokens the layer holds at most between steps: ``capacity`` (``None``: unbounded) within ``size - 1``."""
        if not self.windowed:
            return capacity
        return self.size - 1 if capacity is None else min(capacity, self.size - 1)

    def lowest(self, query_position: torch.Tensor, first_real: torch.Tensor) -> torch.Tensor:
        """int64 lowest position the query at ``query_position`` (int64 0-dim, or ``[n]``) sees, per sequence:
        ``[batch]`` (or ``[batch, n]``); ``first_real`` int64 ``[batch]`` (chunks start at a sequence's first real
        token). Full attention: 0. No host sync."""
        query_position = query_position.to(torch.int64)
        if query_position.dim():
            query_position, first_real = query_position.unsqueeze(0), first_real.unsqueeze(1)
        if self.kind == SLIDING:
            return query_position - self.size + 1 + torch.zeros_like(first_real)
        if self.kind == HELD:  # the window ends at the step's first query (the queries come in order)
            start = query_position[..., :1] if query_position.dim() else query_position
            return start - self.size + 1 + torch.zeros_like(first_real + query_position)
        if self.kind == CHUNKED:
            start = first_real.clamp(max=query_position)  # no real token yet: chunks from the query itself
            return start + torch.div(query_position - start, self.size, rounding_mode="floor") * self.size
        return torch.zeros_like(first_real + query_position)

    def expire(self, positions: torch.Tensor, seen: torch.Tensor, first_real: torch.Tensor) -> None:
        """Mark empty (``-1``), in place, every held position (int, ``[batch, ...]``) the next query (at position
        ``seen``) cannot see. No host sync, no allocation of storage: part of the compiled decode step."""
        if not self.windowed:
            return
        lowest = self.lowest(seen, first_real).view(-1, *([1] * (positions.dim() - 1)))
        positions.masked_fill_(positions < lowest, -1)

    def visible(self, positions: torch.Tensor, queries: torch.Tensor, first_real: torch.Tensor) -> torch.Tensor | None:
        """bool ``[batch, kv_heads, n, keys]``: which held ``positions`` (int ``[batch, kv_heads, keys]``) each of
        the ``n`` queries (int64 positions ``[n]``) sees; ``None`` for full attention (all of them)."""
        if not self.windowed:
            return None
        lowest = self.lowest(queries, first_real)  # [batch, n]
        return positions.unsqueeze(2) >= lowest[:, None, :, None]


FULL_SPAN = LayerSpan()  # a full-attention layer's


def layer_spans(config, num_layers: int) -> list[LayerSpan]:
    """One [`LayerSpan`][h2o_compress.cache.LayerSpan] per layer of a transformers ``config`` (its text config for a multimodal model).

    Raises:
        UnsupportedModelError: a layer type that is neither softmax attention over the layer's own keys nor a
            constant state, alone or beside keys (``hybrid``): KV shared between layers, indexed attention; or a
            layer count that does not match; one line naming the model type and the layer type.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = getattr(config, "get_text_config", lambda: config)()
    model_type = getattr(config, "model_type", type(config).__name__)
    try:
        types, kwargs = get_layer_types_and_kwargs(config)
    except Exception as error:  # noqa: BLE001 - a config transformers cannot read layer types from
        raise UnsupportedModelError(
            f"model type {model_type!r}: its layer types cannot be read ({type(error).__name__}: {error}); "
            "supported: decoders whose layers are full, sliding-window or chunked softmax attention"
        ) from None
    raw = getattr(config, "layer_types", None) or []
    idle = sorted({raw[i] for i, t in enumerate(types) if t == "dummy" and i < len(raw) and raw[i] in ("mlp", "moe")})
    if idle and getattr(config, "kv_sharing_modes", None) is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} has layers without attention or state ({', '.join(idle)}: transformers' "
            "dummy cache layers), for which h2o-compress has no cache layer; it compresses full, sliding-window and "
            "chunked attention layers and keeps linear_attention/conv/hybrid states as they are"
        )
    unsupported = sorted({"dummy (KV shared with another layer)" if t == "dummy" else t for t in types
                          if t not in _KINDS and t not in _PAIRED})
    if unsupported:
        raise UnsupportedModelError(
            f"model type {model_type!r} has layers of type {', '.join(unsupported)} (KV shared between layers, indexed or "
            "compressed attention); h2o-compress compresses full, sliding-window and chunked attention layers and "
            "keeps linear_attention/conv/hybrid states as they are"
        )
    if len(types) != num_layers:
        raise UnsupportedModelError(
            f"model type {model_type!r} declares {len(types)} layer types for {num_layers} layers; h2o-compress "
            "needs one per layer"
        )
    spans = []
    for kind, extra in zip(types, kwargs):
        states, paired = extra.get("number_of_states", 1), kind in _PAIRED
        kind = _PAIRED.get(kind, kind)
        if _KINDS[kind] == STATE:
            spans.append(LayerSpan(STATE, None, states))
            continue
        size = extra.get("sliding_window") if kind != "full_attention" else None
        if kind != "full_attention" and (not isinstance(size, int) or size < 1):
            raise UnsupportedModelError(f"model type {model_type!r}: a {kind} layer without a window size ({size!r})")
        held = _KINDS[kind] == SLIDING and model_type in _WINDOW_HELD_BY_CACHE
        spans.append(LayerSpan(HELD if held else _KINDS[kind], size, states if paired else 1, paired))
    return spans
