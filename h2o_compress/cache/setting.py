"""`LayerSetting`: what one compressed layer is, fixed when it is built (the arguments and what follows from them).

A [`CompressedLayer`][h2o_compress.cache.CompressedLayer] holds one of these next to its parts (store, ring, span, decode backend): the
capacity after the layer type and the known length capped it, the ring size, whether the policy ranks at all, the
storage formats (split into two 4-bit planes for mixed precision), and the store's layout (per-head slots or the
head-adaptive pool). Frozen: a probe or a frozen copy is built from the same arguments with another capacity
([`LayerSetting.arguments`][h2o_compress.cache.LayerSetting.arguments]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from h2o_compress.utils.checks import check_count, check_flag, check_fraction
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.config import ATTENTION_KERNELS, clamp_capacity
from h2o_compress.formats import IntQuantizer, KVQuantizer, eager_only_formats
from h2o_compress.formats.split import SplitIntQuantizer
from h2o_compress.policies import EvictionPolicy
from h2o_compress.cache.span import FULL_SPAN, LayerSpan

GROWTH = 256  # slots added at a time to an unbounded cache of unknown length


def _split(quantizer: KVQuantizer) -> KVQuantizer:
    """The split form of a 4-bit ``int`` quantizer (mixed precision: two 4-bit planes); any other unchanged."""
    if type(quantizer) is IntQuantizer and quantizer.bits == 4:
        return SplitIntQuantizer(quantizer.group_size, quantizer.head_dim, quantizer.rotate)
    return quantizer


@dataclass(frozen=True)
class LayerSetting:
    """One layer's setting (see [`CompressedLayer`][h2o_compress.cache.CompressedLayer] for the arguments).

    Attributes:
        capacity: tokens kept per sequence and KV head (``None``: unbounded), within ``max_tokens`` and the span's
            ``size - 1``.
        residual: the ring's size (0 at 16 bits; at most half the policy's recent window).
        evicts: the policy ranks (its capacity is below what the span and length bound anyway).
        with_scores: the layer accumulates attention scores (a policy that needs them and ranks).
        growable: unbounded and of unknown length: the store grows (eager only).
        high_bits_fraction: mixed precision by importance (``cache/refinement.py``).
        refined_per_head: mixed precision by importance (``cache/refinement.py``).
        head_adaptive: the store is one pool per layer shared by the KV heads (Ada-KV, ``cache/slot_pool.py``).
        value_dim: the width values are held at where it is not the keys' head dim (values of another head dim than
            the keys, e.g. multi-head latent attention's rotary key beside its latent: the model's value head dim,
            rounded up to a multiple of the value format's group), or ``None``: the keys' head dim (narrower values
            are then held zero-padded to it).
    """

    policy: EvictionPolicy
    capacity: int | None
    key_quantizer: KVQuantizer
    value_quantizer: KVQuantizer
    residual: int = 0
    score_chunk_size: int = 64
    attention_kernel: str = "auto"
    max_tokens: int | None = None
    span: LayerSpan = FULL_SPAN
    head_adaptive: bool = False
    high_bits_fraction: float = 0.0
    refined_per_head: int | None = None
    value_dim: int | None = None
    evicts: bool = dataclasses.field(init=False)
    with_scores: bool = dataclasses.field(init=False)

    def __post_init__(self):
        self._check_kinds()
        capacity = clamp_capacity(self.capacity, self.max_tokens)
        # a sliding layer holds at most window - 1 tokens (where the cache can outgrow its window at all)
        if self.span.windowed and (self.max_tokens is None or self.span.size - 1 < self.max_tokens):
            capacity = self.span.cap(capacity)
        residual = self.residual if self.quantized else 0
        if capacity is not None and residual:
            residual = min(residual, self.policy.recent_window(capacity) // 2)
        evicts = capacity is not None and capacity != self.span.cap(None)
        set_ = object.__setattr__
        set_(self, "capacity", capacity)
        set_(self, "residual", residual)
        set_(self, "evicts", evicts)
        set_(self, "with_scores", self.policy.needs_scores and evicts)
        if self.high_bits_fraction > 0:
            set_(self, "key_quantizer", _split(self.key_quantizer))
            set_(self, "value_quantizer", _split(self.value_quantizer))
        self._check()

    def _check_kinds(self) -> None:
        """Refuse arguments of the wrong type (ConfigError naming the argument), before anything is derived from
        them: a layer built by hand (``CompressedLayer(...)``) gets the message, not an AttributeError later."""
        kinds = (("policy", EvictionPolicy), ("key_quantizer", KVQuantizer), ("value_quantizer", KVQuantizer),
                 ("span", LayerSpan))
        for name, kind in kinds:
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name}={short(getattr(self, name))} is invalid; allowed: a {kind.__name__}")
        for name, least, optional in (("capacity", 1, True), ("max_tokens", 1, True), ("residual", 0, False),
                                      ("score_chunk_size", 1, False), ("refined_per_head", 0, True),
                                      ("value_dim", 1, True)):
            value = getattr(self, name)
            if value is not None or not optional:  # no upper bound: storage a device cannot hold is refused later
                check_count(name, value, minimum=least, maximum=None,
                            allowed=f"an integer >= {least}" + (" or None" if optional else ""))
        if not isinstance(self.attention_kernel, str) or self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(f"attention_kernel={short(self.attention_kernel)} is not supported; allowed: auto, torch, "
                              "triton")
        check_flag("head_adaptive", self.head_adaptive)
        check_fraction("high_bits_fraction", self.high_bits_fraction)

    def _check(self) -> None:
        """Refuse what a layer of unknown length cannot hold (ConfigError). What the setting itself allows (kernels,
        formats, policies) [`CompressionConfig`][h2o_compress.config.CompressionConfig] checks, once."""
        if self.head_adaptive and self.growable:
            raise ConfigError("head_budgets='adaptive' needs a capacity or max_length (its slot pool has a fixed size)")
        if self.high_bits_fraction > 0 and self.growable:
            raise ConfigError("high_bits_fraction > 0 needs a cache of known length; pass max_length to make_cache")

    @property
    def quantized(self) -> bool:
        return self.key_quantizer.bits < 16 or self.value_quantizer.bits < 16

    @property
    def growable(self) -> bool:
        return self.capacity is None and self.max_tokens is None

    @property
    def split_names(self) -> tuple[str, ...]:
        """Which of ``keys``/``values`` are held as two 4-bit planes (mixed precision)."""
        pairs = (("keys", self.key_quantizer), ("values", self.value_quantizer))
        return tuple(name for name, q in pairs if isinstance(q, SplitIntQuantizer))

    @property
    def compile_blocker(self) -> str | None:
        """Why the decode step cannot be compiled, or ``None``."""
        if not all(q.compilable for q in (self.key_quantizer, self.value_quantizer)):  # declared by each format
            return f"the bitsandbytes formats ({eager_only_formats()}) run eagerly only; use quant='int' to compile"
        if self.growable:
            return "an unbounded cache without max_length grows as it goes; pass max_length to make_cache to compile"
        return None

    @property
    def is_compileable(self) -> bool:
        """The decode step can be compiled (integer and 16-bit formats, storage of known size)."""
        return self.compile_blocker is None

    def slots_per_head(self, first_chunk: int = 0) -> int:
        """Store slots per KV head: ``capacity - residual + 1`` (one is free before each step); ``max_tokens -
        residual`` unbounded (nothing is evicted); else the first chunk plus `GROWTH` (grows later)."""
        if self.capacity is not None:
            return self.capacity - self.residual + 1
        if self.max_tokens is not None:
            return max(self.max_tokens - self.residual, 1)
        return first_chunk + GROWTH

    def arguments(self, **changes) -> dict:
        """The constructor arguments of this setting (but ``changes``): a probe or a frozen copy of a layer."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init} | changes
