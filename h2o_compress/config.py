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
from dataclasses import asdict, dataclass, field, fields

from h2o_compress.utils.checks import check_count, check_number
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.formats import FORMATS, GROUP_SIZES
from h2o_compress.formats.storage import (  # noqa: F401 (ALLOWED_BITS, KEY_OFFSETS, MAX_RESIDUAL: re-exported)
    ALLOWED_BITS, KEY_OFFSETS, MAX_RESIDUAL, StorageSpec, key_offsets_conflict,
)
from h2o_compress.policies import POLICIES, POLICY_OPTIONS, make_policy, policy_names
from h2o_compress.layout import (  # noqa: F401 (the names of the layout this module had: re-exported)
    HEAD_BUDGETS, LAYER_BUDGETS, MAX_LAYER_WEIGHT, MAX_LAYERS, PYRAMID_BETA, LayoutSpec, fit_to_total, layer_weights,
)

ALLOWED_GROUP_SIZES = GROUP_SIZES
ATTENTION_KERNELS = ("auto", "torch", "triton")
#: Tokens a layer holds before a fractional budget starts evicting (``CompressionConfig.min_capacity``). Chosen on
#: the 8 tuning prompts only (``h2o_compress/data/prompts.json``; ``benchmarks/short_prompts.py --phase choose``,
#: floors 0 to 256): the smallest floor at which h2o 0.2 + 4 bits gave every whole greedy answer of 4 bits alone at
#: ``generate``'s defaults (128 new tokens); 128 still changed 7 of 8 answers, one within its first 16 tokens.
DEFAULT_MIN_CAPACITY = 192

#: Tokens per forward pass of a prompt's prefill (``CompressionConfig.prefill_chunk_size``). Chosen with
#: ``benchmarks/prefill_chunks.py`` on a 7,900-token SmolLM2 prompt, 1 thread
#: (``benchmarks/results/prefill_chunks_cpu.md``):
#: the smallest chunk within 1.05x of the one-pass time with h2o 0.2 int4, at a fraction of the one pass's peak
#: memory growth; uncompressed, no chunk came within 1.05x and this one stays close to the one-pass time.
DEFAULT_PREFILL_CHUNK = 512

#: The eviction policy of the commands that read a prompt and answer it (``generate``, ``batch``, ``eval needle``,
#: ``eval ruler``, the lm-eval model) when none is given: the prompt is read whole and ranked by the attention of
#: its end and of the model's own first answer tokens (``lookahead``), so a question at the end of a long prompt
#: votes for what is kept. `CompressionConfig` itself keeps ``h2o``.
COMMAND_POLICY = "lookahead"

#: The policy options that were fields of `CompressionConfig` before their policies declared them (`policy_option`),
#: with the value earlier versions wrote for each when not set: the constructor still takes them as keywords
#: (code, saved caches, profile rows), into ``policy_options``, and `CompressionConfig.to_dict` writes them so.
LEGACY_OPTIONS = {"lookahead_request": None, "forgetting_factor": None, "evict_chat_header": False}

BUDGET_ALLOWED = "a fraction in (0, 1] or an integer number of tokens >= 1"
# What a real model can have: the longest context of any model this library knows is far below this.
MAX_TOKENS = 2**31 - 1


def parse_budget(text: str) -> float | int:
    """A budget as typed (CLI, lm-eval model_args): ``"0.2"`` -> 0.2 (fraction of the sequence), ``"100"`` -> 100
    (tokens). Raises ConfigError naming the value."""
    try:
        value = float(text)
    except ValueError:
        return check_budget(text)  # refused: not a number
    if math.isfinite(value) and value > 1 and value == int(value) and "." not in text and "e" not in text.lower():
        value = int(value)
    return check_budget(value, typed=text)


