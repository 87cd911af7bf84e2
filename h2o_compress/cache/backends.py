"""The decode backends of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer]: which code runs its one-token steps, chosen once, at
its first token (`choose`), and the state that code keeps between ``update`` and ``attend``.

Every backend has the same two methods: ``update(layer, keys, values)`` takes the new token (``[batch, kv_heads, 1,
head_dim]`` as the model made it) and returns what the model's attention call will hand back; ``attend(layer,
query, key, value, scaling, variant)`` returns the attention output ``[batch, 1, q_heads, head_dim]`` in the model's
basis, after the scores were added and the layer evicted.

- `TorchDecode`: the torch form (`h2o_compress.cache.decode`), static shapes, captured by ``torch.compile``; every
  variant (soft-cap, sink logits, sliding and chunked spans, head-adaptive pools, mixed precision).
- `CpuDecode`: the whole step in one native call (`h2o_compress.attention.cpu`).
- `TritonDecode`: the Triton op on CUDA (`h2o_compress.attention.slot_attention`): the layer writes the
  token, the op reads the store in place and adds the scores.

The kernels take plain tensors and sizes (`h2o_compress.attention.buffers`), never the layer: `slot_buffers` packs
the layer's parts into that call, here, in the one place that knows both.
"""

from __future__ import annotations

import torch

from h2o_compress.attention import cpu as cpu_kernel
from h2o_compress.attention.buffers import Eviction, RingBuffers, SlotBuffers, StoredSide
from h2o_compress.attention.choice import decode_kernel
from h2o_compress.cache import decode


def _side(quantizer, stored, basis: torch.Tensor | None) -> StoredSide:
    """One stored format of the layer as the kernels read it."""
    if quantizer.bits == 16:
        return StoredSide(16, 1, stored.parts["x"], None, basis)
    return StoredSide(quantizer.bits, quantizer.group_size, stored.parts["data"], stored.parts["scale_zero"], basis)


def slot_buffers(layer) -> SlotBuffers:
    """The buffers of ``layer`` (its own tensors, not copies) that a decode kernel reads and writes, packed for the
    call (`h2o_compress.attention.buffers`): built each step, so a resized or re-batched store is what the kernel
    sees."""
    store, ring, counters, setting, geometry = layer.store, layer.ring, layer.counters, layer.setting, layer.geometry
    return SlotBuffers(
        _side(setting.key_quantizer, store.keys, geometry.key_basis),
        _side(setting.value_quantizer, store.values, geometry.value_basis),
        store.positions, store.scores, getattr(store, "owner", None), store.norms,
        None if ring is None else RingBuffers(ring.keys, ring.values, ring.positions, ring.scores),
        counters.seen, counters.first_real, counters.finite, counters.consistent,
    )


class TorchDecode:
    """The torch form; keeps the validity of what attention reads, bool ``[batch, kv_heads, slots + residual]``."""

    name = "torch"

    def __init__(self):
        self.valid: torch.Tensor | None = None

    def update(self, layer, keys: torch.Tensor, values: torch.Tensor):
        layer.counters.note_finite(keys, values)
        keys, values = layer.geometry.to_storage(keys, values)
        keys, values, slot = decode.update(layer, keys, values)
        keys, values, self.valid = decode.read(layer, keys, values, slot)
        return keys, values

    def attend(self, layer, query, key, value, scaling, variant) -> torch.Tensor:
        valid, self.valid = self.valid, None
        query = layer.geometry.into_key_basis(query)
        output = decode.attend(layer, query, key, value, valid, scaling, variant)
        return layer.geometry.from_value_basis(output.transpose(1, 2), query.dtype)


