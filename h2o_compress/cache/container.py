"""`CompressedCache`: a thin transformers ``Cache`` over one [`CompressedLayer`][h2o_compress.cache.CompressedLayer] per model layer."""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from h2o_compress.config import CompressionConfig
from h2o_compress.utils.checks import is_integer
from h2o_compress.utils.errors import CacheStateError, ConfigError, InputError, short
from h2o_compress.formats import make_quantizer
from h2o_compress.cache import rows
from h2o_compress.cache.hybrid import CompressedStateLayer, StateLayer, state_tensors, take_state_rows
from h2o_compress.cache.layer import CompressedLayer
from h2o_compress.cache.refinement import spread_refined_rows
from h2o_compress.cache.setting import LayerSetting
from h2o_compress.cache.span import FULL_SPAN, LayerSpan


def _check_parts(layers, config, model_id, capacity) -> None:
    """The arguments of a hand-built [`CompressedCache`][h2o_compress.cache.CompressedCache]: a non-empty list of layers, a config, a text id and a
    capacity (-1: the first layer's), each refused with a ConfigError naming it."""
    if not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(x, (CompressedLayer, LinearAttentionCacheLayerMixin)) for x in layers):
        raise ConfigError(f"layers={short(layers)} is invalid; allowed: a non-empty list of CompressedLayer (and "
                          "transformers' LinearAttentionLayer for a hybrid's state layers; build a cache with "
                          "h2o_compress.make_cache)")
    if not isinstance(config, CompressionConfig):
        raise ConfigError(f"config={short(config)} is invalid; allowed: a CompressionConfig")
    if not isinstance(model_id, str):
        raise ConfigError(f"model_id={short(model_id)} is invalid; allowed: a text")
    if capacity is not None and not (is_integer(capacity) and (capacity == -1 or capacity >= 1)):
        raise ConfigError(f"capacity={short(capacity)} is invalid; allowed: an integer >= 1, None (unbounded) or -1 "
                          "(the first layer's)")


