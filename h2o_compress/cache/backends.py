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
"""

from __future__ import annotations

import torch

from h2o_compress.attention import cpu as cpu_kernel
from h2o_compress.attention.choice import decode_kernel
from h2o_compress.cache import decode


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
    container's consistency check, which the kernel makes itself)."""

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
        output = cpu_kernel.decode_layer(layer, query, keys, values, scale, self.reference_seen)
        if not cpu_kernel.evicts(layer):  # a policy with its own ranking, or a head-adaptive pool
            layer.evict()
        return output


class TritonDecode:
    """The Triton op; keeps its scratch (workspace, not cache state) and the token that entered the store."""

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

        output = slot_attention.decode_layer(layer, query, scaling)
        layer.evict()
        return output.transpose(1, 2).contiguous()


BACKENDS = {backend.name: backend for backend in (TorchDecode, CpuDecode, TritonDecode)}


def choose(layer):
    """The backend of ``layer`` at its first token (`decode_kernel` for its
    device, dtypes, head dim and formats; the torch form where a part needs it: mixed precision's low planes, a
    pool whose head tags the CPU kernel cannot read, and any pool on the Triton op, which reads per-head slots)."""
    kernel = decode_kernel(layer.attention_kernel, layer.device, layer.dtype, layer.residual_dtype, layer.head_dim,
                           (layer.key_quantizer, layer.value_quantizer), layer.layer_idx)
    owner = getattr(layer.store, "owner", None)
    if layer.store.refine is not None or (owner is not None and (kernel == "triton" or owner.dtype != torch.int8)):
        kernel = "torch"
    return BACKENDS[kernel]()
