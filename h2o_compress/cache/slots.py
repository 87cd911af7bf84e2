"""`SlotStore`: the kept tokens of one layer in stored form (quantized once), in fixed, preallocated slots.

Per (sequence, KV head) a slot holds one token or is empty (position ``-1``), so tokens of different heads live in
different slots, in no particular order (the cold-compress layout: fixed ``[batch, heads, slots, ...]`` buffers,
a position array, a validity mask derived from it). Eviction marks a slot empty; the next token that enters the
store takes the first empty slot. Nothing here allocates after construction or syncs with the host, so a decode
step that uses it can be captured by ``torch.compile`` and CUDA graphs.
"""

from __future__ import annotations

import torch

from h2o_compress.formats import KVQuantizer, StoredTensor
from h2o_compress.formats.calibrated import CalibratedKeyQuantizer
from h2o_compress.formats.split import SplitIntQuantizer
from h2o_compress.policies.base import keep_top, value_l1_norm


def in_model_basis(values: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[..., tokens, head_dim]``: values held in the orthonormal, symmetric ``basis`` (``v_held = v @ basis``,
    so ``v = v_held @ basis``) turned back into the model's basis (as they are where ``basis`` is ``None``)."""
    values = values.float()
    return values if basis is None else values @ basis


def value_l1_norms(values: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[..., tokens]``: the L1 norm of each value ``[..., tokens, head_dim]`` held in ``basis``, in the model's
    basis (`in_model_basis`)."""
    return value_l1_norm(in_model_basis(values, basis))


class SlotStore:
    """Keys, values, positions and (optionally) accumulated scores of ``slots`` token slots per sequence and head.

    Attributes:
        keys: [`StoredTensor`][h2o_compress.formats.StoredTensor] ``[batch, kv_heads, slots, ...]`` in the quantizers' formats.
        values: [`StoredTensor`][h2o_compress.formats.StoredTensor] ``[batch, kv_heads, slots, ...]`` in the quantizers' formats.
        positions: int32 ``[batch, kv_heads, slots]``, the absolute position of each held token, ``-1`` = empty.
        scores: fp32 ``[batch, kv_heads, slots]`` accumulated attention, or ``None`` (policies without scores).
        norms: fp32 ``[batch, kv_heads, slots]``, the L1 norm of each stored value in the model's basis, set once when
            the token enters (from its stored form), or ``None`` (policies that do not weigh values: all but VATP).
        quantizers: the key and value formats tokens are stored in.
        refine: the low planes of the top-ranked tokens ([`RefinedPlanes`][h2o_compress.cache.RefinedPlanes], mixed precision by
            importance), or ``None``; set by the layer once its rows are known.

    Args:
        key_quantizer: storage format of the keys.
        value_quantizer: storage format of the values.
        shape: ``(batch, kv_heads, slots, head_dim)``.
        dtype: dtype of the tokens the quantizers receive (the store of a 16-bit cache keeps it).
        device: where the buffers live.
        with_scores: keep a score per slot.
        with_norms: keep each stored value's L1 norm (`norms`), for policies whose priority weighs values.
        value_basis: the orthonormal, symmetric basis ``[head_dim, head_dim]`` values are held in (``None``: the
            model's); the norms are taken in the model's basis.
        value_weight: what `norms` holds for values ``[batch, rows, n, value_dim]`` in the model's basis (fp32
            ``[batch, rows, n]``; the policy's
            [`value_weight`][h2o_compress.policies.EvictionPolicy.value_weight]); ``None``: their L1 norms
            (`h2o_compress.policies.base.value_l1_norm`).
        value_dim: the values' width (``None``: ``head_dim``; the value format must take that width).
    """

    def __init__(
        self, key_quantizer: KVQuantizer, value_quantizer: KVQuantizer, shape: tuple[int, int, int, int],
        dtype: torch.dtype, device: torch.device, with_scores: bool, with_norms: bool = False,
        value_basis: torch.Tensor | None = None, value_weight=None, value_dim: int | None = None,
    ):
        batch, heads, slots, head_dim = shape
        probe = torch.zeros(1, 1, 1, head_dim, dtype=dtype)  # on the CPU: learns each format's parts
        value_probe = torch.zeros(1, 1, 1, value_dim or head_dim, dtype=dtype)
        self.keys = StoredTensor.zeros_like_probe(key_quantizer.quantize(probe), batch, heads, slots, device)
        self.values = StoredTensor.zeros_like_probe(value_quantizer.quantize(value_probe), batch, heads, slots, device)
        self.positions = torch.full((batch, heads, slots), -1, dtype=torch.int32, device=device)
        self.scores = torch.zeros(batch, heads, slots, device=device) if with_scores else None
        self.norms = torch.zeros(batch, heads, slots, device=device) if with_norms else None
        self.value_basis = value_basis
        self.value_weight = value_l1_norm if value_weight is None else value_weight
        self.quantizers = (key_quantizer, value_quantizer)
        self.refine = None

    @property
    def slots(self) -> int:
        return self.positions.shape[2]

    @property
    def slots_per_head(self) -> int:
        """Slots each KV head can use (all of them: every head has its own row)."""
        return self.slots

    # -- per KV head: the same methods on a SlotPool, whose heads share one row of slots ------------------
    def head_positions(self) -> torch.Tensor:
        """int32 ``[batch, kv_heads, slots]``: the position each slot holds for each KV head, ``-1`` where it
        holds nothing for that head."""
        return self.positions

    def head_scores(self) -> torch.Tensor:
        """fp32 ``[batch, kv_heads, slots]``: the scores per KV head (0 where the head holds nothing)."""
        return self.scores

    def value_norms(self) -> torch.Tensor:
        """fp32 ``[batch, rows, slots]``: `norms`, the L1 norm of each stored value, dequantized, in the model's
        basis, set when each token entered (empty slots hold garbage: mask them with ``positions >= 0``). Only a
        store made ``with_norms`` (a policy that weighs values, VATP) has them."""
        return self.norms

    def norms_of(self, values: StoredTensor) -> torch.Tensor:
        """fp32 ``[batch, rows, n]``: the `value_weight` (by default the L1 norms) of stored-format ``values``
        ``[batch, rows, n, ...]``, dequantized, in the model's basis: what `norms` holds for them once they enter."""
        held = self.quantizers[1].dequantize(values, torch.float32)
        return self.value_weight(in_model_basis(held, self.value_basis))

    def refresh_norms(self) -> None:
        """Recompute `norms` from the stored values (after buffers were loaded from a file; the norms are
        derived, so a file's own are never trusted). No-op without norms."""
        if self.norms is not None:
            self.norms.copy_(self.norms_of(self.values))

    def head_value_norms(self) -> torch.Tensor:
        """fp32 ``[batch, kv_heads, slots]``: [`value_norms`][h2o_compress.cache.SlotStore.value_norms] per KV head."""
        return self.value_norms()

    def score_share(self, sums: torch.Tensor) -> torch.Tensor:
        """What per-head probability sums ``[batch, kv_heads, slots]`` add to `scores`: themselves."""
        return sums

    def keep(self, priority: torch.Tensor, positions: torch.Tensor, capacity: int) -> torch.Tensor:
        """bool ``[batch, kv_heads, tokens]``: what a multi-token step keeps of the tokens ranked by fp32
        ``priority`` at int ``positions`` (both ``[batch, kv_heads, tokens]``): the top ``capacity`` per sequence
        and head."""
        return keep_top(priority, positions, capacity)

    def keep_only(self, keep: torch.Tensor, scores: torch.Tensor | None) -> None:
        """After a multi-token step: empty the slots not kept (bool ``keep`` ``[batch, kv_heads, slots]``) and set
        the scores (fp32, same shape, or ``None``)."""
        self.positions.masked_fill_(~keep, -1)
        if scores is not None:
            self.scores.copy_(scores)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer, by name (``keys.<part>``, ``values.<part>``, ``positions``, ``scores``, ``value_norms``)."""
        held = {f"keys.{k}": v for k, v in self.keys.parts.items()}
        held |= {f"values.{k}": v for k, v in self.values.parts.items()}
        held["positions"] = self.positions
        if self.scores is not None:
            held["scores"] = self.scores
        if self.norms is not None:
            held["value_norms"] = self.norms
        return held

    def first_free(self) -> torch.Tensor:
        """int64 ``[batch, kv_heads, 1]``: the lowest empty slot of each sequence and head (slot 0 when none is
        empty: callers guarantee one is, see [`CompressedLayer`][h2o_compress.cache.CompressedLayer])."""
        return (self.positions < 0).to(torch.uint8).argmax(-1, keepdim=True)

    def insert(
        self, slot: torch.Tensor, keys: StoredTensor, values: StoredTensor, position: torch.Tensor,
        score: torch.Tensor | None,
    ) -> None:
        """Write one token per sequence and head into ``slot`` (int64 ``[batch, kv_heads, 1]``): stored-format
        ``keys``/``values`` (token dim 1), int32 ``position`` ``[batch, kv_heads, 1]`` (``-1`` leaves the slot
        empty) and fp32 ``score`` (ignored without scores)."""
        self.keys.scatter_(slot, keys)
        self.values.scatter_(slot, values)
        self.positions.scatter_(2, slot, position)
        if self.scores is not None:
            self.scores.scatter_(2, slot, score)
        if self.norms is not None:
            self.norms.scatter_(2, slot, self.norms_of(values))

    def place(self, incoming: torch.Tensor, keys: StoredTensor, values: StoredTensor, positions: torch.Tensor,
              scores: torch.Tensor | None):
        """A multi-token step's writer (eager): the tokens marked in bool ``incoming`` ``[batch, kv_heads, n]``
        go into the empty slots of their sequence and head, lowest first, in token order: stored-format
        ``keys``/``values`` ``[batch, kv_heads, n, ...]``, int ``positions`` ``[batch, n]`` and fp32 ``scores``
        ``[batch, kv_heads, n]`` (ignored without scores). Callers guarantee enough empty slots. Returns where
        they went, ``(b, h, slot, i)`` (1-D int64: token ``i`` of sequence ``b``, head ``h`` in ``slot``)."""
        empty = self.positions < 0
        free_first = torch.sort(empty.to(torch.uint8), dim=-1, descending=True, stable=True).indices
        target = free_first.gather(-1, (incoming.long().cumsum(-1) - 1).clamp(min=0))
        b, h, i = incoming.nonzero(as_tuple=True)
        slot = target[b, h, i]
        self.keys.put_((b, h, slot), keys, (b, h, i))
        self.values.put_((b, h, slot), values, (b, h, i))
        self.positions[b, h, slot] = positions[b, i].to(torch.int32)
        if self.scores is not None and scores is not None:
            self.scores[b, h, slot] = scores[b, h, i]
        if self.norms is not None:
            self.norms[b, h, slot] = self.norms_of(values)[b, h, i]
        return b, h, slot, i

    def evict_lowest(self, priority: torch.Tensor, over: torch.Tensor) -> None:
        """Where ``over`` (bool ``[batch, kv_heads]``), empty the slot of lowest ``priority`` (fp32 ``[batch,
        kv_heads, slots]``; empty slots must carry ``+inf``), ties evicting the newer token (masked argmin +
        scatter, no host sync)."""
        lowest = priority == priority.amin(-1, keepdim=True)
        victim = torch.where(lowest, self.positions, -1).argmax(-1, keepdim=True)
        kept = self.positions.gather(2, victim)
        self.positions.scatter_(2, victim, torch.where(over.unsqueeze(-1), -1, kept))

    def evict_over(self, priority: torch.Tensor, ring_held: torch.Tensor | int, capacity: int) -> None:
        """A decode step's eviction: where a sequence and KV head holds more than ``capacity`` tokens (its slots
        plus ``ring_held``, int ``[batch, 1]`` tokens in the recent window, or 0), evict its lowest-``priority``
        stored token (fp32 ``[batch, kv_heads, slots]``; [`evict_lowest`][h2o_compress.cache.SlotStore.evict_lowest]). In place, no host sync."""
        held = (self.positions >= 0).sum(-1) + ring_held
        self.evict_lowest(priority.masked_fill(self.positions < 0, float("inf")), held > capacity)

    # -- what the layer calls (the same on a SlotPool, whose heads share one row) -----------------------------
    def as_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A per-head tensor ``[batch, kv_heads, 1, ...]`` (one token per head; ``...`` may be empty) in this store's
        rows: itself."""
        return t

    def free_for_heads(self, heads: int) -> torch.Tensor:
        """int64 ``[batch, rows, k]``: where one token per KV head goes (each head's lowest empty slot)."""
        return self.first_free()

    def quantize(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None):
        """The stored forms of tokens entering the store (``[batch, rows, n, head_dim]``, at int ``positions``
        ``[batch, rows, n]``, which a positional key format needs) and, with `refine`, their low planes
        ``{name: uint8 [batch, rows, n, head_dim / 2]}`` (else ``{}``)."""
        stored, low = [], {}
        for name, x, quantizer in (("keys", keys, self.quantizers[0]), ("values", values, self.quantizers[1])):
            if self.refine is not None and isinstance(quantizer, SplitIntQuantizer):
                part, low[name] = quantizer.quantize_split(x)
            elif isinstance(quantizer, CalibratedKeyQuantizer):
                part = quantizer.quantize_at(x, positions)
            else:
                part = quantizer.quantize(x)
            stored.append(part)
        return stored[0], stored[1], low

    def enter(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, score, rank) -> torch.Tensor:
        """A decode step's writer: one token per KV head (``keys``/``values`` ``[batch, kv_heads, 1, head_dim]``,
        int32 ``position`` ``[batch, 1]`` (``-1``: nothing enters), fp32 ``score`` ``[batch, kv_heads, 1]`` or
        ``None``) into the lowest empty slot of its head, quantized once; with `refine`, each takes a low-plane
        row by ``rank()`` (the policy's rank of every stored token). Returns the slots, int64 ``[batch, rows,
        k]``. In place, no host sync."""
        heads = keys.shape[1]
        slot = self.free_for_heads(heads)
        positions = self.as_rows(position.unsqueeze(1).expand(-1, heads, -1))
        stored_keys, stored_values, low = self.quantize(self.as_rows(keys), self.as_rows(values), positions)
        self.insert(slot, stored_keys, stored_values, positions, None if score is None else self.as_rows(score))
        if self.refine is not None:
            ranked = rank()
            for k in range(slot.shape[2]):
                self.refine.admit_one(slot[..., k:k + 1], {n: t[:, :, k:k + 1] for n, t in low.items()}, ranked,
                                      self.positions)
        return slot

    def place_tokens(self, incoming, keys, values, positions, scores, rank, when_full) -> tuple | None:
        """A multi-token step's writer (eager): the kept tokens marked in bool ``incoming`` ``[batch, kv_heads,
        n]`` (``keys``/``values`` ``[batch, kv_heads, n, head_dim]``, int ``positions`` ``[batch, n]``, fp32
        ``scores`` ``[batch, kv_heads, n]`` or ``None``) quantized once into empty slots ([`place`][h2o_compress.cache.SlotStore.place]);
        ``when_full(tokens)`` is called first where a row lacks room (it raises, or grows the store). With
        `refine`, the top-``rank()`` tokens keep their low planes. Returns [`place`][h2o_compress.cache.SlotStore.place]'s ``(b, h, slot,
        i)`` or ``None`` when nothing entered."""
        refined = None if self.refine is None else self.refine.in_use(self.positions)
        placed, low = None, {}
        if bool(incoming.any()):
            if bool((incoming.sum(-1) > (self.positions < 0).sum(-1)).any()):
                when_full(int(incoming.sum(-1).max()))
            at = positions.unsqueeze(1).expand(-1, keys.shape[1], -1)
            stored_keys, stored_values, low = self.quantize(keys, values, at)
            placed = self.place(incoming, stored_keys, stored_values, positions, scores)
        if self.refine is not None:
            self.refine.admit_many(refined, placed, low, rank(), self.positions)
        return placed

    def read(self, name: str, ring: torch.Tensor | None, leaving: torch.Tensor, slot: torch.Tensor,
             dtype: torch.dtype, heads: int) -> torch.Tensor:
        """What a decode step's attention reads of ``name`` (``keys``/``values``), ``[batch, heads, slots + ring,
        head_dim]`` in ``dtype``: the store dequantized (the refined tokens at 8 bits), the token that just
        entered at full precision in its ``slot`` (``leaving`` in this store's rows: its last step at full
        precision, as in a chunk), broadcast over the heads of a pool, then the ``ring`` (or ``None``)."""
        quantizer, stored = self.quantizers[name == "values"], getattr(self, name)
        batch, rows, slots = self.positions.shape
        size, head_dim = 0 if ring is None else ring.shape[2], leaving.shape[-1]
        out = torch.empty(batch, heads if rows == heads else rows, slots + (size if rows == heads else 0), head_dim,
                          dtype=dtype, device=self.positions.device)
        held = out[:, :, :slots]
        if isinstance(quantizer, CalibratedKeyQuantizer):
            quantizer.dequantize_at(stored, held, self.positions)
        else:
            quantizer.dequantize_into(stored, held)
        self.refine_read(name, held)
        held.scatter_(2, slot.unsqueeze(-1).expand(-1, -1, -1, head_dim), leaving.to(dtype))
        if rows != heads:
            held = held.expand(-1, heads, -1, -1)
            return held if ring is None else torch.cat((held, ring.to(dtype)), dim=2)
        if ring is not None:
            out[:, :, slots:].copy_(ring)
        return out

    def held(self, dtype: torch.dtype, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The store's keys and values per KV head, ``[batch, heads, slots, head_dim]`` in ``dtype`` (refined
        tokens at 8 bits; a 16-bit store is read in place)."""
        keys, values = self.dequantize(*self.quantizers, dtype)
        self.refine_read("keys", keys)
        self.refine_read("values", values)
        return keys.expand(-1, heads, -1, -1), values.expand(-1, heads, -1, -1)

    def refine_read(self, name: str, held: torch.Tensor) -> None:
        """With `refine`, the refined tokens of ``held`` (``name`` just dequantized at 4 bits, a fresh
        tensor ``[batch, rows, slots, head_dim]``) get their low planes back (8-bit values)."""
        quantizer = self.quantizers[name == "values"]
        if self.refine is not None and isinstance(quantizer, SplitIntQuantizer):
            scale_zero = getattr(self, name).parts["scale_zero"]
            self.refine.correct(held, name, quantizer, scale_zero, self.positions)

    def dequantize(self, key_quantizer: KVQuantizer, value_quantizer: KVQuantizer, dtype: torch.dtype):
        """Keys and values ``[batch, kv_heads, slots, head_dim]`` in ``dtype`` (empty slots hold garbage: mask
        them with ``positions >= 0``). A 16-bit store returns its own buffers (no copy)."""
        if isinstance(key_quantizer, CalibratedKeyQuantizer):
            keys = torch.empty(*self.positions.shape, key_quantizer.head_dim, dtype=dtype, device=self.positions.device)
            key_quantizer.dequantize_at(self.keys, keys, self.positions)
        else:
            keys = key_quantizer.dequantize(self.keys, dtype)
        return keys, value_quantizer.dequantize(self.values, dtype)

    def map_batch(self, fn) -> None:
        """Replace every buffer by ``fn`` of it (a function of one tensor acting on the batch dim 0: beam search
        and batch selection re-build the buffers)."""
        self.keys, self.values = self.keys.map_batch(fn), self.values.map_batch(fn)
        self.positions = fn(self.positions)
        if self.scores is not None:
            self.scores = fn(self.scores)
        if self.norms is not None:
            self.norms = fn(self.norms)
        if self.refine is not None:
            self.refine.map_batch(fn)

    def resize(self, slots: int) -> None:
        """Grow to ``slots`` slots, keeping every held token where it is (unbounded caches without a known
        length; never in a compiled step)."""
        extra = slots - self.slots

        def grow(t: torch.Tensor, fill) -> torch.Tensor:
            pad = t.new_full((*t.shape[:2], extra, *t.shape[3:]), fill)
            return torch.cat((t, pad), dim=2)

        self.keys = StoredTensor({k: grow(v, 0) for k, v in self.keys.parts.items()})
        self.values = StoredTensor({k: grow(v, 0) for k, v in self.values.parts.items()})
        self.positions = grow(self.positions, -1)
        if self.scores is not None:
            self.scores = grow(self.scores, 0)
        if self.norms is not None:
            self.norms = grow(self.norms, 0)
