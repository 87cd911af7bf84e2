"""States a model keeps in its own modules, held in the cache's state layers for as long as a batch job runs.

transformers' RecurrentGemma keeps each recurrent block's conv window (``conv1d_state``, ``[batch, lru_width,
conv1d_width - 1]``, model dtype) and RG-LRU state (``rg_lru.recurrent_states``, ``[batch, lru_width]``, float32)
on the block itself: one state for the whole batch the model last ran, not in the cache it is given (its attention
layers' keys and values do go through the cache, and are compressed as any model's). Continuous batching
(`h2o_compress.runtime.batch`) prefills each prompt alone, at batch 1, between the decode steps of the other rows,
then moves its cache into a row of the batch cache, so the block's single state would be overwritten by each pass.

`states_in_cache` hooks every such block so that, around each forward pass, the block's states are those of the
cache the pass is given: before the pass they are read from that cache's state layer at the block's index (none yet:
the block starts from zeros, as for a new sequence), after it they are written back there. The states then live in
rows of the cache's [`StateLayer`][h2o_compress.cache.hybrid.StateLayer]s, so a prompt prefilled alone carries them
into its batch row (``take_rows``), a shrinking batch selects them (``batch_select_indices``), and every pass (a
scoring pass, a prefill chunk, a decode step of the batch) sees its own sequences' states. A pass without a cache
leaves the block as transformers does. Hooks run in eager mode only: a batch of such a model decodes uncompiled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def module_state_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """The blocks of ``model`` that hold their own states (RecurrentGemma's recurrent blocks: a ``conv1d_state``
    and an ``rg_lru`` with ``recurrent_states``), each with its decoder layer's index (its cache layer's).

    Returns:
        ``[(layer index, block)]`` in layer order; empty for a model whose states, if any, the cache holds.
    """
    found = []
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList):
            continue
        for index, layer in enumerate(module):
            block = getattr(layer, "temporal_block", None)
            if hasattr(block, "conv1d_state") and hasattr(getattr(block, "rg_lru", None), "recurrent_states"):
                found.append((index, block))
    return found


def _state_layer(kwargs: dict, index: int) -> LinearAttentionCacheLayerMixin | None:
    """The state layer at ``index`` of the cache a block's pass is given (``past_key_values``), or ``None``."""
    cache = kwargs.get("past_key_values")
    layers = getattr(cache, "layers", None)
    if layers is None or not 0 <= index < len(layers):
        return None
    layer = layers[index]
    return layer if isinstance(layer, LinearAttentionCacheLayerMixin) else None


def _load(block: torch.nn.Module, layer: LinearAttentionCacheLayerMixin) -> None:
    """Give ``block`` the states ``layer`` holds (``None`` before the layer's first pass: the block makes zeros)."""
    held = layer.has_previous_state.get(0, False)
    block.conv1d_state = layer.conv_states.get(0) if held else None
    block.rg_lru.recurrent_states = layer.recurrent_states.get(0) if held else None


def _store(block: torch.nn.Module, layer: LinearAttentionCacheLayerMixin) -> None:
    """Hold ``block``'s states after its pass in ``layer`` (nothing if the pass kept none: ``use_cache=False``)."""
    conv, recurrent = block.conv1d_state, block.rg_lru.recurrent_states
    if conv is None or recurrent is None:
        return
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.conv_kernel_size[0] = conv.shape[-1]
    layer.device, layer.dtype = conv.device, conv.dtype


@contextmanager
def states_in_cache(model: torch.nn.Module) -> Iterator[bool]:
    """While the block runs, every block of `module_state_blocks` reads its states from, and writes them to, the
    state layer at its index of the cache each forward pass is given (see the module's text). The hooks are
    removed on exit, even on an error; the blocks keep the states of their last pass, as transformers leaves them.

    Yields:
        Whether ``model`` has such blocks (``False``: nothing is hooked).
    """
    handles = []
    try:
        for index, block in module_state_blocks(model):
            def before(module, args, kwargs, index=index):
                layer = _state_layer(kwargs, index)
                if layer is not None:
                    _load(module, layer)

            def after(module, args, kwargs, output, index=index):
                layer = _state_layer(kwargs, index)
                if layer is not None:
                    _store(module, layer)

            handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(block.register_forward_hook(after, with_kwargs=True))
        yield bool(handles)
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["module_state_blocks", "states_in_cache"]