class CompressedCache(Cache):
    """A transformers ``Cache`` that evicts and quantizes, one [`CompressedLayer`][h2o_compress.cache.CompressedLayer] per model layer.

    Use with ``model.generate(..., past_key_values=cache)``, a manual forward loop, or a compiled decode step
    ([`is_compileable`][h2o_compress.cache.LayerSetting.is_compileable]); build it with [`h2o_compress.make_cache`][h2o_compress.make_cache], which also switches the model to the
    ``h2o_compress`` attention function. ``get_seq_length()`` counts tokens seen, a Python int as transformers'
    ``DynamicCache`` gives it (it reads the device); [`seen_length`][h2o_compress.cache.CompressedCache.seen_length]
    is the same count as an int64 0-dim tensor (no host sync: what the mask of a compiled step reads, through
    ``get_query_offset``); [`kept_length`][h2o_compress.cache.CompressedCache.kept_length] counts tokens held.

    Attributes:
        max_length: the tokens [`make_cache`][h2o_compress.make_cache] was told the cache will see (prompt + new tokens;
            a budget fraction's capacity is taken of it), or ``None``. A multi-token step (prefill) that would
            take the cache beyond it is refused; decode steps are not checked (that would sync the host).
    """

    max_length: int | None = None

    def __init__(
        self, layers: list[CompressedLayer], config: CompressionConfig, model_id: str = "", capacity: int | None = -1
    ):
        _check_parts(layers, config, model_id, capacity)
        Cache.__init__(self, layers=layers)  # not super(): a subclass may also derive from a model's own cache class
        self.config = config
        self.model_id = model_id
        # the first attention layer: every attention layer follows it within a step (-1: a cache of states only)
        self._first = next((i for i, layer in enumerate(layers) if isinstance(layer, CompressedLayer)), -1)
        # tokens kept per layer on average (the budget's capacity; equal to every layer's with uniform budgets)
        first = self.attention_layers[0].setting.capacity if self.attention_layers else None
        self._capacity = first if capacity == -1 else capacity

    @property
    def attention_layers(self) -> list[CompressedLayer]:
        """The compressed attention layers, in model order (a hybrid model's linear-attention, SSM and convolution
        layers are transformers' own ``LinearAttentionLayer``, in ``layers`` beside them, kept as they are)."""
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    @property
    def state_layers(self) -> list[LinearAttentionCacheLayerMixin]:
        """A hybrid model's constant-state layers (transformers' ``LinearAttentionLayer``), in model order."""
        return [layer for layer in self.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Route to [`CompressedLayer.update`][h2o_compress.cache.CompressedLayer.update]. A multi-token step first checks what decode steps only
        flagged (finite keys and values) and that the previous forward pass reached every layer.

        Raises:
            CacheStateError: ``layer_idx`` beyond this cache's layers (another model), or layers that hold
                different token counts (a forward pass failed half-way).
            InputError: an earlier decode step fed NaN or Inf.
        """
        if not 0 <= layer_idx < len(self.layers):
            raise CacheStateError(
                f"layer_idx={layer_idx} but this cache has {len(self.layers)} layers: it was made for another model"
            )
        layer, first = self.layers[layer_idx], self._first
        if not isinstance(layer, CompressedLayer):
            raise CacheStateError(f"layer_idx={layer_idx} holds a linear-attention/SSM state, not keys: it was made "
                                  "for another model")
        if (key_states.shape[2] == 1 and layer_idx != first and layer.is_initialized
                and self.layers[first].is_initialized):
            # every layer follows layer 0 within a step: a flag, read with the others (no host sync here); layer 0
            # may live on another device (a model split by device_map): its counter is copied without a sync
            reference = self.layers[first].counters.seen
            if reference.device != layer.geometry.device:
                reference = reference.to(layer.geometry.device, non_blocking=True)
            if layer.backend.name == "cpu":  # the CPU kernel sets the flag itself
                layer.backend.reference_seen = reference
            else:
                layer.counters.consistent &= layer.counters.seen + 1 == reference
        if layer_idx == first and key_states.shape[2] > 1:  # eager steps only: decode steps never sync
            self.check()
            attention = self.attention_layers
            seen = {int(layer.counters.seen) for layer in attention if layer.is_initialized}
            if len(seen) > 1 or (seen and not all(layer.is_initialized for layer in attention)):
                raise CacheStateError(
                    f"the layers of this cache hold different token counts ({sorted(seen)}): an earlier forward pass "
                    "failed half-way; call cache.reset() or build a new cache"
                )
            total = max(seen, default=0) + key_states.shape[2]
            if self.max_length is not None and total > self.max_length:
                raise InputError(
                    f"this step brings the cache to {total} tokens but it was made with max_length={self.max_length} "
                    "(the tokens it will see: prompt + new tokens; a budget fraction's capacity is taken of it); "
                    f"allowed: make_cache(model, config, max_length=N) with N at least the prompt's tokens plus the "
                    "new tokens"
                )
        return layer.update(key_states, value_states, *args, **kwargs)

    def check(self) -> None:
        """Raise if an earlier step fed non-finite keys or values, or failed half-way (a layer that missed a
        step). Decode steps only set flags (no host sync per layer or step); this reads them all at once:
        [`h2o_compress.generate`][h2o_compress.generate] calls it once per generation, saving and multi-token steps call it first.

        Raises:
            InputError: NaN or Inf reached the cache; it is poisoned, so call ``cache.reset()`` or build a new one.
            CacheStateError: a forward pass failed half-way; call ``cache.reset()`` or build a new cache.
        """
        ready = [layer for layer in self.attention_layers if layer.is_initialized]
        if not ready:
            return
        device = ready[0].geometry.device
        flags = torch.stack([torch.stack((layer.counters.finite, layer.counters.consistent)).to(device)
                             for layer in ready]).all(0)
        finite, consistent = flags.tolist()
        if not consistent:
            raise CacheStateError(
                "a forward pass failed half-way (some layers saw a token the others did not); call cache.reset() or "
                "build a new cache"
            )
        if not finite:
            raise InputError(
                "keys or values of an earlier step were not finite (NaN or Inf); the cache holds them, so call "
                "cache.reset() or build a new cache, and check the inputs and the model weights"
            )


    @property
    def capacity(self) -> int | None:
        """Tokens kept per layer, sequence and KV head, on average over the layers (``None``: unbounded); see
        [`capacities`][h2o_compress.cache.CompressedCache.capacities] for each layer's (``layer_budgets="pyramid"`` spreads them)."""
        return self._capacity

    @property
    def capacities(self) -> list[int | None]:
        """Tokens kept by each layer, per sequence and KV head."""
        return [layer.setting.capacity for layer in self.attention_layers]

    @property
    def compile_blocker(self) -> str | None:
        """Why the decode step cannot be compiled (the first layer's reason), or ``None``."""
        return next((layer.setting.compile_blocker for layer in self.attention_layers if layer.setting.compile_blocker),
                    None)

    @property
    def decode_kernel(self) -> str:
        """The kernels the layers' decode steps run (each layer's ``backend.name``, `h2o_compress.cache.backends`),
        sorted and joined by ``+``: ``"cpu"``, or ``"cpu+torch"`` where some layers cannot run the native kernel;
        ``""`` before the first token."""
        return "+".join(sorted({layer.backend.name for layer in self.attention_layers if layer.is_initialized}))

    def take_rows(self, indices, source: "CompressedCache", batch: int) -> None:
        """Copy every sequence of ``source`` (a cache of the same setting and model, e.g. one prompt prefilled alone)
        into rows ``indices`` (ints, one per ``source`` sequence) of this cache of ``batch`` rows, layer by layer
        ([`rows.take_rows`][h2o_compress.cache.rows.take_rows]; a hybrid's linear states: `take_state_rows`); the first call makes this cache's buffers. Continuous batching
        ([`h2o_compress.generate_batch`][h2o_compress.generate_batch]) refills a finished row this way. Eager: reads ``seen`` once per layer.
        ``source`` is left empty.

        Raises:
            CacheStateError: ``source`` has another layer count or setting, or holds nothing.
        """
        if len(source.layers) != len(self.layers):
            raise CacheStateError(f"the source cache has {len(source.layers)} layers, this one {len(self.layers)}: "
                                  "rows move only between caches of one model")
        indices = torch.as_tensor(indices, dtype=torch.long)
        for layer, other in zip(self.layers, source.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):  # states first: moving keys resets ``source``
                take_state_rows(getattr(layer, "linear", layer), indices, getattr(other, "linear", other), batch)
            if isinstance(layer, CompressedLayer):
                rows.take_rows(layer, indices, other, batch)
        self.max_length = None  # positions keep counting as rows are refilled

    def kept_length(self, layer_idx: int | None = None) -> int:
        """Tokens held now by ``layer_idx`` (default: the first attention layer), per sequence and KV head (reads
        the device); 0 for a constant-state layer."""
        layer = self.layers[self._first if layer_idx is None else layer_idx]
        return layer.kept_length() if isinstance(layer, CompressedLayer) else 0

    def seen_tokens(self) -> int:
        """Tokens seen so far, as a Python int (reads the device)."""
        return self.get_seq_length()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen (not kept) by ``layer_idx``'s attention (transformers' rule for a constant-state layer), a
        Python int as ``DynamicCache`` returns it; reads the device (compiled code reads `seen_length`)."""
        return int(self.seen_length(layer_idx))

    def seen_length(self, layer_idx: int = 0) -> torch.Tensor | int:
        """Tokens seen, as the layer counts them: an int64 0-dim tensor on the cache's device (0 before the first
        step), read without a host sync."""
        return Cache.get_seq_length(self, layer_idx)

    def get_query_offset(self, layer_idx: int = 0) -> torch.Tensor | int:
        """The new tokens' offset for transformers' mask, `seen_length`: a tensor, so a compiled step neither
        syncs nor specialises on the count."""
        return self.seen_length(layer_idx)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (packed data, scales, zeros, ring window, positions, scores, and a
        hybrid's constant linear-attention/SSM/convolution states, `state_nbytes`)."""
        return sum(layer.nbytes() for layer in self.attention_layers) + self.state_nbytes()

    def state_nbytes(self) -> int:
        """Bytes of a hybrid model's constant-size states (conv and recurrent, as transformers' layers hold them)."""
        return sum(t.numel() * t.element_size() for layer in self.state_layers for t in state_tensors(layer))

    def storage_nbytes(self) -> int:
        """Bytes of the storages behind every tensor held; above [`nbytes`][h2o_compress.cache.CompressedCache.nbytes] only if a view pins a larger
        buffer (a check that eviction really frees memory)."""
        tensors = [t for layer in self.attention_layers for t in layer.tensors().values()]
        tensors += [t for layer in self.state_layers for t in state_tensors(layer)]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def full_fp16_nbytes(self) -> int:
        """Bytes the uncompressed fp16 cache would hold for the tokens seen:
        ``layers x kv_heads x (head_dim + value_dim) x tokens x batch x 2`` (``value_dim``: the width the layers
        hold values at)."""
        ready = [layer for layer in self.attention_layers if layer.is_initialized]
        if not ready:
            return 0
        layer = ready[0]
        geometry = layer.geometry
        widths = geometry.head_dim + geometry.value_dim
        return len(self.attention_layers) * geometry.kv_heads * widths * int(layer.counters.seen) * geometry.batch * 2

    def full_nbytes(self) -> int:
        """Bytes the uncompressed cache in the model's own dtype (the dtype of the keys fed: float32 on a CPU)
        would hold for the tokens seen, ``layers x kv_heads x (head_dim + value_dim) x tokens x batch x
        element size``: the attention layers only (a hybrid's constant states, `state_nbytes`, are the same
        either way). This is the cache the model would have had without compression; compare
        [`held_nbytes`][h2o_compress.cache.CompressedCache.held_nbytes] with it."""
        ready = [layer for layer in self.attention_layers if layer.is_initialized]
        if not ready:
            return 0
        element = torch.empty((), dtype=ready[0].geometry.dtype).element_size()
        return self.full_fp16_nbytes() // 2 * element

    def held_nbytes(self) -> int:
        """Bytes of the keys and values the attention layers hold now, counted for the slots that hold a token:
        stored data with its scales and zero points, the ring window's keys and values, the refined low planes.
        This counts like with like against [`full_nbytes`][h2o_compress.cache.CompressedCache.full_nbytes] (equal
        to it when nothing is evicted or quantized); what [`nbytes`][h2o_compress.cache.CompressedCache.nbytes]
        counts beyond it and `state_nbytes` is bookkeeping (positions, scores, value norms, head tags, counters)
        and room allocated for tokens not held (free slots). Reads the device."""
        return sum(_held_data_bytes(layer) for layer in self.attention_layers)

    def frozen_copy(self, max_length: int) -> "CompressedCache":
        """A copy holding this cache's tokens that evicts nothing more, with room for the tokens up to
        ``max_length`` seen in all (the compressed context stays compressed, what is added after it is kept whole,
        and only that is allocated on top of the compressed storage). This cache is not changed. Used by
        [`h2o_compress.runtime.ask`][h2o_compress.runtime.ask.ask].

        Raises:
            CacheStateError: an empty cache, ``max_length`` below the tokens seen, or a hybrid model's cache (its
                linear-attention/SSM states would move on with the question).
        """
        if self.state_layers:
            raise CacheStateError("a frozen copy of a cache with linear-attention/SSM states is not supported: those "
                                  "states cannot be shared between questions")
        self.check()
        extra = max_length - self.seen_tokens()
        if extra < 0:
            raise CacheStateError(f"max_length={max_length} is below the {self.seen_tokens()} tokens this cache has seen")
        copy = CompressedCache(
            [frozen_layer(layer, extra) for layer in self.layers], self.config, self.model_id, capacity=None
        )
        for name in ("model_fingerprint", "model_ref", "prompt_state"):
            if hasattr(self, name):
                setattr(copy, name, getattr(self, name))
        copy.max_length = max_length  # its storage has room for no more: a longer generation is refused up front
        return copy