def check_budget(value, typed: str | None = None) -> float | int:
    """``value`` if it is a budget: a fraction in (0, 1] or a whole number of tokens >= 1 (the one check of
    `parse_budget` and ``CompressionConfig.budget``). ``typed``: the text ``value`` was read from, named in the
    message; tokens typed must be written as an integer (``"2.0"`` is refused) of at most `MAX_TOKENS`.

    Raises:
        ConfigError: naming the value (not a number, not finite, invalid or too large) and what is allowed.
    """
    shown = short(value) if typed is None else short(typed, repr_=False)
    budget = check_number("budget", value, BUDGET_ALLOWED, shown=shown)
    whole = budget == int(budget)
    if budget <= 0 or (budget > 1 and (not whole or (typed is not None and isinstance(budget, float)))):
        hint = f" (tokens are written as an integer: {int(budget)})" if budget > 1 and whole else ""
        raise ConfigError(f"budget={shown} is invalid{hint}; allowed: {BUDGET_ALLOWED}")
    if typed is not None and budget > MAX_TOKENS:
        raise ConfigError(f"budget={shown} tokens is too large; allowed: at most {MAX_TOKENS}")
    return value


@dataclass(frozen=True)
class CompressionConfig:
    """How to compress the KV cache: an eviction policy followed by a quantizer. Frozen and hashable: change a
    setting with ``dataclasses.replace``.

    Every setting is a flat field (keywords, config files, CLI flags and saved caches name them so); the storage
    fields make up [`storage`][h2o_compress.config.CompressionConfig.storage], ``layer_budgets`` and
    ``head_budgets`` [`layout`][h2o_compress.config.CompressionConfig.layout]. What each setting does, with its
    sources: docs/guide/semantics.md ("The settings in detail").

    Args:
        policy: eviction policy, a name of `h2o_compress.policies.POLICIES` (``h2o``, ``h2o-mean``, ``local``,
            ``sink``, ``full``, ``snapkv``, ``tova``, ``a2sf``, ``kvzip``, ``lookahead``, ...). Default ``h2o``.
        budget: a fraction in (0, 1] of the tokens the cache will see, or an integer >= 1: tokens per layer and KV
            head. ``1.0`` (default) never evicts.
        min_capacity: tokens per layer and KV head a fractional budget keeps at least (nothing is evicted up to
            that length); ``0``: off; ``None`` (default): 192 (`DEFAULT_MIN_CAPACITY`).
        heavy_ratio: share in [0, 1] of the capacity given to heavy hitters, the rest to the recent window (0.5).
        sink_tokens: first tokens always kept, >= 0; ``None`` (default): 4 for ``sink``, else 0.
        kv_bits: bits of stored keys and values: 16 (default, no quantization), 8 or 4.
        k_bits: bits of the keys (4, 8, 16), over ``kv_bits``; ``None``: ``kv_bits``.
        v_bits: bits of the values (4, 8, 16), over ``kv_bits``; ``None``: ``kv_bits``.
        quant: format: ``int`` (default), ``nf4``, ``fp4`` or ``int8-blockwise`` (`h2o_compress.formats.FORMATS`).
        group_size: elements of ``head_dim`` sharing one scale and zero point: 32 (default), 64 or 128.
        residual: newest tokens kept in full precision (default 3), each quantized once as it leaves.
        rotate: Hadamard-rotate ``head_dim`` before ``int`` quantization (default True).
        score_chunk_size: queries per chunk when a prefill's attention is scored (default 64), >= 1.
        prefill_chunk_size: tokens per forward pass of a prompt's prefill (default 512, `DEFAULT_PREFILL_CHUNK`);
            ``0``: one pass.
        attention_kernel: the decode step: ``auto`` (default), ``torch`` or ``triton``; all keep the same tokens.
        layer_budgets: spread of the capacity over layers, same total: ``uniform`` (default), ``pyramid``,
            ``global`` (``kvzip``/``lookahead``), or per-layer weights (numbers, or a JSON file's path; kept as a
            tuple).
        high_bits_fraction: share in [0, 1] of a layer's 4-bit ``int`` tokens kept at 8 bits (default 0: off).
        head_budgets: spread of a layer's capacity over its KV heads: ``uniform`` (default) or ``adaptive``.
        policy_options: the policy's own options by config name (`h2o_compress.policies.policy_option`), e.g.
            ``{"forgetting_factor": 0.5}`` for ``a2sf``; also config file keys and CLI flags, and, for those of
            `LEGACY_OPTIONS` (``forgetting_factor``, ``lookahead_request``, ``evict_chat_header``), keywords of
            their own. Checked by the policy; refused for a policy that does not take it. Default: none.
        calibration: path of a file written by ``h2o-compress calibrate``; ``None`` (default): the model's own.
        key_offsets: ``none`` (default) or ``calibrated`` (4- or 8-bit ``int`` keys around calibrated means).

    Raises:
        ConfigError: any value out of range, or settings that do not combine, naming the value and what is allowed.
    """

    policy: str = "h2o"
    budget: float = 1.0
    min_capacity: int | None = None
    heavy_ratio: float = 0.5
    sink_tokens: int | None = None
    # the storage fields' defaults are the storage spec's own (written once, in formats/storage.py)
    kv_bits: int = StorageSpec.kv_bits
    k_bits: int | None = StorageSpec.k_bits
    v_bits: int | None = StorageSpec.v_bits
    quant: str = StorageSpec.quant
    group_size: int = StorageSpec.group_size
    residual: int = StorageSpec.residual
    rotate: bool = StorageSpec.rotate
    score_chunk_size: int = 64
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    attention_kernel: str = "auto"
    layer_budgets: str | tuple[float, ...] = LayoutSpec.layer_budgets
    high_bits_fraction: float = StorageSpec.high_bits_fraction
    head_budgets: str = LayoutSpec.head_budgets
    calibration: str | None = None
    key_offsets: str = StorageSpec.key_offsets
    policy_options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check every field: the eviction fields, the storage (`storage`, which checks its own fields), the runtime
        fields and the layout (`layout`, which reads ``layer_budgets`` weights into a tuple), then what combines the
        parts: the options of the policy, and the head, precision, key-offset and layer spreads with the policy and
        the decode kernel. The config is frozen: the two values normalised here (``layer_budgets`` read into its
        weights, ``policy_options`` copied without the options not given) are set once, before anyone can read it.

        Raises:
            ConfigError: the first value out of range, naming it and what is allowed.
        """
        self._check_eviction()
        self.storage  # noqa: B018 (the storage checks its own fields)
        self._check_runtime()
        self._check_policy_options()
        self.eviction_policy()  # the policy checks its own options (and refuses those it does not take)
        self._check_head_budgets()
        self._check_decode_kernel()
        self._check_calibration()
        self._check_key_offsets()
        if self.layer_budgets == "global" and not POLICIES[self.policy].scorer:
            raise ConfigError(
                f"layer_budgets='global' with policy={short(self.policy)}: the layers are sized from the scores of a "
                f"pass run before the cache is built; allowed policies: {', '.join(policy_names(scorer=True))}"
            )

    def _check_eviction(self) -> None:
        """The eviction fields: ``policy``, ``budget``, ``min_capacity``, ``heavy_ratio`` and ``sink_tokens``.

        Raises:
            ConfigError: the first value out of range, naming it and what is allowed.
        """
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {short(self.policy)}; allowed: {', '.join(sorted(POLICIES))}")
        check_budget(self.budget)
        if self.min_capacity is not None:
            check_count("min_capacity", self.min_capacity, minimum=0, maximum=MAX_TOKENS,
                        allowed=f"an integer from 0 to {MAX_TOKENS} (tokens)")
        ratio = check_number("heavy_ratio", self.heavy_ratio, "a number in [0, 1]")
        if not 0 <= ratio <= 1:
            raise ConfigError(f"heavy_ratio={short(self.heavy_ratio)} is out of range; allowed: [0, 1]")
        if self.sink_tokens is not None:
            check_count("sink_tokens", self.sink_tokens, minimum=0, maximum=None, allowed="an integer >= 0")
        if self.sink_tokens is not None and self.sink_tokens > MAX_TOKENS:
            raise ConfigError(f"sink_tokens={short(self.sink_tokens)} is too large; allowed: an integer from 0 to "
                              f"{MAX_TOKENS}")

    def _check_runtime(self) -> None:
        """``score_chunk_size``, ``prefill_chunk_size`` and ``attention_kernel``; the layout (`layout`: ``layer_budgets``
        other than a named spread is read into its per-layer weights, `layer_weights`, and ``head_budgets``).

        Raises:
            ConfigError: the first value out of range, naming it and what is allowed.
        """
        check_count("score_chunk_size", self.score_chunk_size, maximum=None, allowed="an integer >= 1")
        if self.score_chunk_size > MAX_TOKENS:
            raise ConfigError(f"score_chunk_size={short(self.score_chunk_size)} is too large; allowed: an integer from "
                              f"1 to {MAX_TOKENS}")
        check_count("prefill_chunk_size", self.prefill_chunk_size, minimum=0, maximum=MAX_TOKENS,
                    allowed=f"an integer from 1 to {MAX_TOKENS} (tokens per forward pass), or 0 (the whole prompt in "
                            "one pass)")
        # made here, not through the spec cache: a path is read afresh, into the weights the config then holds
        object.__setattr__(self, "layer_budgets", LayoutSpec(*_spec_values(self, LayoutSpec)).layer_budgets)
        if not isinstance(self.attention_kernel, str) or self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(
                f"attention_kernel={short(self.attention_kernel)} is not supported; allowed: {', '.join(ATTENTION_KERNELS)}"
            )

    def _check_decode_kernel(self) -> None:
        """``attention_kernel='triton'`` with a part the Triton op does not read, declared here once (``auto`` falls
        back to the torch form for them, `h2o_compress.cache.backends`): an adaptive layer's pool
        (``head_budgets``), the 8-bit tokens' low planes (``high_bits_fraction``) and calibrated key offsets.

        Raises:
            ConfigError: naming the part and what is allowed.
        """
        if self.attention_kernel != "triton":
            return
        unread = (
            (self.head_budgets == "adaptive", ConfigError(
                "head_budgets='adaptive' with attention_kernel='triton': the Triton op reads per-head slots and an "
                "adaptive layer pools them; allowed: attention_kernel='auto' or 'torch'")),
            (self.high_bits_fraction > 0, ConfigError(
                f"high_bits_fraction={self.high_bits_fraction!r} runs the torch decode step (the Triton op does not "
                "read the 8-bit tokens' low planes); allowed: attention_kernel 'auto' or 'torch', or high_bits_fraction 0")),
            (self.key_offsets != "none", key_offsets_conflict(
                "attention_kernel='triton' (the op does not read the offsets)", "attention_kernel 'auto' or 'torch'")),
        )
        for part_set, error in unread:
            if part_set:
                raise error

    def _check_head_budgets(self) -> None:
        """``head_budgets='adaptive'`` (the layout checks the value) with a policy that ranks across heads."""
        if self.head_budgets != "adaptive":
            return
        if not POLICIES[self.policy].shares_heads and self.policy != "full":
            raise ConfigError(
                f"head_budgets='adaptive' with policy={self.policy!r}: it ranks every head's tokens alike, so there is "
                f"nothing to share between heads; allowed policies: {', '.join(policy_names(shares_heads=True))}"
            )

    def _check_calibration(self) -> None:
        """``calibration``: a path (str), given only where something reads it (a policy that needs one, or
        ``key_offsets='calibrated'``). Whether the model has a calibration is checked when its cache is made
        (`h2o_compress.persistence.calibration_file.calibration_for`). Raises ConfigError."""
        if self.calibration is not None and (not isinstance(self.calibration, str) or not self.calibration.strip()
                                             or "\x00" in self.calibration):
            raise ConfigError(f"calibration={short(self.calibration)} is invalid; allowed: the path of a file written "
                              "by h2o-compress calibrate")
        if self.calibration is not None and not POLICIES[self.policy].needs_calibration and self.key_offsets == "none":
            raise ConfigError(f"calibration={short(self.calibration)} is not used by policy={self.policy!r}; allowed: "
                              f"policy {', '.join(policy_names(needs_calibration=True))}, or key_offsets "
                              "'calibrated' (4- or 8-bit int keys), or no calibration")

    def _check_key_offsets(self) -> None:
        """``key_offsets='calibrated'`` (the storage checks the value, the keys' format and the 8-bit share; the
        decode kernel `_check_decode_kernel`) with one slot per head (``head_budgets='uniform'``). Whether the
        model's calibration holds key statistics is checked when its cache is made. Raises ConfigError."""
        if self.key_offsets != "none" and self.head_budgets != "uniform":
            raise key_offsets_conflict(f"head_budgets={self.head_budgets!r}", "head_budgets 'uniform'")

    def _check_policy_options(self) -> None:
        """``policy_options``: a mapping of option names no field of this class holds to values, copied with
        ``None`` and ``False`` (not given: the policy's default) dropped. Whether the policy takes each, and the
        values, the policy checks (`eviction_policy`).

        Raises:
            ConfigError: not such a mapping, or a name that is a field of its own or that no registered policy takes.
        """
        options = self.policy_options
        if not isinstance(options, Mapping) or not all(isinstance(name, str) for name in options):
            raise ConfigError(f"policy_options={short(options)} is invalid; allowed: a mapping of policy option "
                              "names to values")
        for name in options:
            if name in FIELD_NAMES:
                raise ConfigError(f"policy_options holds {short(name)}, a field of its own; allowed: "
                                  f"CompressionConfig({name}=...)")
            if name not in POLICY_OPTIONS:
                extra = unfielded_policy_options()
                raise ConfigError(f"policy_options holds {short(name)}, an option no registered policy takes; "
                                  f"allowed: {', '.join(extra) or 'none (no policy declares one)'}")
        given = {name: value for name, value in options.items() if value is not None and value is not False}
        object.__setattr__(self, "policy_options", given)

    @classmethod
    def from_values(cls, values: Mapping) -> CompressionConfig:
        """A config from settings by field name or policy option name (CLI flags, config files): an option of a
        policy without a field of its own goes into ``policy_options`` (``None``: not given), the rest are fields.

        Raises:
            ConfigError: see the class; TypeError: a name that is neither.
        """
        unfielded = unfielded_policy_options()
        settings = {name: value for name, value in values.items() if name not in unfielded}
        options = {name: value for name, value in values.items() if name in unfielded and value is not None}
        if options:
            given = settings.get("policy_options") or {}
            settings["policy_options"] = {**given, **options} if isinstance(given, Mapping) else given
        return cls(**settings)

    def options(self) -> dict:
        """The policy options set, by config name (a copy of ``policy_options``)."""
        return dict(self.policy_options)

    @property
    def evicts_any(self) -> bool:
        """Whether this setting can evict at all (a policy other than ``full`` and a budget below everything)."""
        return self.policy != "full" and not (self.budget_is_fraction and self.budget >= 1)

    @property
    def storage(self) -> StorageSpec:
        """How keys and values are stored: a [`StorageSpec`][h2o_compress.formats.storage.StorageSpec] of this
        config's storage fields (``kv_bits``, ``k_bits``, ``v_bits``, ``quant``, ``group_size``, ``residual``,
        ``rotate``, ``high_bits_fraction``, ``key_offsets``), made (so checked) once per set of values
        (`_made_spec`)."""
        return _made_spec(StorageSpec, _spec_values(self, StorageSpec))

    @property
    def layout(self) -> LayoutSpec:
        """How the capacity is spread over layers and heads: a [`LayoutSpec`][h2o_compress.layout.LayoutSpec] of
        ``layer_budgets`` and ``head_budgets``, made (so checked) once per set of values (`_made_spec`)."""
        return _made_spec(LayoutSpec, _spec_values(self, LayoutSpec))

    @property
    def key_bits(self) -> int:
        """Bits of stored keys (``k_bits`` if set, else ``kv_bits``; `storage`)."""
        return self.storage.key_bits

    @property
    def value_bits(self) -> int:
        """Bits of stored values (``v_bits`` if set, else ``kv_bits``; `storage`)."""
        return self.storage.value_bits

    @property
    def format(self):
        """The quantization format family of ``quant`` (a [`KVQuantizer`][h2o_compress.formats.KVQuantizer] class;
        `storage`)."""
        return self.storage.format

    @property
    def compilable(self) -> bool:
        """Whether the decode step can be traced by ``torch.compile``: 16 bits, or a format that declares it
        (`storage`)."""
        return self.storage.compilable

    @property
    def quantized(self) -> bool:
        """True when keys or values are stored below 16 bits (`storage`)."""
        return self.storage.quantized

    @property
    def sinks(self) -> int:
        """Number of attention-sink tokens always kept."""
        if self.sink_tokens is not None:
            return self.sink_tokens
        return 4 if self.policy == "sink" else 0

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
        means unbounded.

        Raises:
            ConfigError: a fractional budget below 1 with no known length.
        """
        return clamp_capacity(self.capacity(max_length), max_length)

    def eviction_policy(self):
        """A fresh [`EvictionPolicy`][h2o_compress.policies.EvictionPolicy] of this setting (``policy`` with its heavy ratio,
        sinks and its own options, [`options`][h2o_compress.config.CompressionConfig.options]): what each cache layer
        ranks by."""
        return make_policy(self.policy, self.heavy_ratio, self.sink_tokens, **self.options())

    def min_layer_capacity(self, capacity: int) -> int:
        """The smallest capacity (tokens per KV head, at most ``capacity``) whose split leaves a recent window of
        at least one token (``sink_tokens + 1`` for a heavy ratio below 1), or, for a split without a recent
        window (``heavy_ratio=1``, compress-then-ask), that holds the sinks (at least one token): the floor of a
        layer whose budget is spread (``layer_budgets``)."""
        policy = self.eviction_policy()
        if policy.recent_window(capacity) < 1:  # no recent window at all (heavy_ratio 1): the sinks, or one token
            return min(capacity, max(1, self.sinks))
        return next(c for c in range(1, capacity + 1) if policy.recent_window(c) >= 1)

    def layer_capacities(self, capacity: int | None, num_layers: int) -> list[int | None]:
        """Capacity of each of ``num_layers`` layers for a per-layer ``capacity`` ([`capacity`][h2o_compress.config.CompressionConfig.capacity]), with the same
        total ``num_layers x capacity`` (see ``layer_budgets``; ``global`` before any scores: uniform); ``None``
        (unbounded) stays ``None``. The layout spreads it ([`LayoutSpec.layer_capacities`][h2o_compress.layout.LayoutSpec.layer_capacities]), each
        layer at least [`min_layer_capacity`][h2o_compress.config.CompressionConfig.min_layer_capacity]."""
        return self.layout.layer_capacities(capacity, num_layers, self.min_layer_capacity)

    def to_dict(self) -> dict:
        """Plain-dict form (JSON-serialisable) that earlier versions wrote and read alike: the fields, the options
        of `LEGACY_OPTIONS` as settings of their own (after ``head_budgets``; their value or the one of not set),
        and ``policy_options`` only where it holds another option."""
        values, options = asdict(self), dict(self.policy_options)
        del values["policy_options"]
        legacy = {name: options.pop(name, unset) for name, unset in LEGACY_OPTIONS.items()}
        at = list(values).index("head_budgets") + 1
        values = dict([*list(values.items())[:at], *legacy.items(), *list(values.items())[at:]])
        return values | {"policy_options": options} if options else values

    def __getattr__(self, name: str):
        """An option of `LEGACY_OPTIONS` read as the field it was in earlier versions: its value in
        ``policy_options``, or the value of not set.

        Raises:
            AttributeError: any other missing name.
        """
        if name in LEGACY_OPTIONS and "policy_options" in self.__dict__:
            return self.__dict__["policy_options"].get(name, LEGACY_OPTIONS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __hash__(self) -> int:
        """Of every field (``policy_options`` as its items): equal configs hash alike, so a config can be a key."""
        return hash(tuple(frozenset(self.policy_options.items()) if f.name == "policy_options"
                          else getattr(self, f.name) for f in fields(self)))


def _taking_legacy_options(init):
    """The dataclass's ``init`` taking the keywords of `LEGACY_OPTIONS` as well, each (where given: not ``None``
    or ``False``) into ``policy_options``, over an entry of the same name there."""
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        legacy = {name: kwargs.pop(name) for name in LEGACY_OPTIONS if name in kwargs}
        legacy = {name: value for name, value in legacy.items() if value is not None and value is not False}
        given = kwargs.get("policy_options") or {}
        if legacy and isinstance(given, Mapping):
            kwargs["policy_options"] = {**given, **legacy}
        init(self, *args, **kwargs)
    return __init__


CompressionConfig.__init__ = _taking_legacy_options(CompressionConfig.__init__)


def _spec_values(config: CompressionConfig, kind) -> tuple:
    """The values of ``config``'s fields that make up the spec ``kind`` (a frozen dataclass of fields of the config)."""
    return tuple(getattr(config, f.name) for f in fields(kind))


