"""Compressed caches of the classes some models insist on (``isinstance`` checks in their forward pass).

MiniMax (transformers' ``MiniMaxModel``) refuses any cache but its ``MiniMaxCache``, a ``DynamicCache`` whose
lightning-attention (linear) layers keep their ``[batch, heads, head_dim, head_dim]`` key-value state through
``get_linear_cache`` / ``set_linear_cache``. `CompressedMiniMaxCache` is a
[`CompressedCache`][h2o_compress.cache.CompressedCache] of that class: its softmax-attention layers are compressed,
and each linear layer's state is held, as the model computes it, as the recurrent state of transformers'
``LinearAttentionLayer`` in that layer's place (the layer every hybrid's state layers are), so ``state_nbytes``,
batch reordering and row moves see it as they see other hybrids' states.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from h2o_compress.cache.container import CompressedCache
from h2o_compress.utils.errors import CacheStateError


def _minimax_cache_class():
    """transformers' ``MiniMaxCache`` (imported on first use: the MiniMax modeling module is heavy)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    return MiniMaxCache


def cache_class(model_config) -> type[CompressedCache]:
    """The compressed cache class for a model of ``model_config``: `CompressedMiniMaxCache` for MiniMax (whose
    model refuses other cache classes), else [`CompressedCache`][h2o_compress.cache.CompressedCache]."""
    if getattr(model_config, "model_type", None) == "minimax":
        return compressed_minimax_cache_class()
    return CompressedCache


_CLASSES: dict[str, type] = {}


def compressed_minimax_cache_class() -> type[CompressedCache]:
    """`CompressedMiniMaxCache`: built once, on first use, as a subclass of both
    [`CompressedCache`][h2o_compress.cache.CompressedCache] and transformers' ``MiniMaxCache``."""
    if "minimax" not in _CLASSES:
        _CLASSES["minimax"] = type("CompressedMiniMaxCache", (CompressedMiniMaxMixin, CompressedCache,
                                                              _minimax_cache_class()), {})
    return _CLASSES["minimax"]


class CompressedMiniMaxMixin:
    """What MiniMax's lightning-attention layers call on their cache, over the ``LinearAttentionLayer`` that
    [`build_layers`][h2o_compress.cache.build_layers] put in each of their places; the rest is
    [`CompressedCache`][h2o_compress.cache.CompressedCache]'s (``MiniMaxCache``'s own list of states is not used)."""

    def _state_layer(self, layer_idx: int) -> LinearAttentionCacheLayerMixin:
        """The state layer at ``layer_idx``. Raises CacheStateError: it holds keys (another model's cache)."""
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise CacheStateError(f"layer_idx={layer_idx} is not a linear-attention layer of this cache: it was made "
                                  "for another model")
        return layer

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """The lightning-attention state of ``layer_idx``, ``[batch, heads, head_dim, head_dim]``, or ``None``
        before its first step."""
        layer = self._state_layer(layer_idx)
        return layer.recurrent_states.get(0) if layer.has_previous_state[0] else None

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """Hold ``linear_cache`` ``[batch, heads, head_dim, head_dim]`` as ``layer_idx``'s state (copied in place
        after the first step, as transformers' ``update_recurrent_state``)."""
        layer = self._state_layer(layer_idx)
        layer.update_recurrent_state(linear_cache, 0)
        layer.has_previous_state[0] = True

    __len__ = Cache.__len__
    batch_repeat_interleave = Cache.batch_repeat_interleave
    batch_select_indices = Cache.batch_select_indices
