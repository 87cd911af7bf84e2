"""`CompressedLayer`: the compressed KV cache of one attention layer, built from parts (DESIGN.md §2 and §5).

    setting  LayerSetting  capacity, formats, ring size, span, layout: fixed when built (`h2o_compress.cache.setting`)
    store    SlotStore     kept tokens in stored form in fixed slots, per KV head, or SlotPool shared by the heads
                           (Ada-KV); optional low planes of the top-ranked tokens (mixed precision, `h2o_compress.cache.refinement`)
    ring     RingWindow    the newest ``residual`` tokens in full precision (KIVI's residual), or ``None``
    span     LayerSpan     which tokens a query sees: full, sliding window or chunk (`h2o_compress.cache.span`)
    backend  TorchDecode | CpuDecode | TritonDecode   the code of a one-token step (`h2o_compress.cache.backends`)

The parts are made at the first token (their shapes come from it). A one-token step is the backend's (the torch
form, `h2o_compress.cache.decode`, reads top to bottom): ``update`` writes the token and announces a `DecodeCall`, which
the attention function runs in ``attention/`` without calling back; a multi-token step is `h2o_compress.cache.chunk`'s,
whose attention comes back to [`attend`][h2o_compress.cache.CompressedLayer.attend] and evicts there. The eviction a
decode kernel leaves ([`evict`][h2o_compress.cache.CompressedLayer.evict]) runs at the start of the layer's next
step, before its token is written, or when something reads the layer between steps
([`run_deferred_eviction`][h2o_compress.cache.CompressedLayer.run_deferred_eviction]): the same information as at the end of the step before.
Batch moves and rows copied between caches: `h2o_compress.cache.rows`; sizes before allocating: `h2o_compress.cache.store`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from h2o_compress.attention import announce, withdraw
from h2o_compress.attention.decode_step import ModuleLink
from h2o_compress.attention.launch import mark_static_address
from h2o_compress.attention.variant import AttentionVariant
from h2o_compress.utils.checks import check_count
from h2o_compress.utils.errors import CacheStateError, ConfigError, short
from h2o_compress.cache import backends, chunk, decode, rows
from h2o_compress.cache.ring import RingWindow, held_positions
from h2o_compress.cache.setting import LayerSetting
from h2o_compress.cache.slots import SlotStore
from h2o_compress.cache.span import FULL_SPAN, LayerSpan
from h2o_compress.cache.store import held_tensors, make_parts, refuse_oversized
from h2o_compress.cache.state import Counters, Geometry, pad_values


#: The keyword arguments of a layer's store layout (the rest of `LayerSetting`'s fields are named arguments).
LAYOUT = {"head_adaptive", "high_bits_fraction", "refined_per_head", "value_dim"}


class CompressedLayer(CacheLayerMixin):
    """The compressed KV cache of model layer ``layer_idx`` (the side-channel key), made of the parts of the module
    docstring; the other arguments are its [`LayerSetting`][h2o_compress.cache.LayerSetting]'s (ConfigError: one it cannot run)."""

    is_croppable = is_sliding = False  # sliding layers forget by their span, not by transformers' sliding mask

    def __init__(self, layer_idx: int, policy, capacity: int | None, key_quantizer, value_quantizer, residual: int = 0,
                 score_chunk_size: int = 64, attention_kernel: str = "auto", max_tokens: int | None = None,
                 span: LayerSpan = FULL_SPAN, **layout):
        super().__init__()
        check_count("layer_idx", layer_idx, minimum=0, maximum=None, allowed="an integer >= 0 (the model layer)")
        unknown = sorted(set(layout) - LAYOUT)
        if unknown:
            raise ConfigError(f"unknown layer argument {', '.join(map(short, unknown))}; allowed: {', '.join(sorted(LAYOUT))}")
        self.layer_idx, self.num_layers = layer_idx, 1  # num_layers: set by build_layers (the memory check)
        self.setting = LayerSetting(policy, capacity, key_quantizer, value_quantizer, residual, score_chunk_size,
                                    attention_kernel, max_tokens, span, **layout)
        self.reset()

    @property
    def is_compileable(self) -> bool:
        """``setting.is_compileable`` (transformers' ``Cache.is_compileable`` reads it of every layer). Reports,
        persistence and tests read the parts (``setting``, ``geometry``, ``counters``, ``store``, ``ring``, ``backend``)."""
        return self.setting.is_compileable

    def reset(self) -> None:
        """Drop every token, score and buffer; the layer can start a new prompt (any batch size)."""
        self.store: SlotStore | None = None
        self.ring: RingWindow | None = None
        self.geometry: Geometry | None = None
        self.counters: Counters | None = None
        self.backend = None  # the decode backend, chosen at the first token
        self.chunk: dict | None = None  # a multi-token step between update() and attend()
        if getattr(self, "link", None) is None:  # one object for the layer's life (a compiled step holds it)
            self.link = ModuleLink(self.layer_idx)
        self.link.module, self.link.awaiting = None, False  # the module that used the layer first; awaiting attention
        self.eviction_deferred = False  # a decode step left its eviction to the next step (`run_deferred_eviction`)
        self.is_initialized = False

    def run_deferred_eviction(self) -> None:
        """Run the eviction the last decode step left to the next one
        ([`evict`][h2o_compress.cache.CompressedLayer.evict], idempotent), so that what is read of the layer between steps (its tokens, positions, buffers) is the
        state after that eviction. Every reader of the layer's parts calls it first (in or out of the inference mode the step ran in)."""
        if self.eviction_deferred:
            self.eviction_deferred = False
            with torch.inference_mode() if self.store.positions.is_inference() else torch.no_grad():
                self.evict()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Make the parts once, from the first keys ``[batch, kv_heads, tokens, head_dim]`` (their batch, heads,
        head_dim, dtype and device; ``device='meta'`` sizes a cache without memory). Raises InputError: the parts,
        sized from the setting first (`h2o_compress.cache.store.refuse_oversized`), exceed the free memory."""
        self.geometry = geometry = Geometry.of(key_states, self.setting)
        if geometry.device.type != "meta":
            refuse_oversized(self.setting, geometry, key_states.shape[2], self.num_layers)
        self.store, self.ring, self.counters = make_parts(self.setting, geometry, key_states.shape[2])
        self.backend = backends.choose(self)
        self.is_initialized = True
        if geometry.device.type != "meta":
            mark_static_address(self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer held, by name: ``store.*``, ``ring.*``, ``refine.*`` and the counters'."""
        if not self.is_initialized:
            return {}
        self.run_deferred_eviction()
        return held_tensors(self.store, self.ring, self.counters)

    def nbytes(self) -> int:
        """Bytes of every buffer held ([`tensors`][h2o_compress.cache.CompressedLayer.tensors]), empty slots included: the cache's real footprint."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def kept_length(self) -> int:
        """Tokens held now, per sequence and KV head (the largest over sequences and heads). Reads the device."""
        return int(self.kept_per_head().max()) if self.is_initialized else 0

    def kept_per_head(self) -> torch.Tensor:
        """int64 ``[batch, kv_heads]``: tokens held now by each sequence and KV head."""
        self.run_deferred_eviction()
        return (held_positions(self.store, self.ring, self.geometry.kv_heads) >= 0).sum(-1)

    def positions(self) -> torch.Tensor:
        """int64 ``[batch, kv_heads, kept]``: positions of the held tokens, ascending (rows holding fewer, e.g.
        padded sequences or heads of a head-adaptive layer, are filled with ``-1`` at the front)."""
        self.run_deferred_eviction()
        held, kept = held_positions(self.store, self.ring, self.geometry.kv_heads), self.kept_length()
        return held.sort(-1).values[..., -kept:] if kept else held[..., :0]

    # -- a step: update (cache in, the hand-off), then the attention function (attention, scores, eviction) --
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take ``[batch, kv_heads, new, head_dim]`` keys and ``[batch, kv_heads, new, value_dim]`` values; return
        what attention reads (in the storage bases, which the ``h2o_compress`` attention function undoes; values of
        another width than the layer holds, MLA, are held zero-padded to it: the setting's ``value_dim``, else the
        keys' head dim). Raises CacheStateError (the previous step's attention did not run through
        ``h2o_compress``, or the shapes changed), InputError (non-finite keys/values in a multi-token step; decode
        steps set a flag read once per generation: [`check`][h2o_compress.cache.CompressedCache.check]) or
        UnsupportedModelError (values wider than the layer holds)."""
        width = self.setting.value_dim or key_states.shape[-1]
        if value_states.shape[-1] != width:
            held_at = "the keys'" if self.setting.value_dim is None else "the layer's value width"
            keys, values = self.update(key_states, pad_values(value_states, width, self.layer_idx, held_at))
            return keys, values[..., : value_states.shape[-1]]
        self._check_step(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] == 1:
            keys, values, step = self._decode_update(key_states, value_states)
        else:
            self.run_deferred_eviction()
            keys, values = chunk.begin(self, key_states, value_states)
            step = self
        self.link.awaiting = True
        announce(self.layer_idx, step)
        return keys, values

    def _decode_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A one-token step's cache side: the eviction the previous step left (always, not on the `eviction_deferred` flag:
        idempotent, and a compiled step does not branch on a host flag), the token written by the backend, A2SF's
        fading of the scores; returns ``(keys, values, DecodeCall)``."""
        leaves = self.backend.leaves_eviction(self)
        if leaves:
            self.evict()
        keys, values, step = self.backend.update(self, key_states, value_states)
        decay = self.setting.policy.score_decay
        if self.setting.with_scores and 0.0 < decay < 1.0:
            decode.forget(self, decay)  # A2SF: held scores fade before this query adds to them
        self.eviction_deferred = leaves
        return keys, values, step

    def _check_step(self, key_states: torch.Tensor) -> None:
        """Refuse a step that does not continue this layer's run (the errors of [`update`][h2o_compress.cache.CompressedLayer.update])."""
        if self.link.awaiting:
            self.link.awaiting = False
            withdraw(self.layer_idx)
            raise CacheStateError(
                f"layer {self.layer_idx}: attention of the previous step did not go through the 'h2o_compress' "
                "attention function (or the cache is used by another model than the one it was made for); build "
                "the cache with h2o_compress.make_cache(model, ...), which switches that model to it"
            )
        if self.is_initialized:
            self.geometry.check(key_states, self.layer_idx)

    def attend(self, module, query, key, value, attention_mask, scaling, **kwargs) -> torch.Tensor:
        """This step's attention over what [`update`][h2o_compress.cache.CompressedLayer.update] returned:
        ``[batch, queries, q_heads, head_dim]``. A multi-token step (the ``h2o_compress`` attention function's
        call): attention, scores and the chunk's eviction (`h2o_compress.cache.chunk`). A one-token step (the
        attention function runs the announced `DecodeCall` itself; this is for a caller that holds the layer):
        runs that call. Raises CacheStateError (the cache was filled through another model, or no step is pending)
        or UnsupportedModelError (a soft-cap or sink logits the decode kernel cannot run)."""
        if self.chunk is None:
            step = withdraw(self.layer_idx)
            if step is None or step is self or step.link is not self.link:
                raise CacheStateError(f"layer {self.layer_idx}: no decode step of this layer awaits its attention")
            return step.run(module, query, key, value, scaling, kwargs)
        self.link.arrive(module)
        variant = AttentionVariant.from_call(kwargs, self.backend.name, self.layer_idx)
        query = self.geometry.into_key_basis(query)
        output = chunk.attend(self, module, query, key, value, attention_mask, scaling, variant, **kwargs)
        return self.geometry.from_value_basis(output.transpose(1, 2), query.dtype)

    def evict(self) -> None:
        """After a step: tokens the next query cannot see leave a sliding or chunked layer ([`expire`][h2o_compress.cache.LayerSpan.expire]), then where a sequence holds more than the capacity its lowest-priority stored token goes (the
        store's [`evict_over`][h2o_compress.cache.SlotStore.evict_over], on the policy's priority). In place, no host sync."""
        for positions in (self.store.positions, None if self.ring is None else self.ring.positions):
            if positions is not None:
                self.setting.span.expire(positions, self.counters.seen, self.counters.first_real)
        if not self.setting.evicts:
            return
        norms = self.store.value_norms() if self.setting.policy.weighs_values else None
        priority = self.setting.policy.priority(self.store.scores, self.store.positions, self.counters.seen,
                                                self.counters.first_real, self.setting.capacity, norms)
        ring_held = 0 if self.ring is None else (self.ring.positions >= 0).sum(-1, keepdim=True)
        self.store.evict_over(priority, ring_held, self.setting.capacity)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(query_length, offset)``: the mask of the new tokens only (the held ones' visibility is the slots'); ``(1,
        0)`` for a decode step, which ignores it (no branch on the count in a compiled step)."""
        if query_length == 1 or not self.is_initialized:
            return query_length, 0
        return query_length, int(self.counters.seen)

    def get_seq_length(self) -> torch.Tensor | int:
        """Tokens seen (not kept), int64 0-dim (no host sync): positions keep counting after eviction (DESIGN.md §2)."""
        return self.counters.seen if self.is_initialized else 0

    def get_max_length(self) -> int:  # noqa: D102 - no fixed length
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder sequences for beam search: in place when the batch keeps its size (static addresses), else anew."""
        same_size = self.is_initialized and beam_idx.shape[0] == self.geometry.batch
        rows.map_batch(self, lambda t: t.index_select(0, beam_idx.to(t.device)), in_place=same_size)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows.map_batch(self, lambda t: t.repeat_interleave(repeats, dim=0), in_place=False)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows.map_batch(self, lambda t: t[indices], in_place=False)

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheStateError("a compressed cache cannot be cropped: evicted tokens cannot be restored")

    def offload(self):  # buffers live in custom containers at static addresses; keep them where they are
        return None
    prefetch = offload