def _typed(value):
    """``value`` with its type, inside tuples too: the spec cache's key, so that ``1``, ``1.0`` and ``True`` (equal
    and hashed alike) are checked and kept apart."""
    return tuple(map(_typed, value)) if isinstance(value, tuple) else (type(value), value)


@functools.lru_cache(maxsize=256)
def _cached_spec(kind, typed: tuple, values: tuple):
    """``kind(*values)``, cached by ``typed`` (`_typed` of the values) as well."""
    return kind(*values)


def _made_spec(kind, values: tuple):
    """The spec ``kind`` of ``values`` (`_spec_values`), made (so checked) once per set of values and types; values
    that cannot be hashed (refused by the spec, or a list of layer weights) are made each time."""
    typed = tuple(map(_typed, values))
    try:
        hash(typed)
    except TypeError:
        return kind(*values)
    return _cached_spec(kind, typed, values)


def clamp_capacity(capacity: int | None, max_length: int | None) -> int | None:
    """``capacity`` (tokens per layer and KV head; ``None``: unbounded) at most ``max_length`` (the tokens a cache
    can see; ``None``: not known): storage never exceeds what the cache can see."""
    return capacity if capacity is None or max_length is None else min(capacity, max_length)


#: The names of the [`CompressionConfig`][h2o_compress.config.CompressionConfig] fields, in order.
FIELD_NAMES = tuple(f.name for f in fields(CompressionConfig))


