"""`CompressionConfig`: the one object that says how the KV cache is compressed.

Semantics follow ``DESIGN.md`` §2: ``budget`` is a fraction of the sequence length the cache will see
(``capacity = max(ceil(budget * length), min_capacity)`` tokens per layer and KV head, and no eviction at all
for a sequence of at most ``min_capacity`` tokens) or, when an integer >= 1, an absolute capacity in tokens.
``heavy_ratio`` of the capacity goes to heavy hitters, the rest to the recent window
(H2O, Zhang et al. 2023, arXiv 2306.14048, §4).
"""

from __future__ import annotations

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


@dataclass
class CompressionConfig:
    """How to compress the KV cache: an eviction policy followed by a quantizer.

    The one public entry of a setting: every setting is a flat field here (the keywords, config files, CLI flags and
    saved caches name them so). The storage fields make up [`storage`][h2o_compress.config.CompressionConfig.storage]
    (a [`StorageSpec`][h2o_compress.formats.storage.StorageSpec]) and ``layer_budgets`` / ``head_budgets``
    [`layout`][h2o_compress.config.CompressionConfig.layout] (a [`LayoutSpec`][h2o_compress.layout.LayoutSpec]); each
    checks its own fields, and this class checks the rest and what combines the parts.

    Args:
        policy: eviction policy name: ``h2o`` (heavy hitters + recent window), ``h2o-mean`` (heavy hitters
            ranked by mean instead of summed attention), ``vatp`` (heavy hitters ranked by accumulated attention x
            value norm), ``local`` (recent window only), ``sink`` (StreamingLLM attention sinks + recent window),
            ``full`` (no eviction), or any other name of `h2o_compress.policies.POLICIES`.
        budget: fraction in (0, 1] of the sequence length the cache will see, or an integer >= 1 giving the
            capacity in tokens per layer and KV head. ``1.0`` never evicts.
        min_capacity: the floor of a fractional budget, in tokens per layer and KV head: a sequence of at most
            ``min_capacity`` tokens (prompt + new tokens) is never evicted, and a longer one keeps
            ``max(ceil(budget x length), min_capacity)`` tokens, so a short prompt never loses its own words to
            save a few kilobytes (as kvpress's ``DecodingPress`` compresses only past a target size). ``0``: off
            (``budget x length`` alone). A budget in tokens is unaffected. ``None`` (default): 192
            (``DEFAULT_MIN_CAPACITY``, chosen on the tuning prompts: docs/DESIGN.md §2).
        heavy_ratio: share of the capacity given to heavy hitters, in [0, 1] (paper: 0.5).
        sink_tokens: number of first tokens always kept (attention sinks). ``None`` means 4 for the ``sink``
            policy and 0 otherwise.
        kv_bits: bits of stored keys and values: 16 (no quantization), 8 or 4.
        k_bits: bits of the keys, overriding ``kv_bits`` (keys are more sensitive: KIVI, llama.cpp #7412).
        v_bits: bits of the values, overriding ``kv_bits``.
        quant: quantization format: ``int`` (group-wise asymmetric integers, ours), ``nf4``/``fp4``
            (bitsandbytes 4-bit; an 8-bit tensor then uses bitsandbytes' blockwise 8-bit) or
            ``int8-blockwise`` (bitsandbytes blockwise 8-bit).
        group_size: elements of ``head_dim`` sharing one scale and zero point: 32, 64 or 128.
        residual: newest tokens always kept in full precision (the window holds ``residual`` to
            ``2 x residual - 1`` tokens and is quantized in blocks, each token once: KIVI's residual).
        rotate: apply an orthogonal Hadamard rotation along ``head_dim`` before ``int`` quantization (undone
            exactly after dequantization); spreads outliers across groups (QuaRot-style).
        score_chunk_size: queries per chunk when prefill attention probabilities are computed for scoring.
        prefill_chunk_size: tokens per forward pass when a prompt is prefilled (`h2o_compress.runtime.prefill`):
            a longer prompt is fed in chunks of this many tokens, the cache scoring and evicting after each (as the
            streaming evaluation reads a text), so the model's activations (MLP intermediates, residual stream,
            attention over ``capacity + chunk`` keys) stay bounded by the chunk instead of growing with the prompt.
            ``0``: the whole prompt in one pass. A prompt of at most this many tokens runs in one pass either way.
            Default 512 (``DEFAULT_PREFILL_CHUNK``). A runtime choice: with budget 1.0 it changes the logits only
            by fp32 rounding; with eviction, tokens are scored and evicted before the whole prompt is read.
        attention_kernel: how a decode step runs over the cache: ``auto`` (on CPU, the whole step of a layer in
            one call of the native kernel of `h2o_compress.attention.cpu`, built once with the system C
            compiler; on CUDA, the Triton op of `h2o_compress.attention.slot_attention`: attention and H2O
            scoring over the slots in two launches, traced by ``torch.compile``; elsewhere, or without a compiler
            or Triton, the torch form), ``torch`` (the torch form: torch code over the slots, which
            ``torch.compile`` fuses) or ``triton`` (the Triton op always: an error where it cannot run; on the CPU
            only under ``TRITON_INTERPRET=1``). All keep the same tokens. A runtime choice: it does not change
            what is kept or stored.
        layer_budgets: how the capacity is spread over the layers under the same total: ``uniform`` (every layer
            the same) or ``pyramid`` (PyramidKV, Cai et al. 2024, arXiv 2406.02069 §3.2: an arithmetic sequence
            from ``2C - C/20`` tokens at the first layer down to ``C/20`` at the last, each at least the smallest
            capacity that leaves a recent window; lower layers attend broadly, upper ones to few tokens) or
            ``global`` (KVzip's allocation, Kim et al. 2025, arXiv 2505.23416 §3.3: with ``kvzip`` or ``lookahead``,
            whose scoring pass runs before the cache is built, the ``num_layers x kv_heads x C`` best-scored
            (layer, head, token) entries over the whole model are counted per layer, and each layer gets its
            share of the same total: `global_layer_capacities`; where a prompt
            is read without that pass, the layers stay uniform), or per-layer weights: a sequence of
            ``num_layers`` positive numbers, or the path of a JSON file holding one (a list, or ``{"weights":
            [...]}``; read once, here, and kept as the tuple), each layer getting its weight's share of the total
            (at least the capacity that leaves a recent window). Each layer allocates only its own capacity, so the
            bytes follow ([`layer_capacities`][h2o_compress.config.CompressionConfig.layer_capacities]; ``global`` holds uniform's total).
        high_bits_fraction: share in [0, 1] of each layer's stored tokens kept at 8 bits, the rest at 4 (mixed
            precision by importance, MiKV: Yang et al. 2024, arXiv 2402.18096): the top ``ceil(fraction x
            slots)`` by the policy's rank keep the low plane of their 8-bit code (`h2o_compress.cache.refinement`).
            0 (default): off. Needs 4-bit ``int`` keys or values; the decode step is the torch form (not
            ``attention_kernel='triton'``). Composes with ``head_budgets='adaptive'`` (the rows shared over the
            pool) and any ``layer_budgets`` (``global``: each layer's share of the uniform layers' rows).
        head_budgets: how a layer's capacity is spread over its KV heads: ``uniform`` (``C`` tokens per head) or
            ``adaptive`` (Ada-KV, Feng et al. 2024, arXiv 2407.11550 §3: ``kv_heads x C`` tokens per layer, each
            head keeping its own recent window and sinks, the heavy-hitter rest going to the highest-ranked tokens
            over all heads together). The layer's tokens live in one slot pool tagged by head
            ([`SlotPool`][h2o_compress.cache.SlotPool]), so evicted tokens really free memory and the bytes
            are uniform's plus one int8 tag per slot. Composes with ``layer_budgets`` (which gives each layer's
            ``C``); needs a policy that ranks across heads (``shares_heads``); decode steps run the torch form
            (``attention_kernel`` ``auto`` falls back to it, ``triton`` is refused).
        evict_chat_header: with ``kvzip`` or ``lookahead``, the chat template's header at the start of a context
            (system prompt, user-turn opening) gets score 0 beyond the sinks, so it is evicted first, as kvpress's
            ``KVzipPress`` does (it scores only the reconstructed context); ``False`` (default): scored like the
            rest. See docs/guide/compress-then-ask.md for when it helps.
        lookahead_request: with ``policy="lookahead"``, what the model is asked about a context before it is
            compressed ([`LookaheadPolicy`][h2o_compress.policies.LookaheadPolicy]); ``None`` (default): "List the
            important facts and numbers in the text above.". 1 to 1,000 characters.
        forgetting_factor: with ``policy="a2sf"``, the factor in (0, 1] by which each query scales the held
            scores before adding its attention ([`A2SFPolicy`][h2o_compress.policies.A2SFPolicy]); ``None``
            (default): 0.8.
        policy_options: the options of a policy that has no field here of its own, by the config name it
            declares (`h2o_compress.policies.policy_option`; also as keys of a config file and as CLI flags),
            checked by the policy itself; refused when ``policy`` does not take one. Empty (default): the policy's
            defaults. The three options above are fields of their own (``to_dict`` lists ``policy_options`` only
            when it holds one).
        calibration: the path of a calibration file written by ``h2o-compress calibrate`` for the model
            (`h2o_compress.calibration.calibrate`), holding ``policy="calibrated"``'s weights
            ([`CalibratedPolicy`][h2o_compress.policies.CalibratedPolicy]). ``None`` (default): the model's own
            file in the cache root, where ``calibrate`` writes it without ``--out``. Read when the cache is made,
            and refused there for a model it was not fitted on.
        key_offsets: ``none`` (default) or ``calibrated``: 4- or 8-bit ``int`` keys are stored around the mean
            pre-RoPE key of each layer and KV head that ``h2o-compress calibrate`` measured on the calibration text
            (KVQuant, arXiv 2401.18079 §3.1; `h2o_compress.formats.calibrated.CalibratedKeyQuantizer`), rotated to
            each token's position: the same bytes, about half the 4-bit key error. Read from the calibration file
            (``calibration``, else the model's own file or the one shipped for it) when the cache is made; needs
            ``int`` keys of 4 or 8 bits, ``head_budgets='uniform'``, ``high_bits_fraction=0`` and a decode step
            other than ``attention_kernel='triton'`` (its layers decode in the torch form). A cache with it cannot
            be saved.

    Raises:
        ConfigError: any value out of range, naming the value and what is allowed.
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
    lookahead_request: str | None = None
    forgetting_factor: float | None = None
    evict_chat_header: bool = False
    calibration: str | None = None
    key_offsets: str = StorageSpec.key_offsets
    policy_options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check every field: the eviction fields, the storage (`storage`, which checks its own fields), the runtime
        fields and the layout (`layout`, which reads ``layer_budgets`` weights into a tuple), then what combines the
        parts: the options of the policy, and the head, precision, key-offset and layer spreads with the policy and
        the decode kernel.

        Raises:
            ConfigError: the first value out of range, naming it and what is allowed.
        """
        self._check_eviction()
        self._spec(StorageSpec)  # the storage checks its own fields
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
        """The eviction fields: ``policy``, ``evict_chat_header``, ``budget``, ``min_capacity``, ``heavy_ratio`` and
        ``sink_tokens``.

        Raises:
            ConfigError: the first value out of range, naming it and what is allowed.
        """
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {short(self.policy)}; allowed: {', '.join(sorted(POLICIES))}")
        if not isinstance(self.evict_chat_header, bool):
            raise ConfigError(f"evict_chat_header={short(self.evict_chat_header)} is invalid; allowed: True or False")
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
        self.layer_budgets = self.layout.layer_budgets
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
        """``policy_options``: a mapping of option names no field of this class holds to values; ``None`` (not
        given) dropped. Whether the policy takes each, and the values, the policy checks (`eviction_policy`).

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
        self.policy_options = {name: value for name, value in options.items() if value is not None}

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
        """The policy options set, by config name: those with a field of their own (``lookahead_request``,
        ``forgetting_factor``, ``evict_chat_header``: ``None`` or ``False`` when not set) and ``policy_options``."""
        return {**{name: getattr(self, name) for name in POLICY_OPTIONS if name in FIELD_NAMES}, **self.policy_options}

    @property
    def evicts_any(self) -> bool:
        """Whether this setting can evict at all (a policy other than ``full`` and a budget below everything)."""
        return self.policy != "full" and not (self.budget_is_fraction and self.budget >= 1)

    @property
    def storage(self) -> StorageSpec:
        """How keys and values are stored: a [`StorageSpec`][h2o_compress.formats.storage.StorageSpec] of this
        config's storage fields (``kv_bits``, ``k_bits``, ``v_bits``, ``quant``, ``group_size``, ``residual``,
        ``rotate``, ``high_bits_fraction``, ``key_offsets``), made (so checked) once and again only after a field of
        it changed."""
        return self._spec(StorageSpec)

    @property
    def layout(self) -> LayoutSpec:
        """How the capacity is spread over layers and heads: a [`LayoutSpec`][h2o_compress.layout.LayoutSpec] of
        ``layer_budgets`` and ``head_budgets``, made (so checked) once and again only after either changed."""
        return self._spec(LayoutSpec)

    def _spec(self, kind):
        """The ``kind`` spec (a frozen dataclass whose fields are fields of this config) of the current values."""
        values = tuple(getattr(self, f.name) for f in fields(kind))
        specs = self.__dict__.setdefault("_specs", {})  # not a field: to_dict, ==, repr and replace ignore it
        made = specs.get(kind)
        if made is None or made[0] != values:
            spec = kind(*values)
            made = specs[kind] = (tuple(getattr(spec, f.name) for f in fields(kind)), spec)
        return made[1]

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
        """Plain-dict form (JSON-serialisable); ``policy_options`` only where it holds an option, so a setting
        without one reads as it did before the field existed."""
        values = asdict(self)
        if not values["policy_options"]:
            del values["policy_options"]
        return values


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