def _held_data_bytes(layer: CompressedLayer) -> int:
    """Bytes of ``layer``'s keys and values (``keys*``/``values*`` buffers of its store, ring window and refined
    planes) in the slots holding a token: each group's data bytes times its share of occupied slots (positions
    >= 0; every slot of a group has the same bytes). 0 before the first token."""
    if not layer.is_initialized:
        return 0
    layer.run_deferred_eviction()
    groups = [(layer.store.tensors(), layer.store.positions)]
    if layer.ring is not None:
        groups.append((layer.ring.tensors(), layer.ring.positions))
    if layer.store.refine is not None:
        groups.append((layer.store.refine.tensors(), layer.store.refine.slots))
    total = 0
    for tensors, positions in groups:
        data = sum(t.numel() * t.element_size() for name, t in tensors.items() if name.startswith(("keys", "values")))
        if positions.numel():
            total += data * int((positions >= 0).sum()) // positions.numel()
    return total


def _layer_policy(config: CompressionConfig, calibration, idx: int):
    """A fresh policy of ``config`` for model layer ``idx``, with that layer's calibrated weights where the policy
    needs them (``needs_calibration``) and ``calibration`` has some."""
    policy = config.eviction_policy()
    if policy.needs_calibration and calibration is not None:
        policy = policy.for_layer(calibration.eviction_weights(idx))
    return policy