def unfielded_policy_options() -> tuple[str, ...]:
    """The registered policies' option names that have no field of their own (`POLICY_OPTIONS` less
    `FIELD_NAMES`): those ``policy_options`` carries, and config files and the CLI route there."""
    return tuple(name for name in POLICY_OPTIONS if name not in FIELD_NAMES)


def check_usable(config: CompressionConfig, capacity: int | None = None, frozen: bool = False) -> CompressionConfig:
    """Refuse settings that are valid field by field but make no sense together (what the CLI runs first).

    - ``policy="full"`` with a budget other than 1.0: the budget would be ignored silently.
    - ``heavy_ratio`` of 1 with ``h2o``/``h2o-mean``: no recent window, so the newest token (the one being
      generated from) could be evicted and the text degenerates ("of of of ...").
    - a capacity (``capacity``, or an integer budget) whose split leaves no recent window, e.g.
      ``sink_tokens=50`` with ``budget=20``.

    With ``frozen`` (compress-then-ask: the compressed context never evicts again, each question and answer is
    added to a copy that grows) the two recent-window refusals do not apply: there is no newest token to lose, and
    KVzip's own setting keeps no recent window (``heavy_ratio=1`` with ``sink_tokens=4``).

    The choice is to refuse, not to change the split: the eviction policies keep exactly the split documented
    in DESIGN.md §2. The Python API (``CompressionConfig`` and ``make_cache``) still accepts these settings for
    experiments.

    Args:
        config: the setting.
        capacity: tokens per layer and KV head the cache will keep, when known (``None``: unbounded, or not yet
            known; an integer budget is then used).
        frozen: the cache holds a context compressed once, then asked about (no decode eviction).

    Returns:
        ``config``.

    Raises:
        ConfigError: naming the values and what is allowed.
    """
    if config.policy == "full":
        if config.budget != 1:
            raise ConfigError(
                f"policy='full' keeps every token, so budget={config.budget!r} would be ignored; allowed: budget 1.0 "
                f"with policy full, or another policy ({', '.join(n for n in POLICIES if n != 'full')}) for a smaller budget"
            )
        return config
    if frozen:
        return config
    if POLICIES[config.policy].needs_scores and config.heavy_ratio >= 1:
        raise ConfigError(
            f"heavy_ratio={config.heavy_ratio!r} leaves no recent window (the newest tokens could be evicted); "
            "allowed: a heavy ratio in [0, 1)"
        )
    if capacity is None and not config.budget_is_fraction:
        capacity = int(config.budget)
    if capacity is not None:
        policy = config.eviction_policy()
        if policy.recent_window(capacity) < 1:
            raise ConfigError(
                f"a capacity of {capacity} tokens (budget={config.budget!r}) with sink_tokens={config.sinks} and "
                f"heavy_ratio={config.heavy_ratio!r} leaves no recent window; allowed: a budget larger than the "
                "sinks plus the heavy hitters (at least one recent token)"
            )
    return config