class CpuDecode:
    """The native CPU kernel; keeps the new token until the attention call, and layer 0's token count (the
    container's consistency check, which the kernel makes itself). The kernel evicts itself for per-head slots and
    a policy ranking by nothing or by its scores (`kernel_evicts`); else the layer evicts after it."""

    name = "cpu"

    def __init__(self):
        self.incoming: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reference_seen: torch.Tensor | None = None

    def update(self, layer, keys: torch.Tensor, values: torch.Tensor):
        decode.grow_for_token(layer)
        # the whole step (finite flag, bases, ring, store, attention, scores) is one kernel call in attend()
        self.incoming = (keys, values)
        return keys, values

    def attend(self, layer, query, key, value, scaling, variant) -> torch.Tensor:
        (keys, values), self.incoming = self.incoming, None
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        evicts = self.kernel_evicts(layer)
        output = cpu_kernel.decode_layer(slot_buffers(layer), self.eviction(layer, evicts), query, keys, values,
                                         scale, self.reference_seen)
        if not evicts:  # a policy with its own ranking, or a head-adaptive pool
            layer.evict()
        return output

    @staticmethod
    def kernel_evicts(layer) -> bool:
        """Whether the kernel evicts for ``layer`` (per-head slots and a policy ranking by nothing or by its scores);
        else the layer does ([`CompressedLayer.evict`][h2o_compress.cache.CompressedLayer.evict]): a policy with its
        own ranking, or a head-adaptive pool, whose eviction ranks over every head of the layer."""
        setting = layer.setting
        return setting.capacity is not None and setting.policy.ranks_by != "custom" \
            and getattr(layer.store, "owner", None) is None

    @staticmethod
    def eviction(layer, evicts: bool) -> Eviction:
        """The kernel's eviction for ``layer`` (EvictionPolicy.priority's rules, as numbers), its score update (TOVA
        replaces) and a calibrated policy's weights (``ranks_by == "predicted"``), which the kernel ranks by and
        writes each entering token's prior with."""
        policy, capacity, norms = layer.setting.policy, layer.setting.capacity, layer.store.norms
        prior = policy.weights_on(norms.device) if policy.ranks_by == "predicted" and norms is not None else None
        if not evicts:
            return Eviction(replace_scores=not policy.accumulates, prior_weights=prior)
        rank = layer.store.scores if policy.ranks_by in ("scores", "predicted") else None
        return Eviction(capacity, policy.recent_window(capacity), min(policy.sink_tokens, capacity), rank, True,
                        not policy.accumulates, prior)


class TritonDecode:
    """The Triton op; keeps its scratch (workspace, not cache state, one per shape: `scratch_for`) and the token
    that entered the store."""

    name = "triton"

    def __init__(self):
        self.scratch = None
        self.leaving = None

    def update(self, layer, keys: torch.Tensor, values: torch.Tensor):
        layer.counters.note_finite(keys, values)
        keys, values = layer.geometry.to_storage(keys, values, fused=True)
        keys, values, slot = decode.update(layer, keys, values)
        self.leaving = (keys, values, slot)  # the op reads the store and ring in place: nothing is dequantized
        return keys, values

    def attend(self, layer, query, key, value, scaling, variant) -> torch.Tensor:
        from h2o_compress.attention import slot_attention  # deferred: needs triton, an optional dependency

        leaving, self.leaving = self.leaving, None
        output = slot_attention.decode_layer(slot_buffers(layer), self.scratch_for(layer, query.shape[1]), query,
                                             leaving, scaling, layer.setting.policy.accumulates)
        layer.evict()
        return output.transpose(1, 2).contiguous()

    def scratch_for(self, layer, q_heads: int):
        """The op's scratch for ``layer``'s shape (batch, slots) and ``q_heads`` query heads, allocated once per shape:
        eager steps allocate it (at the prefill, the first decode step, or when rows move in); a compiled step finds
        it."""
        from h2o_compress.attention import slot_attention  # deferred: needs triton, an optional dependency

        geometry, store, with_scores = layer.geometry, layer.store, layer.setting.with_scores
        ring = 0 if layer.ring is None else layer.ring.size
        key = (geometry.batch, q_heads, store.slots + ring, with_scores)
        if self.scratch is None or self.scratch.key != key:
            self.scratch = slot_attention.make_scratch(
                geometry.batch, q_heads, geometry.kv_heads, geometry.head_dim, store.slots, ring, with_scores,
                layer.setting.key_quantizer.bits, layer.setting.value_quantizer.bits, geometry.device)
        return self.scratch


BACKENDS = {backend.name: backend for backend in (TorchDecode, CpuDecode, TritonDecode)}


def choose(layer):
    """The backend of ``layer`` at its first token (`decode_kernel` for its
    device, dtypes, head dim and formats; the torch form where a part needs it: mixed precision's low planes, a
    pool whose head tags the CPU kernel cannot read, any pool on the Triton op, which reads per-head slots, and
    values held at another width than the keys, which both kernels read at the keys' head dim)."""
    setting, geometry = layer.setting, layer.geometry
    kernel = decode_kernel(setting.attention_kernel, geometry.device, geometry.dtype, geometry.residual_dtype,
                           geometry.head_dim, (setting.key_quantizer, setting.value_quantizer), layer.layer_idx)
    owner = getattr(layer.store, "owner", None)
    if layer.store.refine is not None or (owner is not None and (kernel == "triton" or owner.dtype != torch.int8)):
        kernel = "torch"
    if geometry.value_dim != geometry.head_dim:
        kernel = "torch"
    return BACKENDS[kernel]()