def build_layers(
    config: CompressionConfig, num_layers: int, head_dim: int, capacity: int | None, max_tokens: int | None = None,
    capacities: list[int] | None = None, spans: tuple[LayerSpan, ...] = (), torch_decode: str | None = None,
    calibration=None, value_dim: int | None = None,
) -> list[CompressedLayer | LinearAttentionLayer]:
    """One [`CompressedLayer`][h2o_compress.cache.CompressedLayer] per model layer for ``config`` (see [`h2o_compress.make_cache`][h2o_compress.make_cache]), layer
    ``i`` with ``capacities[i]`` tokens (default: ``config.layer_capacities(capacity, num_layers)``; ``capacity``
    per layer on average); its store a head-adaptive pool where ``config.head_budgets == "adaptive"`` and the layer
    evicts (an unbounded layer keeps everything, so the heads have nothing to share), with the low planes of its
    top-ranked tokens where ``config.high_bits_fraction > 0`` (`h2o_compress.cache.refinement`).
    Layer ``i`` attends over ``spans[i]`` ([`LayerSpan`][h2o_compress.cache.LayerSpan]; ``()``: every layer full attention); sliding
    and chunked layers, and every layer where ``torch_decode`` gives a reason (a softmax the fast kernels do not
    run: soft-cap, sink logits, values of another head dim), decode in the torch form. A policy fitted per model
    gets layer ``i``'s weights from ``calibration`` (a [`Calibration`][h2o_compress.persistence.Calibration]).
    A ``"state"`` span (a hybrid model's linear-attention, SSM or convolution layer) gets transformers' own
    ``LinearAttentionLayer``, whose states stay as the model computes them.
    Values of another head dim than the keys (``value_dim``: the model's, e.g. multi-head latent attention) are held
    at their own width (`held_value_dim`).

    Raises:
        ConfigError: a group size that does not divide ``head_dim``.
    """
    held = held_value_dim(config, head_dim, value_dim)
    if capacities is None:
        capacities = config.layer_capacities(capacity, num_layers)
    layers = []
    for idx in range(num_layers):
        span = spans[idx] if spans else FULL_SPAN
        if span.stateful:  # a hybrid's linear-attention/SSM/conv layer: transformers' own, its states untouched
            layers.append(StateLayer(number_of_states=span.states))
            continue
        kernel = "torch" if span.windowed or torch_decode else config.attention_kernel
        paired = {"number_of_states": span.states} if span.paired else {}  # a state beside the keys (Falcon-H1)
        layers.append(
            (CompressedStateLayer if span.paired else CompressedLayer)(
                idx,
                _layer_policy(config, calibration, idx),
                capacities[idx],
                make_quantizer(config.key_bits, config.quant, config.group_size, head_dim, config.rotate),
                make_quantizer(config.value_bits, config.quant, config.group_size, held or head_dim, config.rotate),
                residual=config.residual,
                score_chunk_size=config.score_chunk_size,
                attention_kernel=kernel,
                max_tokens=max_tokens,
                span=span,
                head_adaptive=config.head_budgets == "adaptive" and capacities[idx] is not None,
                high_bits_fraction=config.high_bits_fraction,
                value_dim=held,
                **paired,
            )
        )
    attention = [layer for layer in layers if isinstance(layer, CompressedLayer)]
    if config.high_bits_fraction > 0 and config.layer_budgets == "global" and capacity is not None and attention:  # planner: uniform's rows
        _spread_refined(attention, config, capacity, max_tokens)
    for layer in attention:
        layer.num_layers = num_layers
    return layers


