"""`CompressedLayer`: the compressed KV cache of one attention layer, as fixed buffers a compiled step can replay.

Per sequence and KV head the layer holds (DESIGN.md §2 and §5):

    SlotStore   [batch, kv_heads, slots, ...]  kept tokens in stored form (quantized once), positions (-1 = empty),
                                               accumulated attention
    RingWindow  [batch, kv_heads, residual, head_dim]  the newest ``residual`` tokens in full precision

A decode step (one new token) is static-shape code with no host sync and no allocation of cache storage: the new
token goes into the ring, the token it replaces is quantized once and written into the first empty slot of the
store, attention reads the store (dequantized) and the ring with a validity mask, the probabilities are added to
the scores, and the lowest-priority token outside the sinks and the recent window is marked empty (masked argmin
+ scatter), all in place. ``torch.compile(fullgraph=True)`` captures it. Attention runs one of three ways: the CPU
kernel (:func:`h2o_compress.attention.cpu.decode_layer`, the whole step in one call), the Triton op on CUDA
(:func:`h2o_compress.attention.slot_attention.decode_layer`, attention and scores in two launches) or torch code
(:mod:`.decode`, the torch form of the step). Multi-token steps (prefill, chunked prefill, continuing a saved
prompt) run eagerly over the same buffers (:mod:`.chunk`): attention over the held tokens and the chunk, then the
policy's top-``capacity`` selection, then the same layout.

Slot counts: ``capacity - residual + 1`` (one slot is free before each step), ``max_tokens - residual`` for an
unbounded cache of known length; an unbounded cache of unknown length grows (eager only).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin

from ..attention import announce, withdraw
from ..attention import cpu as cpu_kernel
from ..attention.choice import decode_kernel
from ..attention.launch import mark_static_address
from ..attention.variant import AttentionVariant
from ..errors import CacheStateError, InputError, UnsupportedModelError
from ..formats import BitsAndBytesQuantizer, KVQuantizer
from ..memory import available_memory
from ..policies import EvictionPolicy
from ..policies.base import NO_POSITION as NO_REAL_TOKEN
from . import chunk, decode
from .ring import RingWindow
from .slots import SlotStore
from .span import LayerSpan

FULL_SPAN = LayerSpan()

GROWTH = 256  # slots added at a time to an unbounded cache of unknown length


def _rotate(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``x @ basis`` in fp32: ``x`` ``[batch, kv_heads, tokens, head_dim]``, ``basis`` fp32 ``[head_dim, head_dim]``."""
    return x.float() @ basis


