"""The store of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer], made at its first token: per-head slots
([`SlotStore`][h2o_compress.cache.SlotStore]) or one pool shared by the KV heads ([`SlotPool`][h2o_compress.cache.SlotPool], Ada-KV), with the
low planes of its top-ranked tokens where the setting keeps some at 8 bits ([`RefinedPlanes`][h2o_compress.cache.RefinedPlanes]);
`make_parts`: the store, ring and counters a layer makes at its first token; `parts_nbytes`: their bytes, from the
setting (no buffer made), which `refuse_oversized` holds against the device's free memory before any is allocated."""

from __future__ import annotations

import math

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


def _token_bytes(quantizer, width: int, dtype: torch.dtype) -> int:
    """Stored bytes of one token of one KV head in ``quantizer``'s format: the parts of its quantized zero token of
    ``width`` channels in ``dtype`` (what the store's buffers are shaped from, `StoredTensor.zeros_like_probe`)."""
    probe = quantizer.quantize(torch.zeros(1, 1, 1, width, dtype=dtype))
    return sum(math.prod(part.shape[3:]) * part.element_size() for part in probe.parts.values())


def parts_nbytes(setting: LayerSetting, geometry: Geometry, first_tokens: int) -> int:
    """Bytes of the buffers `make_parts` makes for ``setting`` and ``geometry`` (first step of ``first_tokens``
    tokens), computed, not allocated: per store slot each format's token (`_token_bytes`), an int32 position, fp32
    score and value norm where kept, a pool's head tag; the refined rows' low planes and int32 slots; the ring's
    keys, values, scores and int32 positions; the counters (int64 ``seen`` and ``first_real``, two flags)."""
    batch, heads, head_dim, value_dim = geometry.batch, geometry.kv_heads, geometry.head_dim, geometry.value_dim
    rows = 1 if setting.head_adaptive else heads
    per_head = setting.slots_per_head(first_tokens)
    slots = per_head * (heads if setting.head_adaptive else 1)
    scored = setting.with_scores
    slot = (_token_bytes(setting.key_quantizer, head_dim, geometry.residual_dtype) + 4
            + _token_bytes(setting.value_quantizer, value_dim, geometry.residual_dtype)
            + 4 * scored + 4 * (scored and setting.policy.weighs_values))
    total = batch * rows * slots * slot + (batch * slots * (1 if heads <= 127 else 2) if setting.head_adaptive else 0)
    if setting.high_bits_fraction > 0:
        refined = setting.refined_per_head
        refined = math.ceil(setting.high_bits_fraction * per_head) if refined is None else refined
        widths = {"keys": head_dim, "values": value_dim}
        total += batch * rows * refined * (slots // per_head) * (4 + sum(widths[n] // 2 for n in setting.split_names))
    if setting.residual:
        element = torch.empty((), dtype=geometry.residual_dtype).element_size()
        total += batch * setting.residual * (heads * (head_dim + value_dim) * element + 4 + 4 * heads * scored)
    return total + 8 + 8 * batch + 2


def refuse_oversized(setting: LayerSetting, geometry: Geometry, first_tokens: int, num_layers: int) -> None:
    """Refuse, before allocating, buffers the device cannot hold: `parts_nbytes` of a layer of ``setting`` and
    ``geometry`` (first step of ``first_tokens`` tokens) times ``num_layers``, against the free memory of
    ``geometry.device`` (CUDA: ``mem_get_info``; CPU: available RAM).

    Raises:
        InputError: naming both sizes.
    """
    needed, free = parts_nbytes(setting, geometry, first_tokens) * num_layers, available_memory(geometry.device)
    if free is not None and needed > free:
        slots = setting.slots_per_head(first_tokens) * (geometry.kv_heads if setting.head_adaptive else 1)
        raise InputError(
            f"the cache needs {needed / 2**30:.2f} GiB ({num_layers} layers of {slots} slots, batch "
            f"{geometry.batch}) but {geometry.device} has {free / 2**30:.2f} GiB free; allowed: a smaller budget, "
            "max_length or batch"
        )
