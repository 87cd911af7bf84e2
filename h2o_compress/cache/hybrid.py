"""`CompressedStateLayer`: a compressed attention layer that also holds a linear-attention / SSM state.

transformers' ``"hybrid"`` and ``"hybrid_sliding"`` layer types (Falcon-H1: a Mamba-2 mixer and attention side by
side in every layer) keep both in one cache layer (``LinearAttentionAndFullAttentionLayer``). This layer is a
[`CompressedLayer`][h2o_compress.cache.CompressedLayer] for the keys and values, and holds a transformers
``LinearAttentionLayer`` for the conv and recurrent states, untouched, which the model updates through the cache's
``update_conv_state`` / ``update_recurrent_state`` as with ``DynamicCache``.

`StateLayer`: the layer a hybrid's linear-attention, SSM or convolution layer gets, transformers' own with the row
selection a batch cache needs (a batch that shrinks keeps its running rows' states).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from h2o_compress.cache.layer import CompressedLayer
from h2o_compress.utils.errors import CacheStateError


class StateLayer(LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` (a hybrid's linear-attention, SSM or convolution layer, its conv and
    recurrent states as the model computes them) whose sequences can also be selected and repeated, as a batch
    cache's rows are (transformers' layer has no ``batch_select_indices``)."""

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (int64 ``[n]``) of every state, in that order."""
        map_state_rows(self, lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence of every state ``repeats`` times, each after itself."""
        map_state_rows(self, lambda t: t.repeat_interleave(repeats, dim=0))


_STATE_FIELDS = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                 "is_recurrent_states_initialized", "conv_kernel_size", "number_of_states", "record_past")


class CompressedStateLayer(CompressedLayer, LinearAttentionCacheLayerMixin):
    """A compressed attention layer plus a linear state (``linear``, a transformers ``LinearAttentionLayer`` of
    ``number_of_states`` states); the other arguments are [`CompressedLayer`][h2o_compress.cache.CompressedLayer]'s."""

    def __init__(self, *args, number_of_states: int = 1, **kwargs):
        self.linear = StateLayer(number_of_states=number_of_states)
        CompressedLayer.__init__(self, *args, **kwargs)

    def __getattr__(self, name: str):
        if name in _STATE_FIELDS:  # what transformers' Cache reads of a linear-attention layer
            return getattr(self.__dict__["linear"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The linear part's ``update_conv_state`` (the full conv window, ``[batch, channels, kernel + new]``)."""
        return self.linear.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The linear part's ``update_recurrent_state`` (the state as held)."""
        return self.linear.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def reset(self) -> None:
        """Drop every token and zero the linear states (transformers' ``reset``)."""
        CompressedLayer.reset(self)
        if "linear" in self.__dict__:
            self.linear.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the sequences of both parts for beam search."""
        CompressedLayer.reorder_cache(self, beam_idx)
        self.linear.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (int64 ``[n]``) of both parts."""
        CompressedLayer.batch_select_indices(self, indices)
        self.linear.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence of both parts ``repeats`` times."""
        CompressedLayer.batch_repeat_interleave(self, repeats)
        self.linear.batch_repeat_interleave(repeats)


def state_tensors(layer: LinearAttentionCacheLayerMixin) -> list[torch.Tensor]:
    """The conv and recurrent state tensors a transformers linear-attention layer holds now (each
    ``[batch, ...]``, constant in the tokens seen); empty before its first step."""
    return [t for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None]


def map_state_rows(layer: LinearAttentionCacheLayerMixin, fn) -> None:
    """Replace every conv and recurrent state ``[batch, ...]`` of ``layer`` by ``fn`` of it (a function acting on
    the batch dim 0: a batch cache's rows selected or repeated). In place of the layer; states not yet made stay
    unmade."""
    for states in (layer.conv_states, layer.recurrent_states):
        for idx, state in states.items():
            if state is not None:
                states[idx] = fn(state)


def take_state_rows(layer: LinearAttentionCacheLayerMixin, indices: torch.Tensor,
                    source: LinearAttentionCacheLayerMixin, batch: int) -> None:
    """Copy every sequence of ``source``'s conv and recurrent states into rows ``indices`` (int64 ``[n]``) of
    ``layer``'s (``batch`` rows, made zero on first use), as [`take_rows`][h2o_compress.cache.rows.take_rows] does for keys (a
    [`CompressedStateLayer`][h2o_compress.cache.hybrid.CompressedStateLayer] passes its ``linear`` part).

    Raises:
        CacheStateError: ``source`` is not a linear-attention layer, or holds no state yet.
    """
    if not isinstance(source, LinearAttentionCacheLayerMixin) or not state_tensors(source):
        raise CacheStateError("the source cache's linear-attention layer holds no state: rows move only between "
                              "caches of one model, from a prefilled one")
    for name in ("conv_states", "recurrent_states"):
        mine, theirs = getattr(layer, name), getattr(source, name)
        flags = layer.is_conv_states_initialized if name == "conv_states" else layer.is_recurrent_states_initialized
        for idx, state in theirs.items():
            if state is None:
                continue
            if mine.get(idx) is None or mine[idx].shape[0] != batch:
                mine[idx] = state.new_zeros((batch, *state.shape[1:]))
                flags[idx] = True
            mine[idx][indices.to(state.device)] = state
            layer.has_previous_state[idx] = True
    layer.conv_kernel_size.update(source.conv_kernel_size)
    layer.device, layer.dtype = source.device, source.dtype
