"""The decode backends of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer]: which kernel runs its one-token
steps, chosen once, at its first token (`choose`).

Every backend has one method the layer calls, ``update(layer, keys, values)``: it takes the new token (``[batch,
kv_heads, 1, head_dim]`` as the model made it), does what needs the cache, and returns ``(keys, values, call)``:
what the model's attention call will hand back, and the `DecodeCall` the layer announces, which the attention
function runs in ``attention/`` (`h2o_compress.attention.decode_step`) without calling back into the cache. Its
``leaves_eviction(layer)`` says whether the layer evicts after the kernel (at the start of its next step).

- `TorchDecode`: the torch form (`h2o_compress.cache.decode` here, `decode_attention` there), static shapes,
  captured by ``torch.compile``; every variant (soft-cap, sink logits, sliding and chunked spans, head-adaptive
  pools, mixed precision).
- `CpuDecode`: the whole step (ring, store, attention, scores; the eviction where `kernel_evicts`) in one native
  call (`h2o_compress.attention.cpu`).
- `TritonDecode`: the Triton op on CUDA (`h2o_compress.attention.slot_attention`): the layer writes the
  token, the op reads the store in place and adds the scores.

The kernels take plain tensors and sizes (`h2o_compress.attention.buffers`), never the layer:
`h2o_compress.cache.decode.slot_buffers` packs the layer's parts into that call.
"""

from __future__ import annotations

import torch

from h2o_compress.attention.buffers import Eviction
from h2o_compress.attention.choice import decode_kernel
from h2o_compress.attention.decode_step import DecodeCall, ScratchHolder
from h2o_compress.cache import decode
from h2o_compress.cache.decode import slot_buffers


def _call(layer, kernel: str, **parts) -> DecodeCall:
    """The `DecodeCall` of ``layer``'s step on ``kernel``, with the kernel's own ``parts`` (the torch form's
    buffers without the stored codes, which it read dequantized in ``update``)."""
    setting = layer.setting
    return DecodeCall(kernel, layer.link, slot_buffers(layer, codes=kernel != "torch"), layer.geometry.kv_heads,
                      setting.with_scores, setting.policy.accumulates, **parts)


class TorchDecode:
    """The torch form: the layer writes the token and reads what attention reads (dequantized once); the attention
    side runs `decode_attention` over it and adds the scores; the layer evicts at its next step."""

    name = "torch"

    def update(self, layer, keys: torch.Tensor, values: torch.Tensor):
        layer.counters.note_finite(keys, values)
        keys, values = layer.geometry.to_storage(keys, values)
        keys, values, slot = decode.update(layer, keys, values)
        keys, values, valid = decode.read(layer, keys, values, slot)
        return keys, values, _call(layer, self.name, valid=valid)

    @staticmethod
    def leaves_eviction(layer) -> bool:
        return True


class CpuDecode:
    """The native CPU kernel: the new token goes to the kernel, which writes it; keeps layer 0's token count (the
    container's consistency check, which the kernel makes itself). The kernel evicts itself for per-head slots and
    a policy ranking by nothing or by its scores (`kernel_evicts`); else the layer evicts at its next step."""

    name = "cpu"

    def __init__(self):
        self.reference_seen: torch.Tensor | None = None

    def update(self, layer, keys: torch.Tensor, values: torch.Tensor):
        decode.grow_for_token(layer)
        # the whole step (finite flag, bases, ring, store, attention, scores) is one kernel call on the attention side
        call = _call(layer, self.name, token=(keys, values), reference_seen=self.reference_seen,
                     eviction=self.eviction(layer, self.kernel_evicts(layer)))
        return keys, values, call

    def leaves_eviction(self, layer) -> bool:
        return not self.kernel_evicts(layer)

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
    """The Triton op: the layer writes the token (ring in, the leaving token into the store); the op reads the store
    in place and adds the scores; the layer evicts at its next step. Keeps the op's scratch (`ScratchHolder`:
    workspace, not cache state, one per shape)."""

    name = "triton"

    def __init__(self):
        self.holder = ScratchHolder()

    @property
    def scratch(self):
        """The op's scratch of the last shape (`scratch_for`), or ``None``."""
        return self.holder.scratch

    def update(self, layer, keys: torch.Tensor, values: torch.Tensor):
        layer.counters.note_finite(keys, values)
        keys, values = layer.geometry.to_storage(keys, values, fused=True)
        keys, values, slot = decode.update(layer, keys, values)
        # the op reads the store and ring in place: nothing is dequantized
        return keys, values, _call(layer, self.name, token=(keys, values, slot), scratch=self.holder)

    @staticmethod
    def leaves_eviction(layer) -> bool:
        return True

    def scratch_for(self, layer, q_heads: int):
        """The op's scratch for ``layer``'s shape (batch, slots) and ``q_heads`` query heads, allocated once per shape:
        eager steps allocate it (at the prefill, the first decode step, or when rows move in); a compiled step finds
        it."""
        return self.holder.for_shape(slot_buffers(layer), q_heads, layer.geometry.head_dim)


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
