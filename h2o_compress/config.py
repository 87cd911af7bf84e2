"""`CompressionConfig`: the one object that says how the KV cache is compressed.

Semantics follow ``DESIGN.md`` §2: ``budget`` is a fraction of the sequence length the cache will see
(``capacity = max(ceil(budget * length), min_capacity)`` tokens per layer and KV head, and no eviction at all
for a sequence of at most ``min_capacity`` tokens) or, when an integer >= 1, an absolute capacity in tokens.
``heavy_ratio`` of the capacity goes to heavy hitters, the rest to the recent window
(H2O, Zhang et al. 2023, arXiv 2306.14048, §4).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

from h2o_compress.attention.runtime_spec import (  # noqa: F401 (the runtime part's names this module had: re-exported)
    ATTENTION_KERNELS, DEFAULT_PREFILL_CHUNK, MAX_TOKENS, RuntimeSpec,
)
from h2o_compress.utils.checks import check_count
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.formats import GROUP_SIZES
from h2o_compress.formats.storage import (  # noqa: F401 (the storage part's names this module had: re-exported)
    ALLOWED_BITS, DEFAULT_QUANT, KEY_OFFSETS, MAX_RESIDUAL, StorageSpec, check_format_options, key_offsets_conflict,
)
from h2o_compress.policies import POLICIES, POLICY_OPTIONS, policy_names
from h2o_compress.policies.spec import (  # noqa: F401 (the budget's names this module had: re-exported)
    BUDGET_ALLOWED, EvictionSpec, check_budget, parse_budget,
)
from h2o_compress.layout import (  # noqa: F401 (the names of the layout this module had: re-exported)
    HEAD_BUDGETS, LAYER_BUDGETS, MAX_LAYER_WEIGHT, MAX_LAYERS, PYRAMID_BETA, LayoutSpec, fit_to_total, layer_weights,
)

ALLOWED_GROUP_SIZES = GROUP_SIZES
#: Tokens a layer holds before a fractional budget starts evicting (``CompressionConfig.min_capacity``). Chosen on
#: the 8 tuning prompts only (``h2o_compress/data/prompts.json``; ``benchmarks/short_prompts.py --phase choose``,
#: floors 0 to 256): the smallest floor at which h2o 0.2 + 4 bits gave every whole greedy answer of 4 bits alone at
#: ``generate``'s defaults (128 new tokens); the figures per floor: ``benchmarks/results/short_prompts_choose.md``.
DEFAULT_MIN_CAPACITY = 192

#: The eviction policy of the commands that read a prompt and answer it (``generate``, ``batch``, ``eval needle``,
#: ``eval ruler``, the lm-eval model) when none is given: the prompt is read whole and ranked by the attention of
#: its end and of the model's own first answer tokens (``lookahead``), so a question at the end of a long prompt
#: votes for what is kept. `CompressionConfig` itself keeps ``h2o``.
COMMAND_POLICY = "lookahead"

#: The policy options that were fields of `CompressionConfig` before their policies declared them (`policy_option`),
#: with the value earlier versions wrote for each when not set: the constructor still takes them as keywords
#: (code, saved caches, profile rows), into ``policy_options``, and `CompressionConfig.to_dict` writes them so.
LEGACY_OPTIONS = {"lookahead_request": None, "forgetting_factor": None, "evict_chat_header": False}

#: The parts of a `CompressionConfig` by field name: each checks its own fields, flat settings of the config.
PARTS = {"eviction": EvictionSpec, "storage": StorageSpec, "layout": LayoutSpec, "runtime": RuntimeSpec}
#: The part that holds each flat setting (a field of the part).
PART_OF = {f.name: part for part, kind in PARTS.items() for f in fields(kind)}
#: The readers of a part the config passes on to it, as it does its flat settings.
READERS = {**dict.fromkeys(("sinks", "options", "eviction_policy", "min_layer_capacity"), "eviction"),
           **dict.fromkeys(("key_bits", "value_bits", "format", "compilable", "quantized"), "storage")}


@dataclass(frozen=True)
class CompressionConfig:
    """How to compress the KV cache: an eviction policy followed by a quantizer, composed of its parts (`PARTS`),
    each checking its own fields. Frozen and hashable: change a setting with ``dataclasses.replace``.

    Each field of a part is also a flat setting (`SETTING_DEFAULTS`: ``policy``, ``kv_bits``, ...), as are the
    options of `LEGACY_OPTIONS` (kept in ``policy_options``): the constructor and ``dataclasses.replace`` take it as
    a keyword (over the part given with it), ``config.kv_bits`` reads it, `to_dict` writes it, and CLI flags, config
    files and saved caches name it so. What each does: docs/guide/semantics.md ("The settings in detail").

    Args:
        eviction: the policy and its split of the capacity, an [`EvictionSpec`][h2o_compress.policies.spec.EvictionSpec]
            (``policy``, ``heavy_ratio``, ``sink_tokens``, ``policy_options``). Default: ``h2o``, half heavy hitters.
        budget: a fraction in (0, 1] of the tokens the cache will see, or an integer >= 1: tokens per layer and KV
            head. ``1.0`` (default) never evicts.
        min_capacity: tokens per layer and KV head a fractional budget keeps at least (nothing is evicted up to
            that length); ``0``: off; ``None`` (default): 192 (`DEFAULT_MIN_CAPACITY`).
        storage: how keys and values are stored: a [`StorageSpec`][h2o_compress.formats.storage.StorageSpec]
            (``kv_bits``, ``k_bits``, ``v_bits``, ``quant``, ``group_size``, ``residual``, ``rotate``,
            ``high_bits_fraction``, ``key_offsets``). Default: 16 bits, not quantized.
        layout: how the capacity is spread over layers and heads: a [`LayoutSpec`][h2o_compress.layout.LayoutSpec]
            (``layer_budgets``, ``head_budgets``). Default: uniform.
        runtime: how attention is run: a [`RuntimeSpec`][h2o_compress.attention.runtime_spec.RuntimeSpec]
            (``score_chunk_size``, ``prefill_chunk_size``, ``attention_kernel``); never changes the tokens kept.
        calibration: path of a file written by ``h2o-compress calibrate``; ``None`` (default): the model's own.

    Raises:
        ConfigError: a value out of range (checked by its part), or parts that do not combine, naming it.
    """

    eviction: EvictionSpec = EvictionSpec()
    budget: float = 1.0
    min_capacity: int | None = None
    storage: StorageSpec = StorageSpec()
    layout: LayoutSpec = LayoutSpec()
    runtime: RuntimeSpec = RuntimeSpec()
    calibration: str | None = None

    def __post_init__(self) -> None:
        """Check the config's own fields and what combines the parts (each part checked its own when made).
        Raises ConfigError: the first value out of range, naming it and what is allowed."""
        for part, kind in PARTS.items():
            if not isinstance(value := getattr(self, part), kind):
                raise ConfigError(f"{part}={short(value)} is invalid; allowed: a part of type {kind.__name__}")
        check_budget(self.budget)
        if self.min_capacity is not None:
            check_count("min_capacity", self.min_capacity, minimum=0, maximum=MAX_TOKENS,
                        allowed=f"an integer from 0 to {MAX_TOKENS} (tokens)")
        if self.calibration is not None and (not isinstance(self.calibration, str) or not self.calibration.strip()
                                             or "\x00" in self.calibration):
            raise ConfigError(f"calibration={short(self.calibration)} is invalid; allowed: the path of a file written "
                              "by h2o-compress calibrate")
        for refused, error in self._combinations():
            if refused:
                raise error()

    def _combinations(self):
        """(refused, make the error) of each pair of parts that may not combine, in the order checked: adaptive heads
        with a policy ranking heads alike; with the ``triton`` kernel, a part the op does not read (``auto`` falls
        back to torch for them); a ``calibration`` nothing reads (the model's is checked when its cache is made);
        key offsets without one slot per head; ``global`` layer budgets without a scoring pass."""
        triton, policy = self.attention_kernel == "triton", POLICIES[self.policy]
        yield (self.head_budgets == "adaptive" and not policy.shares_heads and self.policy != "full",
               lambda: ConfigError(f"head_budgets='adaptive' with policy={self.policy!r}: it ranks every head's tokens "
                                   "alike, so there is nothing to share between heads; allowed policies: "
                                   f"{', '.join(policy_names(shares_heads=True))}"))
        yield triton and self.head_budgets == "adaptive", lambda: ConfigError(
            "head_budgets='adaptive' with attention_kernel='triton': the Triton op reads per-head slots and an "
            "adaptive layer pools them; allowed: attention_kernel='auto' or 'torch'")
        yield triton and self.high_bits_fraction > 0, lambda: ConfigError(
            f"high_bits_fraction={self.high_bits_fraction!r} runs the torch decode step (the Triton op does not "
            "read the 8-bit tokens' low planes); allowed: attention_kernel 'auto' or 'torch', or high_bits_fraction 0")
        yield triton and self.key_offsets != "none", lambda: key_offsets_conflict(
            "attention_kernel='triton' (the op does not read the offsets)", "attention_kernel 'auto' or 'torch'")
        yield (self.calibration is not None and not policy.needs_calibration and self.key_offsets == "none",
               lambda: ConfigError(f"calibration={short(self.calibration)} is not used by policy={self.policy!r}; "
                                   f"allowed: policy {', '.join(policy_names(needs_calibration=True))}, or key_offsets "
                                   "'calibrated' (4- or 8-bit int keys), or no calibration"))
        yield self.key_offsets != "none" and self.head_budgets != "uniform", lambda: key_offsets_conflict(
            f"head_budgets={self.head_budgets!r}", "head_budgets 'uniform'")
        yield self.layer_budgets == "global" and not policy.scorer, lambda: ConfigError(
            f"layer_budgets='global' with policy={short(self.policy)}: the layers are sized from the scores of a "
            f"pass run before the cache is built; allowed policies: {', '.join(policy_names(scorer=True))}")

    @classmethod
    def from_values(cls, values: Mapping) -> CompressionConfig:
        """A config from flat settings or policy option names (CLI flags, config files): an option of a policy
        without a setting of its own goes into ``policy_options`` (``None``: not given). Raises ConfigError (see the
        class), or TypeError: a name that is neither."""
        unfielded = unfielded_policy_options()
        settings = {name: value for name, value in values.items() if name not in unfielded}
        options = {name: value for name, value in values.items() if name in unfielded and value is not None}
        if options:
            given = settings.get("policy_options") or {}
            settings["policy_options"] = {**given, **options} if isinstance(given, Mapping) else given
        return cls(**settings)

    @property
    def evicts_any(self) -> bool:
        """Whether this setting can evict at all (a policy other than ``full`` and a budget below everything)."""
        return self.policy != "full" and not (self.budget_is_fraction and self.budget >= 1)

    @property
    def floor(self) -> int:
        """The floor of a fractional budget in tokens: ``min_capacity``, or ``DEFAULT_MIN_CAPACITY`` where it is
        ``None``."""
        return DEFAULT_MIN_CAPACITY if self.min_capacity is None else self.min_capacity

    @property
    def budget_is_fraction(self) -> bool:
        """True when ``budget`` is relative to the sequence length (a float <= 1)."""
        return isinstance(self.budget, float) and self.budget <= 1

    def capacity(self, length: int | None) -> int | None:
        """Tokens kept per layer and KV head for a sequence of ``length`` tokens; ``None`` means unbounded.

        A fractional budget keeps ``max(ceil(budget x length), min_capacity)`` tokens, and nothing is evicted
        (``None``) when ``length`` is at most ``min_capacity``; a budget in tokens is that number.

        Raises:
            ConfigError: a fractional budget below 1 with no known length.
        """
        if self.policy == "full":
            return None
        if self.budget_is_fraction:
            if self.budget >= 1:
                return None
            if length is None:
                raise ConfigError(
                    f"budget={self.budget} is a fraction, so the cache needs the sequence length it will see: "
                    "pass max_length= (prompt + new tokens) or give the budget as a number of tokens"
                )
            if length <= self.floor:
                return None  # a sequence this short is kept whole
            return max(1, self.floor, math.ceil(self.budget * length))
        return int(self.budget)

    def kept_tokens(self, max_length: int | None) -> int | None:
        """[`capacity`][h2o_compress.config.CompressionConfig.capacity] of a cache built for ``max_length`` tokens,
        at most ``max_length`` (`clamp_capacity`): the tokens per layer and KV head its storage holds; ``None``
        means unbounded. Raises ConfigError: a fractional budget below 1 with no known length."""
        return clamp_capacity(self.capacity(max_length), max_length)

    def layer_capacities(self, capacity: int | None, num_layers: int) -> list[int | None]:
        """Capacity of each of ``num_layers`` layers for a per-layer ``capacity`` (`capacity`), with the same total
        ``num_layers x capacity`` (``global`` before any scores: uniform); ``None`` (unbounded) stays ``None``. The
        layout spreads it ([`LayoutSpec.layer_capacities`][h2o_compress.layout.LayoutSpec.layer_capacities]), each
        layer at least [`min_layer_capacity`][h2o_compress.policies.spec.EvictionSpec.min_layer_capacity]."""
        return self.layout.layer_capacities(capacity, num_layers, self.min_layer_capacity)

    def to_dict(self) -> dict:
        """Plain-dict form (JSON) that earlier versions wrote and read alike: the flat settings in order, the options
        of `LEGACY_OPTIONS` as settings of their own (after ``head_budgets``; their value or the one of not set), and
        ``policy_options`` only where it holds another option."""
        values = {name: getattr(self, name) for name in SETTING_DEFAULTS}
        options = dict(values.pop("policy_options"))
        legacy = {name: options.pop(name, unset) for name, unset in LEGACY_OPTIONS.items()}
        at = list(values).index("head_budgets") + 1
        values = dict([*list(values.items())[:at], *legacy.items(), *list(values.items())[at:]])
        return values | {"policy_options": options} if options else values


class _Flat:
    """A flat setting (or a reader) of a `CompressionConfig`, read from the part that holds it (`PART_OF`); read on
    the class, the setting's default (`SETTING_DEFAULTS`)."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, config, owner=None):
        if config is None:
            return SETTING_DEFAULTS.get(self.name, LEGACY_OPTIONS.get(self.name, self))
        if self.part == "policy_options":  # an option of LEGACY_OPTIONS: as the field it was
            return config.eviction.policy_options.get(self.name, LEGACY_OPTIONS[self.name])
        return getattr(getattr(config, self.part), self.name)


def _taking_flat_settings(init):
    """The dataclass's ``init`` taking the flat settings (`PART_OF`) as keywords as well: a part with one given is
    made anew from its values (the part given, else the default) and those; and the options of `LEGACY_OPTIONS`,
    each (where given: not ``None`` or ``False``) into ``policy_options``, over an entry of the same name there."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        flat = {name: kwargs.pop(name) for name in [*kwargs] if name in PART_OF}
        legacy = {name: kwargs.pop(name) for name in LEGACY_OPTIONS if name in kwargs}
        legacy = {name: value for name, value in legacy.items() if value is not None and value is not False}
        given = flat.get("policy_options", getattr(kwargs.get("eviction", CompressionConfig.eviction),
                                                   "policy_options", {})) or {}
        if legacy and isinstance(given, Mapping):
            flat["policy_options"] = {**given, **legacy}
        for name in flat["policy_options"] if isinstance(flat.get("policy_options"), Mapping) else ():
            if name in SETTING_DEFAULTS:
                raise ConfigError(f"policy_options holds {short(name)}, a field of its own; allowed: "
                                  f"CompressionConfig({name}=...)")
        for part, kind in PARTS.items():
            changes = {name: value for name, value in flat.items() if PART_OF[name] == part}
            base = kwargs.get(part, getattr(CompressionConfig, part))  # the part given, else its default
            if changes and isinstance(base, kind):
                kwargs[part] = kind(**{f.name: changes.get(f.name, getattr(base, f.name)) for f in fields(kind)})
        init(self, *args, **kwargs)
    return __init__


CompressionConfig.__init__ = _taking_flat_settings(CompressionConfig.__init__)
for _name, _part in {**PART_OF, **READERS, **dict.fromkeys(LEGACY_OPTIONS, "policy_options")}.items():
    setattr(CompressionConfig, _name, _Flat(_part, _name))
#: The flat settings (keywords, `CompressionConfig.to_dict`, config file keys, CLI flags) with their defaults, in
#: the order of the fields of earlier versions.
SETTING_DEFAULTS = MappingProxyType({name: getattr(CompressionConfig(), name) for name in (
    "policy", "budget", "min_capacity", "heavy_ratio", "sink_tokens", "kv_bits", "k_bits", "v_bits", "quant",
    "group_size", "residual", "rotate", "score_chunk_size", "prefill_chunk_size", "attention_kernel",
    "layer_budgets", "high_bits_fraction", "head_budgets", "calibration", "key_offsets")} | {
    "policy_options": MappingProxyType({})})
FIELD_NAMES = tuple(SETTING_DEFAULTS)  #: The names of the flat settings, in order.


def clamp_capacity(capacity: int | None, max_length: int | None) -> int | None:
    """``capacity`` (tokens per layer and KV head; ``None``: unbounded) at most ``max_length`` (the tokens a cache
    can see; ``None``: not known): storage never exceeds what the cache can see."""
    return capacity if capacity is None or max_length is None else min(capacity, max_length)


def unfielded_policy_options() -> tuple[str, ...]:
    """The registered policies' option names that have no field of their own (`POLICY_OPTIONS` less
    `FIELD_NAMES`): those ``policy_options`` carries, and config files and the CLI route there."""
    return tuple(name for name in POLICY_OPTIONS if name not in FIELD_NAMES)


def check_usable(config: CompressionConfig, capacity: int | None = None, frozen: bool = False) -> CompressionConfig:
    """``config``, refused where it is valid field by field but its eviction split cannot serve its budget (what
    the CLI runs first): ``capacity`` tokens per layer and KV head when known, ``frozen`` for a context compressed
    once then asked about (what is refused, and why:
    [`EvictionSpec.ensure_usable`][h2o_compress.policies.spec.EvictionSpec.ensure_usable]). Raises ConfigError naming
    the values and what is allowed."""
    config.eviction.ensure_usable(config.budget, capacity, frozen)
    return config