def _rotate_token(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """:func:`_rotate` of one token per (sequence, KV head) as a product and a sum over ``head_dim`` (fp32; equal to
    the matmul to float reassociation): Inductor fuses it into the step's kernel that writes the ring instead of
    launching a ``[batch * kv_heads, head_dim] @ [head_dim, head_dim]`` matmul of its own (issue 14: kernels per
    layer). Compiled fused (Triton) decode steps only: eagerly it would materialize ``[batch, kv_heads, 1, head_dim,
    head_dim]`` fp32, so eager steps, the torch path and the native CPU path keep the matmul."""
    return (x.float().unsqueeze(-1) * basis).sum(-2)


def _pad_values(values: torch.Tensor, head_dim: int, layer_idx: int) -> torch.Tensor:
    """Values ``[batch, kv_heads, tokens, value_dim]`` zero-padded to the keys' ``head_dim`` (multi-head latent
    attention, DeepSeek-V2 arXiv 2405.04434 §2.1, as transformers computes it: keys and values of different head
    dims; zeros add nothing to the attention output, whose padding is dropped).

    Raises:
        UnsupportedModelError: values wider than keys.
    """
    if values.shape[-1] > head_dim:
        raise UnsupportedModelError(
            f"layer {layer_idx}: values of head dim {values.shape[-1]} wider than the keys' {head_dim}; h2o-compress "
            "holds values of at most the keys' head dim"
        )
    return torch.nn.functional.pad(values, (0, head_dim - values.shape[-1]))


class CompressedLayer(CacheLayerMixin):
    """The compressed KV cache of one attention layer (see the module docstring for the layout).

    Args:
        layer_idx: index of the model layer (the side-channel key).
        policy: eviction policy (its :meth:`~h2o_compress.policies.EvictionPolicy.priority` ranks every eviction).
        capacity: tokens kept per sequence and KV head, ``None`` for no eviction; capped at ``max_tokens``.
        key_quantizer, value_quantizer: storage formats of keys and values.
        residual: newest tokens kept in full precision when quantizing (the ring size), capped at half the
            policy's recent window so the ring is always inside it.
        score_chunk_size: queries per chunk for prefill scoring.
        attention_kernel: ``auto``, ``torch`` or ``triton`` (see :class:`~h2o_compress.CompressionConfig`): the
            decode step's attention is the CPU kernel (``auto`` on CPU), the Triton op (``auto`` on CUDA, or
            ``triton``) or torch code that ``torch.compile`` fuses (``torch``).
        max_tokens: tokens the cache will see (prompt + new tokens), when known: bounds the storage.
        span: the layer type (:class:`~.span.LayerSpan`: full, sliding or chunked attention); a sliding or chunked
            layer never holds a token its next query cannot see, so at most ``span.size - 1`` tokens.

    Attributes:
        is_compileable: the decode step can be compiled (integer and 16-bit formats, storage of known size).
        seen: int64 0-dim tensor, tokens seen (positions keep counting after eviction).
    """

    is_croppable = False
    is_sliding = False

    def __init__(
        self,
        layer_idx: int,
        policy: EvictionPolicy,
        capacity: int | None,
        key_quantizer: KVQuantizer,
        value_quantizer: KVQuantizer,
        residual: int = 0,
        score_chunk_size: int = 64,
        attention_kernel: str = "auto",
        max_tokens: int | None = None,
        span: LayerSpan = FULL_SPAN,
    ):
        super().__init__()
        if capacity is not None and max_tokens is not None:
            capacity = min(capacity, max_tokens)  # storage never exceeds what the cache can see
        # the policy ranks only where its capacity is below what the span holds anyway (sliding: window - 1)
        capacity, self.span = span.cap(capacity), span
        if capacity is not None and max_tokens is not None:
            capacity = min(capacity, max_tokens)
        self.evicts = capacity is not None and capacity != span.cap(None)
        self.layer_idx, self.policy, self.capacity, self.max_tokens = layer_idx, policy, capacity, max_tokens
        self.num_layers = 1  # set by build_layers: the memory check counts every layer
        self.key_quantizer, self.value_quantizer = key_quantizer, value_quantizer
        self.quantized = key_quantizer.bits < 16 or value_quantizer.bits < 16
        if not self.quantized:
            residual = 0
        elif capacity is not None:
            residual = min(residual, policy.recent_window(capacity) // 2)
        self.residual = residual
        self.with_scores = policy.needs_scores and self.evicts
        self.score_chunk_size = score_chunk_size
        self.attention_kernel = attention_kernel
        self.growable = capacity is None and max_tokens is None  # unbounded, length unknown: grows (eager only)
        self.compile_blocker = self._compile_blocker()
        self.is_compileable = self.compile_blocker is None
        self.reset()

    def _compile_blocker(self) -> str | None:
        """Why the decode step cannot be compiled, or ``None``."""
        if any(isinstance(q, BitsAndBytesQuantizer) for q in (self.key_quantizer, self.value_quantizer)):
            return "the bitsandbytes formats (nf4, fp4, int8-blockwise) run eagerly only; use quant='int' to compile"
        if self.growable:
            return "an unbounded cache without max_length grows as it goes; pass max_length to make_cache to compile"
        return None

    # -- state ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every token, score and buffer; the layer can start a new prompt (any batch size)."""
        self.store: SlotStore | None = None
        self.ring: RingWindow | None = None
        self.seen: torch.Tensor | None = None
        self.first_real: torch.Tensor | None = None  # int64 [batch]: position of each sequence's first real token
        self.finite: torch.Tensor | None = None  # bool 0-dim: every key/value so far was finite (read once per run)
        self.consistent: torch.Tensor | None = None  # bool 0-dim: this layer saw every step layer 0 saw
        self.grown_to = 0  # host count of tokens seen, kept only by unbounded caches of unknown length
        self.chunk: dict | None = None  # a multi-token step between update() and attend()
        self.decode_valid: torch.Tensor | None = None
        self.native = False  # decode steps run the CPU kernel (attention/cpu.py), set at the first token
        self.fused = False  # decode steps run the Triton op (attention/slot_attention.py), set at the first token
        self.scratch = None  # the Triton op's DecodeScratch (workspace, not cache state: not in tensors())
        self.leaving = None  # fused decode: the token entering the store (full precision) and its slot
        self.reference_seen: torch.Tensor | None = None  # layer 0's count, set by the container (native flag check)
        self.incoming: tuple[torch.Tensor, torch.Tensor] | None = None  # the native step's new key and value
        self.awaiting_attention = False
        self.bound_module = None  # weakref to the attention module that used this layer first
        self.is_initialized = False

    def store_slots(self, first_chunk: int = 0) -> int:
        """Slots of the store: ``capacity - residual + 1`` (one is free before each step); ``max_tokens -
        residual`` unbounded (nothing is evicted); else the
        first chunk plus :data:`GROWTH` (grows later)."""
        if self.capacity is not None:
            return self.capacity - self.residual + 1
        if self.max_tokens is not None:
            return max(self.max_tokens - self.residual, 1)
        return first_chunk + GROWTH

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate every buffer once, from the first keys ``[batch, kv_heads, tokens, head_dim]`` (their batch,
        heads, head_dim, dtype and device; ``device='meta'`` sizes a cache without memory)."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.kv_heads, first, self.head_dim = key_states.shape
        # The window of a quantized cache is 16-bit even for fp32 models: its bytes count (DESIGN.md §2).
        self.residual_dtype = torch.float16 if self.quantized and self.dtype == torch.float32 else self.dtype
        # Tokens are held in each quantizer's basis (Hadamard or none); attention folds it into q and the output.
        self.key_basis = self.key_quantizer.rotation(self.device)
        self.value_basis = self.value_quantizer.rotation(self.device)
        shape = (self.batch, self.kv_heads, self.store_slots(first), self.head_dim)
        if self.device.type != "meta":
            self._check_fits(key_states, value_states)
        self.store = self._new_store(shape)
        if self.residual:
            shape = (self.batch, self.kv_heads, self.residual, self.head_dim)
            self.ring = RingWindow(shape, self.residual_dtype, self.device, self.with_scores)
        self.seen = torch.zeros((), dtype=torch.int64, device=self.device)
        self.first_real = torch.full((self.batch,), NO_REAL_TOKEN, dtype=torch.int64, device=self.device)
        self.finite = torch.ones((), dtype=torch.bool, device=self.device)
        self.consistent = torch.ones((), dtype=torch.bool, device=self.device)
        kernel = decode_kernel(self.attention_kernel, self.device, self.dtype, self.residual_dtype, self.head_dim,
                               (self.key_quantizer, self.value_quantizer), self.layer_idx)
        self.native, self.fused = kernel == "cpu", kernel == "triton"
        if self.device.type != "meta":
            mark_static_address(self.tensors())
        self.is_initialized = True

    @property
    def decode_kernel(self) -> str | None:
        """The kernel this layer's decode steps run: ``"cpu"`` (:mod:`~h2o_compress.attention.cpu`), ``"triton"``
        (:mod:`~h2o_compress.attention.slot_attention`) or ``"torch"`` (the torch form); ``None`` before the first
        token, when it is chosen (:func:`~h2o_compress.attention.choice.decode_kernel`)."""
        if not self.is_initialized:
            return None
        return "cpu" if self.native else "triton" if self.fused else "torch"

    def _new_store(self, shape: tuple[int, int, int, int]) -> SlotStore:
        """The store for ``shape`` ``(batch, kv_heads, slots, head_dim)`` (a hook: head-adaptive layers pool it)."""
        return SlotStore(
            self.key_quantizer, self.value_quantizer, shape, self.residual_dtype, self.device, self.with_scores
        )

    def _held_store(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The store's keys and values per KV head, ``[batch, kv_heads, slots, head_dim]`` in the model dtype."""
        keys, values = self.store.dequantize(self.key_quantizer, self.value_quantizer, self.dtype)
        if self.quantized:
            self._refine_read("keys", keys)
            self._refine_read("values", values)
        return keys, values

    def _check_fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse, before allocating, buffers that the device cannot hold: this layer's bytes (sized on the
        ``meta`` device) times ``num_layers`` against the free memory (CUDA: ``mem_get_info``; CPU: available RAM).

        Raises:
            InputError: naming both sizes.
        """
        probe = self._like(self.capacity, self.max_tokens)
        probe.lazy_initialization(key_states.to("meta"), value_states.to("meta"))
        needed = probe.nbytes() * self.num_layers
        free = available_memory(self.device)
        if free is not None and needed > free:
            raise InputError(
                f"the cache needs {needed / 2**30:.2f} GiB ({self.num_layers} layers of {probe.store.slots} slots, "
                f"batch {self.batch}) but {self.device} has {free / 2**30:.2f} GiB free; allowed: a smaller budget, "
                "max_length or batch"
            )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer held, by name: ``store.*``, ``ring.*``, ``seen``, ``first_real``, ``finite``,
        ``consistent``."""
        if not self.is_initialized:
            return {}
        held = {f"store.{k}": v for k, v in self.store.tensors().items()}
        if self.ring is not None:
            held |= {f"ring.{k}": v for k, v in self.ring.tensors().items()}
        return held | {
            "seen": self.seen, "first_real": self.first_real, "finite": self.finite, "consistent": self.consistent,
        }

    def _own_args(self) -> dict:
        """A subclass's own constructor arguments (a probe or a frozen copy is built like this layer)."""
        return {}

    def _like(self, capacity: int | None, max_tokens: int | None) -> "CompressedLayer":
        """A new, empty layer of this type built with this one's arguments but ``capacity`` and ``max_tokens``."""
        layer = type(self)(
            self.layer_idx, self.policy, capacity, self.key_quantizer, self.value_quantizer, self.residual,
            self.score_chunk_size, self.attention_kernel, max_tokens=max_tokens, span=self.span, **self._own_args(),
        )
        layer.num_layers = self.num_layers
        return layer

    def nbytes(self) -> int:
        """Bytes of every buffer held (:meth:`tensors`), empty slots included: the cache's real footprint."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def kept_length(self) -> int:
        """Tokens held now, per sequence and KV head (the largest over sequences and heads). Reads the device."""
        if not self.is_initialized:
            return 0
        return int(self.kept_per_head().max())

    def kept_per_head(self) -> torch.Tensor:
        """int64 ``[batch, kv_heads]``: tokens held now by each sequence and KV head."""
        held = (self.store.head_positions() >= 0).sum(-1)
        if self.ring is not None:
            held = held + (self.ring.positions >= 0).sum(-1, keepdim=True)
        return held

    def positions(self) -> torch.Tensor:
        """int64 ``[batch, kv_heads, kept]``: positions of the held tokens, ascending (sequences with fewer held
        tokens, e.g. padded ones or the heads of a head-adaptive layer that keep fewer, are filled with ``-1`` at
        the front)."""
        held = self.store.head_positions().long()
        if self.ring is not None:
            held = torch.cat((held, self.ring.positions.long()[:, None].expand(-1, self.kv_heads, -1)), dim=2)
        return held.sort(-1).values[..., -self.kept_length() :] if self.kept_length() else held[..., :0]

    def frozen_copy(self, extra_tokens: int) -> "CompressedLayer":
        """A new layer holding this one's tokens (same slots, ring, positions, counters; copied, not shared) that
        evicts nothing more, with storage for ``extra_tokens`` more tokens, no more (compress-then-ask: the
        question and the answer are added to a compressed context, which stays as it is).

        Raises:
            CacheStateError: this layer holds nothing, or ``extra_tokens`` is negative.
        """
        if not self.is_initialized or extra_tokens < 0:
            raise CacheStateError(
                f"layer {self.layer_idx}: a frozen copy needs an initialised layer and extra_tokens >= 0"
            )
        # an unbounded layer of known size: slots = max_tokens - residual (per head)
        copy = self._like(None, self.store.slots_per_head + self.residual + extra_tokens)
        empty = torch.empty(self.batch, self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        copy.lazy_initialization(empty, empty)
        mine = self.tensors()
        for name, target in copy.tensors().items():  # scores are not copied: nothing is evicted any more
            if name in mine:  # the store's first `slots` slots; the rest stay empty (position -1)
                source = mine[name]
                (target if target.shape == source.shape else target.narrow(2, 0, source.shape[2])).copy_(source)
        return copy

    # -- transformers' layer API -----------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take ``[batch, kv_heads, new, head_dim]`` keys/values; return the keys and values attention reads (in
        ``key_basis``/``value_basis``; the ``h2o_compress`` attention function undoes them).

        One token: the compiled decode step (store + ring slots, with a validity mask). More: a chunk (eager).

        Raises:
            CacheStateError: the previous step's attention did not run through ``h2o_compress`` attention,
                or the batch / head shape changed.
            InputError: non-finite keys or values in a multi-token step (decode steps set a flag read once per
                generation: :meth:`~h2o_compress.cache.container.CompressedCache.check`).
        """
        self._check_step(key_states)
        if value_states.shape[-1] != key_states.shape[-1]:  # MLA: values are held padded to the keys' head dim
            keys, values = self.update(key_states, _pad_values(value_states, key_states.shape[-1], self.layer_idx))
            return keys, values[..., : value_states.shape[-1]]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] == 1 and self.native:
            self._grow_for_token()
            # the whole step (finite flag, bases, ring, store, attention, scores) is one kernel call in attend()
            self.incoming = (key_states, value_states)
            self.awaiting_attention = True
            announce(self.layer_idx, self)
            return key_states, value_states
        finite = torch.isfinite(torch.sum(key_states, dtype=torch.float32) + torch.sum(value_states, dtype=torch.float32))
        self.finite &= finite
        # compiled fused one-token steps: a rotation Inductor fuses (eager keeps the matmul: no [.., D, D] temporary)
        rotate = _rotate_token if self.fused and key_states.shape[2] == 1 and torch.compiler.is_compiling() else _rotate
        if self.key_basis is not None:
            key_states = rotate(key_states, self.key_basis)
        if self.value_basis is not None:
            value_states = rotate(value_states, self.value_basis)
        key_states, value_states = key_states.to(self.residual_dtype), value_states.to(self.residual_dtype)
        self.awaiting_attention = True
        announce(self.layer_idx, self)
        if key_states.shape[2] == 1:
            return self._decode_update(key_states, value_states)
        if not bool(finite):
            self.awaiting_attention = False
            withdraw(self.layer_idx)
            raise InputError(
                f"layer {self.layer_idx}: keys or values are not finite (NaN or Inf); check the inputs and the model "
                "weights: a non-finite token would poison every later step"
            )
        return chunk.update(self, key_states, value_states)

    def _check_step(self, key_states: torch.Tensor) -> None:
        """Refuse a step that does not continue this layer's run (the errors of :meth:`update`)."""
        if self.awaiting_attention:
            self.awaiting_attention = False
            withdraw(self.layer_idx)
            raise CacheStateError(
                f"layer {self.layer_idx}: attention of the previous step did not go through the 'h2o_compress' "
                "attention function (or the cache is used by another model than the one it was made for); build "
                "the cache with h2o_compress.make_cache(model, ...), which switches that model to it"
            )
        if not self.is_initialized:
            return
        if key_states.shape[0] != self.batch or key_states.shape[1] != self.kv_heads or key_states.shape[3] != self.head_dim:
            raise CacheStateError(
                f"layer {self.layer_idx}: cache holds batch={self.batch}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim} but got batch={key_states.shape[0]}, kv_heads={key_states.shape[1]}, "
                f"head_dim={key_states.shape[3]}; use a new cache (or cache.reset())"
            )
        elif key_states.dtype != self.dtype or key_states.device != self.device:
            raise CacheStateError(
                f"layer {self.layer_idx}: cache holds {self.dtype} keys on {self.device} but got {key_states.dtype} on "
                f"{key_states.device} (model.half() or .to() after the prefill?); use a new cache (or cache.reset())"
            )

    def _decode_update(self, keys: torch.Tensor, values: torch.Tensor):
        """One token in, what attention reads out (the torch form: :func:`.decode.update`; a hook: head-adaptive
        layers write their pool)."""
        return decode.update(self, keys, values)

    def _quantize_incoming(self, keys: torch.Tensor, values: torch.Tensor):
        """The stored forms of tokens entering the store ``[batch, kv_heads, n, head_dim]`` (a hook: the
        mixed-precision layer also keeps their low planes)."""
        return self.key_quantizer.quantize(keys), self.value_quantizer.quantize(values)

    def _after_insert(self, slot: torch.Tensor) -> None:
        """A hook after a decode step wrote the tokens leaving the window into the store (int64 ``slot``
        ``[batch, store rows, k]``: where they went, one per KV head). Nothing here."""

    def _refine_read(self, name: str, held: torch.Tensor) -> None:
        """A hook on the store's ``keys`` or ``values`` (``name``) just dequantized for attention, ``[batch, store
        rows, slots, head_dim]`` (a fresh tensor), before anything else is written into it. Nothing here (the
        mixed-precision layer adds its 8-bit tokens' low planes)."""

    def _grow_for_token(self) -> None:
        """Make room for one more token in an unbounded cache of unknown length (a host counter; eager only)."""
        if self.growable:
            self.grown_to += 1
            if self.grown_to - self.residual >= self.store.slots:
                self.store.resize(self.store.slots + GROWTH)

    # -- attention and what follows it -----------------------------------------------------------------
    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs) -> torch.Tensor:
        """This step's attention (called by the ``h2o_compress`` attention function with what :meth:`update`
        returned), then score accumulation and eviction. Returns ``[batch, queries, q_heads, head_dim]``.

        Raises:
            CacheStateError: the cache was filled through another model.
        """
        self.awaiting_attention = False
        if self.bound_module is None:
            self.bound_module = weakref.ref(module)
        elif self.bound_module() is not module:
            raise CacheStateError(
                f"layer {self.layer_idx}: this cache was filled by another model; a cache holds one model's keys "
                "and values, so build a new one with make_cache(model, ...)"
            )
        variant = AttentionVariant.from_call(kwargs)
        if variant is not None and (self.native or self.fused):
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: this model's attention has a soft-cap or sink logits, which the "
                f"{self.decode_kernel} decode kernel does not run; build the cache with h2o_compress.make_cache(model, "
                "...), which picks the torch form for such layers"
            )
        decay = self.policy.score_decay
        if self.with_scores and 0.0 < decay < 1.0 and query.shape[2] == 1 and self.chunk is None:
            decode.forget(self, decay)  # A2SF: the held scores fade before this query's attention adds to them
        if self.incoming is not None:  # the native CPU step in one call (a policy with its own ranking evicts here)
            (keys, values), self.incoming = self.incoming, None
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            output = cpu_kernel.decode_layer(self, query, keys, values, scale, self.reference_seen)
            if not cpu_kernel.evicts(self):
                self._evict()
            return output
        fused = query.shape[2] == 1 and self.chunk is None and self.leaving is not None
        if self.key_basis is not None and not fused:  # keys are held as k @ H: q.k = (q @ H).(k @ H), H orthonormal
            query = (query.float() @ self.key_basis).to(query.dtype)
        if fused:  # the op applies both bases in its own launches
            from ..attention import slot_attention

            output = slot_attention.decode_layer(self, query, scaling)
            self._evict()
        elif query.shape[2] == 1 and self.chunk is None:
            output = decode.attend(self, query, key, value, scaling, variant)
        else:
            output = chunk.attend(self, module, query, key, value, attention_mask, scaling, variant, **kwargs)
        output = output.transpose(1, 2)
        if self.value_basis is not None and not fused:  # values are held as v @ H: P.v = (P.(v @ H)) @ H
            output = (output.float() @ self.value_basis).to(query.dtype)
        return output.contiguous()

    def _evict(self) -> None:
        """Evict the lowest-priority stored token where a sequence holds more than the capacity (the store's
        :meth:`~.slots.SlotStore.evict_over`, on the policy's priority; in place, no host sync), after the tokens the
        next query cannot see left a sliding or chunked layer (:meth:`~.span.LayerSpan.expire`)."""
        if self.span.windowed:
            self.span.expire(self.store.positions, self.seen, self.first_real)
            if self.ring is not None:
                self.span.expire(self.ring.positions, self.seen, self.first_real)
        if not self.evicts:
            return
        priority = self.policy.priority(self.store.scores, self.store.positions, self.seen, self.first_real,
                                        self.capacity)
        ring_held = 0 if self.ring is None else (self.ring.positions >= 0).sum(-1, keepdim=True)
        self.store.evict_over(priority, ring_held, self.capacity)

    def _store_incoming(self, incoming, keys, values, positions, scores):
        """Quantize the kept tokens leaving the ring or the chunk (bool ``incoming`` ``[batch, kv_heads, n]``) and
        write them into empty slots, lowest first (eager: prefill). Returns where they went, ``(b, h, slot, i)``
        (1-D int64: token ``i`` of sequence ``b``, head ``h`` in ``slot``), or ``None`` when nothing entered."""
        if not bool(incoming.any()):
            return None
        if bool((incoming.sum(-1) > (self.store.positions < 0).sum(-1)).any()):
            if not self.growable:
                raise CacheStateError(
                    f"layer {self.layer_idx}: more tokens than the cache was built for (max_length="
                    f"{self.max_tokens}); build the cache with the full length (prompt + new tokens)"
                )
            self.store.resize(self.store.slots + int(incoming.sum(-1).max()) + GROWTH)
        stored_keys, stored_values = self._quantize_incoming(keys, values)
        return self.store.place(incoming, stored_keys, stored_values, positions, scores)

    # -- transformers' sizes -----------------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(query_length, offset)``: transformers builds the causal + padding mask of the new tokens only (the
        held tokens' visibility comes from the slots). A decode step ignores that mask, so it gets the constant
        ``(1, 0)`` (compiled steps must not branch on the token count); a chunk gets its real offset (eager)."""
        if query_length == 1 or not self.is_initialized:
            return query_length, 0
        return query_length, int(self.seen)

    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens seen (not kept), as an int64 0-dim tensor (no host sync), so position ids keep counting after
        eviction (DESIGN.md §2, Positions); ``0`` before the first token."""
        return self.seen if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1

    # -- batch operations ------------------------------------------------------------------------------
    def load_tensors(self, state: dict[str, torch.Tensor]) -> None:
        """Copy saved buffers (names of :meth:`tensors`, same shapes) into this initialised layer, in place."""
        held = self.tensors()
        for name, tensor in state.items():
            held[name].copy_(tensor)

    def _map_batch(self, fn, in_place: bool) -> None:
        """Apply ``fn`` (acting on dim 0) to every batch-major buffer: in place when the batch keeps its size
        (beam reordering keeps the static addresses), else by re-building the containers' buffers."""
        if not self.is_initialized:
            return
        if in_place:
            for name, tensor in self.tensors().items():
                if name not in ("seen", "finite", "consistent"):  # 0-dim counters and flags: no batch dim
                    tensor.copy_(fn(tensor))
            return
        self.store.map_batch(fn)
        if self.ring is not None:
            self.ring.map_batch(fn)
        self.first_real = fn(self.first_real)
        self.batch = self.first_real.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder sequences for beam search (tokens, scales, positions and scores move together): in place when
        the batch keeps its size (static addresses kept), else into new buffers."""
        same_size = beam_idx.shape[0] == getattr(self, "batch", None)
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)), in_place=same_size)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0), in_place=False)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices], in_place=False)

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheStateError("a compressed cache cannot be cropped: evicted tokens cannot be restored")

    def offload(self):  # buffers live in custom containers at static addresses; keep them where they are
        return None

    def prefetch(self):
        return None
