"""`HeadAdaptiveLayer`: one layer's budget spread over its KV heads by where the attention goes (Ada-KV).

Ada-KV (Feng et al. 2024, arXiv 2407.11550 §3) replaces "``C`` tokens per KV head" by "``kv_heads x C`` tokens per
layer": every head keeps its own protected tokens (recent window, sinks: ``+inf`` in
:meth:`~h2o_compress.policies.EvictionPolicy.priority`), and the heavy-hitter rest of the layer's budget goes to
the highest-ranked tokens over all heads together (one flat top-k over heads), so a head whose attention is spread
over many old tokens keeps more of them than a head that attends to few.

Layout (:class:`~h2o_compress.cache.slot_pool.SlotPool`): the store is one pool of ``kv_heads x (C - residual + 1)``
slots per sequence (uniform's ``C - residual + 1`` per head, the same bytes) with a head tag per slot; the ring of
the newest ``residual`` tokens stays per head. Evicting a token frees its slot for any head: ``nbytes`` is the
layer's total budget, not ``kv_heads x`` the largest head's share.

Decode step (static shapes, no host sync, ``torch.compile(fullgraph=True)``): the ``kv_heads`` tokens leaving the
ring take the lowest free slots of the pool, attention reads the pool (dequantized once, broadcast over the heads)
and the ring with validity ``position >= 0 & owner == head``, each slot's score is its owner's probability, and
while the layer holds more than ``kv_heads x C`` tokens the lowest-priority pool token over all heads is evicted
(at most ``kv_heads`` per step, one masked argmin each). Multi-token steps keep the flat top ``kv_heads x C``.
On the CPU the step is one call of the native kernel (``attention/cpu_decode.c`` reads the head tags: each head's
leaving token takes the lowest free slot, its attention reads the slots it owns) and the eviction above follows it;
elsewhere the torch form (the Triton op assumes per-head slots).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from . import decode
from .layer import CompressedLayer
from .slot_pool import SlotPool


class HeadAdaptiveLayer(CompressedLayer):
    """A :class:`CompressedLayer` whose capacity ``C`` is per layer and sequence on average over the KV heads
    (``kv_heads x C`` in all), shared by the heads by the policy's ranking (Ada-KV). Arguments as
    :class:`CompressedLayer`; ``capacity`` or ``max_tokens`` must be given (the pool has a fixed size).

    Raises:
        ConfigError: ``attention_kernel='triton'`` (the Triton op reads per-head slots), or no capacity and no
            ``max_tokens``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.attention_kernel == "triton":
            raise ConfigError(
                "attention_kernel='triton' cannot run head_budgets='adaptive': the Triton op reads per-head slots and "
                "an adaptive layer pools them; allowed: attention_kernel='auto' or 'torch' (the torch form)"
            )
        if self.growable:
            raise ConfigError("head_budgets='adaptive' needs a capacity or max_length (its slot pool has a fixed size)")

    # -- layout ------------------------------------------------------------------------------------------
    def store_slots(self, first_chunk: int = 0) -> int:
        """Pool slots: ``kv_heads x`` uniform's slots per head (one free slot per head before each step)."""
        return self.kv_heads * super().store_slots(first_chunk)

    def _new_store(self, shape: tuple[int, int, int, int]) -> SlotPool:
        return SlotPool(self.key_quantizer, self.value_quantizer, shape, self.residual_dtype, self.device,
                        self.with_scores)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """As :meth:`CompressedLayer.lazy_initialization`; decode steps run the CPU kernel (which reads the pool's
        head tags) where it runs, else the torch form (never the Triton op)."""
        super().lazy_initialization(key_states, value_states)
        self.fused = False
        self.native = self.native and self.store.owner.dtype == torch.int8

    def _held_store(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super()._held_store()
        return keys.expand(-1, self.kv_heads, -1, -1), values.expand(-1, self.kv_heads, -1, -1)

    # -- multi-token steps (eager) ---------------------------------------------------------------------------
    def _store_incoming(self, incoming, keys, values, positions, scores):
        """Quantize the kept tokens leaving the ring or the chunk (bool ``incoming`` ``[batch, kv_heads, n]``) and
        write them into the lowest free slots of each sequence's pool, tagged with their head (eager): uniform's
        writer over the pool seen as one row of ``kv_heads x n`` tokens. Returns where they went, as uniform's."""
        batch, heads, n = incoming.shape

        def one_row(t: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, n, ...] -> [batch, 1, kv_heads * n, ...]
            return t.reshape(batch, 1, heads * n, *t.shape[3:])

        placed = super()._store_incoming(one_row(incoming), one_row(keys), one_row(values), positions.repeat(1, heads),
                                         None if scores is None else one_row(scores))
        if placed is not None:
            b, row, slot, j = placed
            self.store.owner[b, row, slot] = (j // n).to(self.store.owner.dtype)
        return placed

    # -- decode steps (compiled) ------------------------------------------------------------------------------
    def _decode_update(self, keys: torch.Tensor, values: torch.Tensor):
        """One token per head: ring in, the ``kv_heads`` tokens leaving it into the lowest free pool slots
        (quantized once), then what attention reads, ``[batch, kv_heads, pool_slots + residual, head_dim]`` (the
        pool broadcast over heads) with validity ``position >= 0 & owner == head``. No host sync."""
        position, heads = self.seen, self.kv_heads
        keys, values, leaving, score = decode.ring_in(self, keys, values)
        slot = self.store.free_slots(heads)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [batch, 1, kv_heads, head_dim]
        owner = torch.arange(heads, device=self.device).view(1, 1, heads).expand(self.batch, 1, heads)
        self.store.insert(
            slot, *self._quantize_incoming(keys, values),
            leaving.unsqueeze(1).expand(-1, 1, heads), None if score is None else score.transpose(1, 2), owner,
        )
        self._after_insert(slot)
        self.first_real.clamp_(max=position)
        self.seen.add_(1)
        valid = self.store.head_positions() >= 0
        if self.ring is not None:
            valid = torch.cat((valid, (self.ring.positions >= 0).unsqueeze(1).expand(-1, heads, -1)), dim=2)
        self.decode_valid = valid
        index = slot.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)
        ring_keys, ring_values = (None, None) if self.ring is None else (self.ring.keys, self.ring.values)
        keys = self._pool_read("keys", self.key_quantizer, self.store.keys, keys, index, ring_keys)
        values = self._pool_read("values", self.value_quantizer, self.store.values, values, index, ring_values)
        return keys, values

    def _pool_read(self, name, quantizer, stored, leaving, index, ring) -> torch.Tensor:
        """The pool dequantized (the tokens leaving the ring at full precision in their new slots, as uniform's
        :func:`.decode.read`), broadcast over the heads, then the ring: ``[batch, kv_heads, pool_slots
        + residual, head_dim]`` in the model dtype."""
        if not self.quantized:  # 16-bit: the pool itself, broadcast (no copy)
            return quantizer.dequantize(stored, self.dtype).expand(-1, self.kv_heads, -1, -1)
        held = torch.empty(self.batch, 1, self.store.slots, self.head_dim, dtype=self.dtype, device=self.device)
        quantizer.dequantize_into(stored, held)
        self._refine_read(name, held)
        held.scatter_(2, index, leaving.to(self.dtype))
        held = held.expand(-1, self.kv_heads, -1, -1)
        return held if ring is None else torch.cat((held, ring.to(self.dtype)), dim=2)