def _spread_refined(layers: list[CompressedLayer], config: CompressionConfig, capacity: int,
                    max_tokens: int | None) -> None:
    """Give each of ``layers`` its rows of refined planes under ``layer_budgets="global"`` (the total the planner
    counts for uniform budgets of ``capacity`` tokens, spread by the layers' slots)."""
    uniform = LayerSetting(config.eviction_policy(), capacity, layers[0].setting.key_quantizer, layers[0].setting.value_quantizer,
                           residual=config.residual, max_tokens=max_tokens)
    slots = [layer.setting.slots_per_head() for layer in layers]  # a pool's slots per head
    rows = spread_refined_rows(slots, config.high_bits_fraction, uniform.slots_per_head())
    for layer, per_head in zip(layers, rows):
        layer.setting = dataclasses.replace(layer.setting, refined_per_head=per_head)


def held_value_dim(config: CompressionConfig, head_dim: int, value_dim: int | None) -> int | None:
    """The width a layer holds values of head dim ``value_dim`` at, beside keys of ``head_dim``: ``value_dim``
    itself at 16 bits, else rounded up to a multiple of ``config.group_size`` (the quantized format's groups);
    ``None`` where that is the keys' head dim (or ``value_dim`` is ``None``)."""
    if value_dim is None:
        return None
    if config.value_bits < 16:
        value_dim = -(-value_dim // config.group_size) * config.group_size
    return None if value_dim == head_dim else value_dim


def frozen_layer(layer: CompressedLayer, extra_tokens: int) -> CompressedLayer:
    """A new layer holding ``layer``'s tokens (same slots, ring, positions, counters; copied, not shared) that
    evicts nothing more (a sliding layer still forgets what leaves its window), with storage for
    ``extra_tokens`` more tokens, no more (compress-then-ask: the question and the answer are added to a
    compressed context, which stays as it is).

    Raises:
        CacheStateError: this layer holds nothing, or ``extra_tokens`` is negative.
    """
    if not layer.is_initialized or extra_tokens < 0:
        raise CacheStateError(f"layer {layer.layer_idx}: a frozen copy needs an initialised layer and "
                              "extra_tokens >= 0")
    max_tokens = layer.store.slots_per_head + layer.setting.residual + extra_tokens  # unbounded, of known size
    copy = CompressedLayer(layer.layer_idx, **layer.setting.arguments(capacity=None, max_tokens=max_tokens))
    copy.num_layers = layer.num_layers
    geometry = layer.geometry
    empty = torch.empty(geometry.batch, geometry.kv_heads, 0, geometry.head_dim, dtype=geometry.dtype,
                        device=geometry.device)
    copy.lazy_initialization(empty, empty)
    mine = layer.tensors()
    for name, target in copy.tensors().items():  # scores are not copied: nothing is evicted any more
        if name in mine:  # the store's first `slots` slots; the rest stay empty (position -1)
            source = mine[name]
            (target if target.shape == source.shape else target.narrow(2, 0, source.shape[2])).copy_(source)
    return copy

