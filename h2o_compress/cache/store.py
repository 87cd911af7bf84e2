"""The store of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer], made at its first token: per-head slots
([`SlotStore`][h2o_compress.cache.SlotStore]) or one pool shared by the KV heads ([`SlotPool`][h2o_compress.cache.SlotPool], Ada-KV), with the
low planes of its top-ranked tokens where the setting keeps some at 8 bits ([`RefinedPlanes`][h2o_compress.cache.RefinedPlanes])."""

from __future__ import annotations

from h2o_compress.cache.refinement import RefinedPlanes, refined_rows
from h2o_compress.cache.setting import LayerSetting
from h2o_compress.cache.slot_pool import SlotPool
from h2o_compress.cache.slots import SlotStore


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
