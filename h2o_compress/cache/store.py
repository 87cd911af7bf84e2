"""The store of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer], made at its first token: per-head slots
([`SlotStore`][h2o_compress.cache.SlotStore]) or one pool shared by the KV heads ([`SlotPool`][h2o_compress.cache.SlotPool], Ada-KV), with the
low planes of its top-ranked tokens where the setting keeps some at 8 bits ([`RefinedPlanes`][h2o_compress.cache.RefinedPlanes]);
`make_parts`: the store, ring and counters a layer makes at its first token, and `check_fits`, which sizes those
same parts on the ``meta`` device before any is allocated."""

from __future__ import annotations

import torch

from h2o_compress.utils.errors import InputError
from h2o_compress.utils.memory import available_memory
from h2o_compress.cache.refinement import RefinedPlanes, refined_rows
from h2o_compress.cache.ring import RingWindow
from h2o_compress.cache.setting import LayerSetting
from h2o_compress.cache.slot_pool import SlotPool
from h2o_compress.cache.slots import SlotStore
from h2o_compress.cache.state import Counters, Geometry


def make_store(setting: LayerSetting, geometry, first_tokens: int) -> SlotStore:
    """The store for ``setting`` with the layer's ``geometry`` (`Geometry`), sized for a first step
    of ``first_tokens`` tokens (an unbounded cache of unknown length grows from there)."""
    heads = geometry.kv_heads
    slots = setting.slots_per_head(first_tokens) * (heads if setting.head_adaptive else 1)
    kind = SlotPool if setting.head_adaptive else SlotStore
    store = kind(setting.key_quantizer, setting.value_quantizer, (geometry.batch, heads, slots, geometry.head_dim),
                 geometry.residual_dtype, geometry.device, setting.with_scores,
                 with_norms=setting.with_scores and setting.policy.weighs_values, value_basis=geometry.value_basis,
                 value_weight=setting.policy.value_weight, value_dim=geometry.value_dim)
    if setting.high_bits_fraction > 0:
        rows = refined_rows(setting.high_bits_fraction, setting.refined_per_head, store)
        store.refine = RefinedPlanes(rows, geometry.batch, store.positions.shape[1], geometry.head_dim,
                                     setting.split_names, geometry.device, value_dim=geometry.value_dim)
    return store


def make_parts(setting: LayerSetting, geometry: Geometry, first_tokens: int):
    """The buffers of a layer of ``setting`` with ``geometry``, first step of ``first_tokens`` tokens: ``(store,
    ring, counters)`` (`make_store`; a [`RingWindow`][h2o_compress.cache.RingWindow] of ``setting.residual`` tokens,
    or ``None``; zero `Counters`), on ``geometry.device`` (``meta``: sized, not allocated)."""
    store, ring = make_store(setting, geometry, first_tokens), None
    if setting.residual:
        shape = (geometry.batch, geometry.kv_heads, setting.residual, geometry.head_dim)
        ring = RingWindow(shape, geometry.residual_dtype, geometry.device, setting.with_scores,
                          value_dim=geometry.value_dim)
    return store, ring, Counters.zeros(geometry.batch, geometry.device)


def held_tensors(store: SlotStore, ring: RingWindow | None, counters: Counters) -> dict[str, torch.Tensor]:
    """Every buffer of a layer's parts, by name: ``store.*``, ``ring.*``, ``refine.*`` and the counters'."""
    held = {f"store.{k}": v for k, v in store.tensors().items()}
    if ring is not None:
        held |= {f"ring.{k}": v for k, v in ring.tensors().items()}
    if store.refine is not None:
        held |= {f"refine.{k}": v for k, v in store.refine.tensors().items()}
    return held | counters.tensors()


def check_fits(setting: LayerSetting, keys: torch.Tensor, num_layers: int) -> None:
    """Refuse, before allocating, buffers the device cannot hold: the bytes of the parts `make_parts` makes for
    ``setting`` and first keys ``keys`` ``[batch, kv_heads, tokens, head_dim]``, sized on the ``meta`` device (the
    formats' stored shapes come from their own code, not a formula), times ``num_layers``, against the free memory
    (CUDA: ``mem_get_info``; CPU: available RAM).

    Raises:
        InputError: naming both sizes.
    """
    store, ring, counters = make_parts(setting, Geometry.of(keys.to("meta"), setting), keys.shape[2])
    layer_bytes = sum(t.numel() * t.element_size() for t in held_tensors(store, ring, counters).values())
    needed, free = layer_bytes * num_layers, available_memory(keys.device)
    if free is not None and needed > free:
        raise InputError(
            f"the cache needs {needed / 2**30:.2f} GiB ({num_layers} layers of {store.slots} slots, batch "
            f"{keys.shape[0]}) but {keys.device} has {free / 2**30:.2f} GiB free; allowed: a smaller budget, "
            "max_length or batch"
        )