DEFAULT_QUANT = CompressionConfig.quant  # the default format: giving it changes nothing


def check_format_options(config: CompressionConfig, given) -> None:
    """Refuse storage-format options the user gave (``given``: the field names set on the command line or in a
    config file) that the bits make moot, so they would be ignored silently: ``quant`` other than ``int`` or
    ``rotate`` with 16-bit keys and values (nothing is quantized), and ``rotate`` with a bitsandbytes format (it
    rotates before ``int`` quantization only). The CLI skips this where the planner picks the bits (``generate
    --memory-limit``) or a loaded cache brings its own setting (``--load-cache``).

    Raises:
        ConfigError: naming the option, the bits and what is allowed.
    """
    unquantized = config.key_bits == 16 and config.value_bits == 16
    if "quant" in given and config.quant != DEFAULT_QUANT and unquantized:
        raise ConfigError(
            f"quant={config.quant!r} quantizes nothing with 16-bit keys and values, so it would be ignored; allowed: "
            "kv_bits 4 or 8 (or k_bits / v_bits) with it"
        )
    if "rotate" in given and config.rotate and (unquantized or not config.format.rotates):
        reason = "16-bit keys and values" if unquantized else f"quant={config.quant!r}"
        raise ConfigError(
            f"rotate=True rotates before int quantization, which {reason} does not run, so it would be ignored; "
            f"allowed: rotate with kv_bits 4 or 8 and quant {', '.join(repr(n) for n, f in FORMATS.items() if f.rotates)}, "
            "or rotate False"
        )
