"""Memory-budget planner: a memory limit -> a compression setting, and a setting -> bytes.

Cache bytes are exact: they come from the same layer and quantizer objects the cache is built from
(:func:`h2o_compress.cache.build_layers`), at the end state of a :func:`h2o_compress.generate` run
(DESIGN.md §2, Memory accounting). Weight bytes are exact for 16-bit weights and follow bitsandbytes' formats
for 8/4-bit ones; the activation/workspace figure is an estimate of the largest forward pass (see
:func:`workspace_bytes`). Known models plan offline (:mod:`h2o_compress.known_models`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

import torch

from .cache import build_layers
from .compiled import compiles_by_default
from .config import ALLOWED_GROUP_SIZES, MAX_RESIDUAL, CompressionConfig
from .errors import ConfigError, short
from .files import read_json
from .policies import POLICIES
from .attention.launch import decode_scratch_bytes, launch_for
from .known_models import ModelSpec, resolve_model
from .models import ModelDims, resolve_dtype
from .weights import loaded_weights_bits

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_BUDGETS = (1.0, 0.5, 0.25, 0.1)
WEIGHT_BITS = (16, 8, 4)
NF4_BLOCK = 64  # bitsandbytes' default 4-bit block: one fp32 absmax per 64 weights (no double quantization)
MAX_BATCH = 2**20
MAX_CONTEXT = 2**24
# Quality metrics a profile report may carry: lower is better for the first group, higher for the second.
LOWER_BETTER = ("ppl_ratio", "perplexity_ratio", "ppl", "perplexity")
HIGHER_BETTER = ("agreement", "greedy_agreement", "accuracy", "passkey_accuracy", "retrieval")


def parse_memory(value) -> int:
    """``"24GiB"``, ``"2GB"``, ``"512MiB"``, ``"1.5 GiB"`` or an int -> bytes (GB = 10**9, GiB = 2**30).

    Raises:
        ConfigError: not a positive amount with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    allowed = "a positive amount like 24GiB, 2GB or 512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", value) if isinstance(value, str) else None
    amount = float(match.group(1)) * UNITS.get(match.group(2).lower(), 0) if match else 0.0
    amount = int(amount) if math.isfinite(amount) and amount < 2**80 else 0
    if amount < 1:
        raise ConfigError(f"memory {short(value)} is invalid; allowed: {allowed} (at most 2**80 bytes)")
    return amount


def parse_list(text: str, name: str, convert=int) -> tuple:
    """``"16,8,4"`` -> ``(16, 8, 4)`` with ``convert`` applied to each item.

    Raises:
        ConfigError: an empty list or an item ``convert`` rejects (``ValueError``/``ConfigError``).
    """
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{name}={short(text)} is empty; allowed: a comma-separated list")
    try:
        return tuple(convert(item) for item in items)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{name}={short(text)} is invalid ({exc}); allowed: a comma-separated list") from None


def format_bytes(n: int) -> str:
    """Bytes in binary units, e.g. ``12.55 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheBytes:
    """What a :class:`~h2o_compress.CompressedCache` holds, over all layers (bytes) and per layer/head (tokens).

    The cache allocates its buffers once, at the first token (:mod:`h2o_compress.cache`), so these figures hold
    from the prefill to the last decode step.

    Attributes:
        capacity: tokens kept per layer and KV head, on average over the layers (``None``: unbounded).
        kept: tokens held per layer and KV head after the run (``min(capacity, tokens fed)``).
        slots: slots of the first layer's store (``capacity - residual + 1``, or ``max_length - residual + 1``
            unbounded; with pyramid layer budgets each layer has its own).
        residual: slots of the full-precision ring window.
        packed: bytes of quantized (or 16-bit stored) keys and values, every slot.
        scales: bytes of scales, zero points and absmax values, every slot.
        window: bytes of the ring window's keys and values.
        scores: bytes of the fp32 H2O score accumulators (store and ring; bounded caches of scoring policies).
        positions: bytes of the int32 positions (store and ring), of the 8-bit tokens' slot indices
            (``high_bits_fraction``; their low planes count as ``packed``) and of the int8 head tags of a head-adaptive
            layer's slot pool (``head_budgets="adaptive"``).
        counters: bytes of the per-layer counters (tokens seen, first real token per sequence, finite flag).
    """

    capacity: int | None
    kept: int
    slots: int
    residual: int
    packed: int
    scales: int
    window: int
    scores: int
    positions: int
    counters: int

    @property
    def total(self) -> int:
        """Everything ``cache.nbytes()`` counts (bytes)."""
        return self.packed + self.scales + self.window + self.scores + self.positions + self.counters


_CATEGORIES = (
    ("scores", ("scores",)), ("positions", ("positions", "refine.slots", "owner")), ("window", ("ring.keys", "ring.values")),
    ("packed", (".data", ".x")), ("scales", (".scale_zero", ".absmax")), ("counters", ("seen", "first_real", "finite", "consistent")),
)


def cache_bytes(
    dims: ModelDims, config: CompressionConfig, batch: int, prompt_len: int, decode_steps: int = 0,
    max_length: int | None = None, kv_dtype: torch.dtype = torch.float16,
) -> CacheBytes:
    """Exact ``cache.nbytes()`` of a cache built for ``max_length`` tokens, after a ``prompt_len``-token prefill
    and ``decode_steps`` one-token steps (the buffers are allocated once, so the bytes do not change with them).

    ``generate`` with ``n`` new tokens makes ``n - 1`` decode steps and builds the cache for ``max_length =
    prompt + n``. Built from a real layer allocated on the ``meta`` device (no memory): the same code sizes the
    planner's figures and the cache's buffers.

    Args:
        dims: KV geometry of the model.
        config: the compression setting.
        batch: sequences.
        prompt_len, decode_steps: tokens of the prefill step, number of one-token steps after it.
        max_length: tokens the cache was built for (default ``prompt_len + decode_steps + 1``).
        kv_dtype: dtype of the keys/values the model produces (its compute dtype).

    Raises:
        ConfigError: a group size not dividing ``head_dim``.
    """
    if max_length is None:
        max_length = prompt_len + decode_steps + 1
    capacity = config.capacity(max_length)
    if capacity is not None:
        capacity = min(capacity, max_length)
    empty = torch.empty(batch, dims.kv_heads, 0, dims.head_dim, dtype=kv_dtype, device="meta")
    sizes = {name: 0 for name, _ in _CATEGORIES}
    # every layer alike: size one, count it num_layers times ("global" spreads the same total by the scores, and a
    # layer's bytes are affine in its capacity, so the total is uniform's)
    if config.layer_budgets in ("uniform", "global"):
        layers, repeat = build_layers(config, 1, dims.head_dim, capacity, max_tokens=max_length), dims.num_layers
    else:
        layers, repeat = build_layers(config, dims.num_layers, dims.head_dim, capacity, max_tokens=max_length), 1
    for layer in layers:
        layer.lazy_initialization(empty, empty)
        for name, tensor in layer.tensors().items():
            category = next(c for c, keys in _CATEGORIES if any(name.endswith(k) or name == k for k in keys))
            sizes[category] += tensor.numel() * tensor.element_size() * repeat
    seen = prompt_len + decode_steps
    kept = seen if capacity is None else min(capacity, seen)
    first = layers[0]
    return CacheBytes(capacity=capacity, kept=kept, slots=first.store.slots, residual=first.residual, **sizes)


def weight_bytes(spec: ModelSpec, weights_bits: int, dtype: torch.dtype) -> int:
    """Bytes of the model's weights: exact for a loaded model and for unquantized (``weights_bits=16``) ones.

    8 bits: LLM.int8 (bitsandbytes ``load_in_8bit``): one byte per Linear weight + one fp32 scale per output
    row. 4 bits: NF4/FP4 (``load_in_4bit``): half a byte per Linear weight + one fp32 absmax per 64 weights.
    The output head, embeddings, norms and biases stay in ``dtype``.

    Raises:
        ConfigError: ``weights_bits`` not 16, 8 or 4.
    """
    if weights_bits not in WEIGHT_BITS or isinstance(weights_bits, bool):
        raise ConfigError(f"weights_bits={short(weights_bits)} is not supported; allowed: 16, 8, 4")
    if spec.loaded_bytes is not None:
        return spec.loaded_bytes
    size = _element_size(dtype)
    if weights_bits == 16:
        return spec.num_parameters * size
    rest = (spec.num_parameters - spec.linear_parameters) * size
    if weights_bits == 8:
        return rest + spec.linear_parameters + 4 * spec.linear_rows
    return rest + math.ceil(spec.linear_parameters / 2) + 4 * math.ceil(spec.linear_parameters / NF4_BLOCK)


def _forward_peak(spec: ModelSpec, config: CompressionConfig, batch: int, queries: int, keys: int, size: int) -> int:
    """Estimated live bytes of one forward pass of ``queries`` new tokens against ``keys`` keys per layer."""
    d, tokens = spec.dims, batch * queries
    residual_stream = 4 * tokens * spec.hidden_size * size  # hidden states, normed input, attention/MLP outputs
    qkv = tokens * (d.num_heads + 2 * d.kv_heads) * d.head_dim * size
    # one layer's keys/values as the cache returns them, plus their copies repeated to the query heads (GQA)
    kv = 2 * batch * keys * d.head_dim * (d.kv_heads + (d.num_heads if d.num_heads != d.kv_heads else 0)) * size
    dequant = 2 * batch * keys * d.kv_heads * d.head_dim * 4 if config.quantized else 0  # fp32 (de)quantize temporaries
    scoring = 0
    if POLICIES[config.policy].needs_scores:  # two fp32 [chunk x keys] tensors per query head, fp32 keys
        chunk = min(config.score_chunk_size, queries)
        scoring = batch * keys * 4 * (2 * d.num_heads * chunk + d.kv_heads * d.head_dim)
    mlp = 3 * tokens * spec.intermediate_size * size
    logits = batch * spec.vocab_size * size  # generate() keeps the logits of the last position only
    return residual_stream + max(qkv + kv + dequant + scoring, mlp, logits)


def graph_pool_bytes(spec: ModelSpec, config: CompressionConfig, batch: int, kept: int, dtype: torch.dtype,
                     fused: bool) -> int:
    """Estimated bytes of the CUDA-graph pool of the compiled decode step (``mode="reduce-overhead"``).

    A captured step allocates its intermediate buffers (and its logits output) from the graph's private pool, which
    stays reserved while the graph lives, beside the memory the eager prefill uses: so it adds to the prefill's
    peak instead of sharing it. Estimated as one decode forward pass (1 query per sequence): with the Triton op
    (``fused``) the cache is read in place (its scratch is counted by :func:`workspace_bytes`), without it the step
    materialises the ``kept + 1`` keys and values as attention reads them. An estimate: the pool itself is
    measured on a GPU by ``benchmarks/gpu_throughput.py`` (``graph_pool_bytes`` against this figure).
    """
    return _forward_peak(spec, config, batch, 1, 0 if fused else kept + 1, _element_size(dtype))


def runs_decode_op(config: CompressionConfig, adaptive: bool) -> bool:
    """Whether a CUDA cache with ``config`` decodes through the Triton op (and keeps its per-layer scratch): uniform
    heads (not ``adaptive``: a head-adaptive layer that evicts), no mixed precision, 16 bits or the ``int`` formats
    (the bitsandbytes formats decode eagerly in the torch form), and ``attention_kernel`` other than ``torch``."""
    eager_only = config.quantized and config.quant != "int"
    return (not adaptive and config.high_bits_fraction == 0 and not eager_only
            and config.attention_kernel != "torch")


def workspace_bytes(spec: ModelSpec, config: CompressionConfig, batch: int, prompt_len: int, kept: int,
                    dtype: torch.dtype, slots: int | None = None, residual: int = 0, compiled: bool = False) -> int:
    """Estimated activation/workspace bytes: the larger of the prefill pass (``prompt_len`` queries) and a
    decode step (1 query against ``kept + 1`` keys), plus, given the store's ``slots`` and the ring's
    ``residual``, the scratch every layer of a CUDA cache keeps for the Triton decode op
    (:func:`h2o_compress.attention.launch.decode_scratch_bytes`, for an H100/H200's 132 SMs; a CPU cache does not
    allocate it; a head-adaptive cache, mixed precision and the bitsandbytes formats neither: they decode in the
    torch form, a head-adaptive one reading ``kv_heads x`` the kept tokens per head),
    plus, when ``compiled``, the CUDA-graph pool of the compiled decode step (:func:`graph_pool_bytes`; none for
    the bitsandbytes formats, which decode eagerly).

    Counts the residual stream, q/k/v, one layer's keys/values as attention sees them, fp32 (de)quantization
    temporaries, H2O's chunked fp32 score computation, the MLP intermediates and the logits. Assumes
    memory-efficient attention (no ``queries x keys`` matrix, no padding mask); excludes the CUDA context and
    allocator fragmentation (leave ~0.5-1 GiB for them).
    """
    size = _element_size(dtype)
    scratch = 0
    adaptive = config.head_budgets == "adaptive" and config.capacity(prompt_len + 1) is not None
    eager_only = config.quantized and config.quant != "int"  # bitsandbytes formats: torch form, never compiled
    fused = slots is not None and runs_decode_op(config, adaptive)
    if adaptive:  # torch form only (no Triton scratch); every head's attention reads the whole pool
        kept *= spec.dims.kv_heads
    elif fused:
        d = spec.dims
        with_scores = POLICIES[config.policy].needs_scores and config.capacity(prompt_len + 1) is not None
        block = launch_for(config.key_bits, config.value_bits).block
        scratch = d.num_layers * decode_scratch_bytes(
            batch, d.num_heads, d.kv_heads, d.head_dim, slots, residual, with_scores, block_tokens=block)
    pool = graph_pool_bytes(spec, config, batch, kept, dtype, fused) if compiled and not eager_only else 0
    return scratch + pool + max(
        _forward_peak(spec, config, batch, prompt_len, prompt_len, size),
        _forward_peak(spec, config, batch, 1, kept + 1, size),
    )


@dataclass
class PlanRow:
    """One candidate setting evaluated at the requested batch and lengths (bytes; tokens for lengths).

    ``max_batch`` is the largest batch that fits at the requested lengths, ``max_context`` the longest
    prompt + generation (generation length fixed) that fits at the requested batch, both 0 when none does.
    ``quality`` is the profile report's metric, lower is better (``None`` without a report entry).
    """

    config: CompressionConfig
    cache: CacheBytes
    weight_bytes: int
    workspace_bytes: int
    total_bytes: int
    fits: bool
    max_batch: int
    max_context: int
    quality: float | None = None
    kv_dtype: str = "float16"

    @property
    def label(self) -> str:
        """Short description, e.g. ``h2o 25% int4 g32 r8`` or ``full 32-bit`` (an fp32 cache)."""
        return describe(self.config, self.kv_dtype)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["config"] = self.config.to_dict()
        out["cache"]["total"] = self.cache.total
        out["label"] = self.label
        return out


@dataclass
class PlanReport:
    """The planner's answer: every candidate evaluated, and the recommended one (``None`` if nothing fits).

    ``order`` says how the recommendation was ranked: ``bytes`` (least compressed first) or the profile
    report's path. ``fp16_cache_bytes`` is the uncompressed fp16 cache at the same tokens (DESIGN.md §2).
    ``compiled``: whether the workspace counts the CUDA-graph pool of the compiled decode step
    (:func:`graph_pool_bytes`; rows in a bitsandbytes format decode eagerly and count none).
    """

    model: str
    dims: ModelDims
    memory_limit: int
    batch: int
    prompt_len: int
    gen_len: int
    weights_bits: int
    dtype: str
    weight_bytes: int
    fp16_cache_bytes: int
    model_context: int | None
    rows: list[PlanRow]
    recommended: PlanRow | None
    order: str = "bytes"
    notes: list[str] = field(default_factory=list)
    headroom_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    compiled: bool = False

    @property
    def usable_bytes(self) -> int:
        """The memory a setting may use: the limit less the headroom."""
        return self.memory_limit - self.headroom_bytes

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("rows", "recommended")}
        out["rows"] = [row.to_dict() for row in self.rows]
        out["recommended"] = self.recommended.to_dict() if self.recommended else None
        return out


def describe(config: CompressionConfig, kv_dtype="float16") -> str:
    """``full 16-bit``, ``h2o 25% int4 g32 r4``, ``sink 512 tok k:int8/v:int4 g64 r4``, ``local 50% nf4 g64 r4``.

    Formats per tensor: ``int4``/``int8`` (ours), ``nf4``/``fp4`` and ``bw8`` (bitsandbytes blockwise 8-bit), and
    for unquantized storage the width of ``kv_dtype`` (``16`` for fp16/bf16, ``32`` for an fp32 cache).
    """
    width = 32 if str(kv_dtype).removeprefix("torch.") in ("float32", "fp32") else 16
    if config.policy == "full" or (config.budget_is_fraction and config.budget >= 1):
        head = "full"
    elif config.budget_is_fraction:
        head = f"{config.policy} {config.budget * 100:g}%"
    else:
        head = f"{config.policy} {int(config.budget)} tok"
    if config.layer_budgets != "uniform" and head != "full":
        head += f" {config.layer_budgets} layers" if isinstance(config.layer_budgets, str) else " weighted layers"
    if config.head_budgets != "uniform" and head != "full":
        head += f" {config.head_budgets} heads"
    if not config.quantized:
        return f"{head} {width}-bit"

    def fmt(bits: int) -> str:
        if bits == 16:
            return str(width)
        if config.quant == "int":
            return f"int{bits}"
        return config.quant if bits == 4 else "bw8"

    kind = fmt(config.key_bits) if config.key_bits == config.value_bits else \
        f"k:{fmt(config.key_bits)}/v:{fmt(config.value_bits)}"
    mixed = f" hi8 {config.high_bits_fraction * 100:g}%" if config.high_bits_fraction else ""
    return f"{head} {kind}{mixed} g{config.group_size} r{config.residual}"


def candidates(
    head_dim: int, policies=("h2o",), budgets=DEFAULT_BUDGETS, bits=(16, 8, 4), group_sizes=(32, 128),
    residuals=(CompressionConfig.residual,), quant: str = "int", heavy_ratio: float = 0.5,
    sink_tokens: int | None = None, high_bits_fraction: float = 0.0, head_budgets: str = "uniform",
    layer_budgets="uniform",
) -> list[CompressionConfig]:
    """The candidate grid: every policy x budget x bits x group size x residual, de-duplicated (each evicting
    setting with ``head_budgets`` and ``layer_budgets``).

    A budget of 1.0 (or policy ``full``) becomes the ``full`` policy (no eviction, no scores); 16 bits ignores
    group size and residual; group sizes that do not divide ``head_dim`` are skipped; ``high_bits_fraction``
    applies to the 4-bit candidates (mixed precision by importance).

    Raises:
        ConfigError: an invalid value in any list (from :class:`CompressionConfig`).
    """
    for group in group_sizes:
        if isinstance(group, bool) or group not in ALLOWED_GROUP_SIZES:
            raise ConfigError(f"group size {short(group)} is not supported; allowed: 32, 64, 128")
    for residual in residuals:
        if isinstance(residual, bool) or not isinstance(residual, int) or not 0 <= residual <= MAX_RESIDUAL:
            raise ConfigError(f"residual {short(residual)} is invalid; allowed: an integer from 0 to {MAX_RESIDUAL}")
    seen, out = set(), []
    for policy in policies:
        for budget in budgets:
            full = policy == "full" or (isinstance(budget, float) and budget >= 1)
            for b in bits:
                groups = (ALLOWED_GROUP_SIZES[0],) if b == 16 else [g for g in group_sizes if head_dim % g == 0]
                for group in groups:
                    for residual in (residuals[:1] if b == 16 else residuals):
                        config = CompressionConfig(
                            policy="full" if full else policy, budget=1.0 if full else budget,
                            heavy_ratio=heavy_ratio, sink_tokens=sink_tokens, kv_bits=b, quant=quant,
                            group_size=group, residual=residual, head_budgets="uniform" if full else head_budgets,
                            high_bits_fraction=high_bits_fraction if b == 4 else 0.0,
                            layer_budgets="uniform" if full else layer_budgets,
                        )
                        key = _setting_key(config)
                        if key not in seen:
                            seen.add(key)
                            out.append(config)
    return out


def _setting_key(config: CompressionConfig) -> tuple:
    full = config.policy == "full" or (config.budget_is_fraction and config.budget >= 1)
    quantized = config.quantized
    return (
        "full" if full else config.policy, 1.0 if full else round(float(config.budget), 6),
        config.key_bits, config.value_bits, config.quant if quantized else None,
        config.group_size if quantized else None, config.residual if quantized else None,
        None if full else (config.heavy_ratio, config.sinks),
        None if full or config.head_budgets == "uniform" else config.head_budgets,
    ) + ((config.high_bits_fraction,) if config.high_bits_fraction else ()) + (
        () if full or config.layer_budgets == "uniform" else (config.layer_budgets,))


def load_quality(path, warnings: list | None = None) -> dict[tuple, float]:
    """Quality per setting from a profile report (JSON), lower is better.

    Accepts a list of rows, or an object holding one under ``rows``/``results``/``runs``/``settings``. Each row
    gives the setting (under ``config`` or at top level, :class:`CompressionConfig` field names) and one metric,
    at top level or under ``metrics``: ``ppl_ratio``/``perplexity_ratio``/``ppl``/``perplexity`` (lower is
    better) or ``agreement``/``greedy_agreement``/``accuracy``/``passkey_accuracy``/``retrieval`` (higher is
    better; stored negated).

    A non-finite metric (NaN, Infinity) is ignored, and said in ``warnings`` (a list appended to) when given.

    Raises:
        ConfigError: unreadable file, or no row with a setting and a metric.
    """
    data = read_json(path, "profile report", ConfigError)
    name = short(str(path))
    if isinstance(data, dict):
        data = next((data[k] for k in ("rows", "results", "runs", "settings") if isinstance(data.get(k), list)), [])
    fields = set(CompressionConfig.__dataclass_fields__)
    quality = {}
    for row in data if isinstance(data, list) else []:
        if not isinstance(row, dict):
            continue
        setting = row.get("config") if isinstance(row.get("config"), dict) else row
        metrics = {**row, **row["metrics"]} if isinstance(row.get("metrics"), dict) else row
        metric = next(((k, metrics[k]) for k in LOWER_BETTER + HIGHER_BETTER
                       if isinstance(metrics.get(k), (int, float))), None)
        try:
            config = CompressionConfig(**{k: v for k, v in setting.items() if k in fields})
        except (ConfigError, TypeError):
            continue
        if metric is not None and not _finite(metric[1]):
            if warnings is not None:
                warnings.append(f"profile report {name}: {metric[0]}={metric[1]} of {describe(config)} is not "
                                "finite; that row is ignored")
            continue
        if metric is not None:
            quality[_setting_key(config)] = -metric[1] if metric[0] in HIGHER_BETTER else float(metric[1])
    if not quality:
        raise ConfigError(
            f"profile report {name} has no row with a setting and a quality metric (a finite number); allowed metrics: "
            f"{', '.join(LOWER_BETTER + HIGHER_BETTER)}"
        )
    return quality


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _largest(fits, low: int, high: int) -> int:
    """Largest n in [low, high] with ``fits(n)`` (monotone: true then false), ``low - 1`` if none."""
    if not fits(low):
        return low - 1
    good, step = low, 1
    while good + step <= high and fits(good + step):  # grow geometrically, then bisect
        good, step = good + step, step * 2
    bad = min(good + step, high + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _positive(name: str, value, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigError(f"{name}={short(value)} is invalid; allowed: an integer >= 1, at most {maximum}")
    return value


def parse_headroom(value, limit: int) -> int:
    """Bytes to leave free under ``limit``: ``"10%"`` (a share of it), an amount (``"1GiB"``, bytes), or 0.

    Raises:
        ConfigError: a share outside [0%, 90%], an amount not below the limit, or an unparsable value.
    """
    allowed = "a share like 10% (0% to 90%), an amount below the limit like 1GiB, or 0"
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
        return 0
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = math.nan
        if not 0 <= share <= 90:
            raise ConfigError(f"headroom={short(value)} is invalid; allowed: {allowed}")
        return int(limit * share / 100)
    if isinstance(value, str) and value.strip() == "0":
        return 0
    try:
        amount = parse_memory(value)
    except ConfigError:
        raise ConfigError(f"headroom={short(value)} is invalid; allowed: {allowed}") from None
    if amount >= limit:
        raise ConfigError(f"headroom={short(value)} is not below the memory limit {format_bytes(limit)}; allowed: {allowed}")
    return amount


def plan(
    model, memory, batch: int = 1, prompt_len: int = 2048, gen_len: int = 128, weights_bits: int = 16,
    dtype=None, profile=None, policies=("h2o",), budgets=DEFAULT_BUDGETS, bits=(16, 8, 4),
    group_sizes=(32, 128), residuals=(CompressionConfig.residual,), quant: str = "int", heavy_ratio: float = 0.5,
    sink_tokens: int | None = None, headroom=0, trust_remote_code: bool = False, high_bits_fraction: float = 0.0,
    head_budgets: str = "uniform", layer_budgets="uniform", compiled: bool | None = None,
) -> PlanReport:
    """Evaluate every candidate setting for ``model`` under ``memory`` and recommend one.

    For each candidate (:func:`candidates`): exact cache bytes after ``generate`` with a ``prompt_len``-token
    prompt and ``gen_len`` new tokens at ``batch`` (seen = prompt + gen - 1, capacity from prompt + gen),
    weight bytes, an activation/workspace estimate, whether the sum fits, the largest batch and the longest
    context that fit. The recommendation is the fitting setting of best quality in the ``profile`` report, else
    the least compressed (most cache bytes) that fits.

    Args:
        model: a local model directory, a known model name, a transformers config or a loaded model (then its
            exact weight bytes and dtype are used, and ``weights_bits``/``dtype`` are ignored).
        memory: the limit, bytes or a string like ``"24GiB"``.
        batch, prompt_len, gen_len: sequences, prompt tokens, new tokens.
        weights_bits: 16 (in ``dtype``), 8 (LLM.int8) or 4 (NF4) for a model that is not loaded.
        dtype: compute and KV dtype name (default ``float16``).
        profile: path of a profile report (JSON) giving the quality order (:func:`load_quality`).
        policies, budgets, bits, group_sizes, residuals, quant, heavy_ratio, sink_tokens, high_bits_fraction,
            head_budgets, layer_budgets: the candidate grid (:func:`candidates`).
        headroom: memory left free under ``memory`` for what is not counted (CUDA context, fragmentation):
            ``"10%"``, an amount (``"1GiB"``) or 0 (the default here; ``h2o-compress plan`` uses 10%). A row
            fits when its total is at most ``memory - headroom``.
        trust_remote_code: let a model directory with an ``auto_map`` be read (off: refused).
        compiled: count the CUDA-graph pool of the compiled decode step in the workspace. ``None``: as
            ``generate`` decides by default: for a loaded model, when it is on CUDA in one piece with 16-bit
            weights (:func:`h2o_compress.compiled.compiles_by_default`); otherwise for 16-bit weights (a plan for a
            card: the CUDA default compiles).

    Returns:
        A :class:`PlanReport`, rows ordered by quality (with a profile) or by cache bytes, largest first.

    Raises:
        ModelLoadError: unknown model (the message lists the known ones).
        ConfigError: a bad memory string, headroom, length, batch, bit width, dtype or candidate value (lengths
            at most :data:`MAX_CONTEXT` tokens, batch at most :data:`MAX_BATCH`).
    """
    if compiled is not None and not isinstance(compiled, bool):
        raise ConfigError(f"compiled={short(compiled)} is invalid; allowed: True, False or None (auto)")
    limit = parse_memory(memory)
    reserve = parse_headroom(headroom, limit)
    usable = limit - reserve
    for name, value, maximum in (("batch", batch, MAX_BATCH), ("prompt_len", prompt_len, MAX_CONTEXT),
                                 ("gen_len", gen_len, MAX_CONTEXT)):
        _positive(name, value, maximum)
    spec = resolve_model(model, trust_remote_code=trust_remote_code)
    kv_dtype = spec.dtype or resolve_dtype(dtype or "float16", torch.device("cpu"))
    if spec.dtype is not None and spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ConfigError(f"loaded model dtype {spec.dtype} is not supported; allowed: float16, bfloat16, float32")
    weights = weight_bytes(spec, weights_bits, kv_dtype)
    if compiled is None:
        compiled = _compiled_by_default(model, spec, weights_bits)
    warnings: list[str] = []
    quality = load_quality(profile, warnings) if profile is not None else {}
    grid = candidates(spec.dims.head_dim, policies, budgets, bits, group_sizes, residuals, quant, heavy_ratio,
                      sink_tokens, high_bits_fraction, head_budgets, layer_budgets)
    if not grid:
        raise ConfigError(
            f"no candidate setting: group sizes {list(group_sizes)} do not divide head_dim={spec.dims.head_dim} "
            "and 16 bits was not among the bit widths"
        )

    def total(config, b, prompt) -> tuple[CacheBytes, int, int]:
        cache = cache_bytes(spec.dims, config, b, prompt, gen_len - 1, prompt + gen_len, kv_dtype)
        work = workspace_bytes(spec, config, b, prompt, cache.kept, kv_dtype, cache.slots, cache.residual,
                               compiled)
        return cache, work, weights + cache.total + work

    rows = []
    for config in grid:
        cache, work, need = total(config, batch, prompt_len)
        longest_prompt = _largest(lambda p: total(config, batch, p)[2] <= usable, 1, MAX_CONTEXT)
        rows.append(PlanRow(
            config=config, cache=cache, weight_bytes=weights, workspace_bytes=work, total_bytes=need,
            fits=need <= usable, max_batch=_largest(lambda b: total(config, b, prompt_len)[2] <= usable, 1, MAX_BATCH),
            max_context=longest_prompt + gen_len if longest_prompt else 0, quality=quality.get(_setting_key(config)),
            kv_dtype=str(kv_dtype).removeprefix("torch."),
        ))
    rows.sort(key=lambda r: (r.quality is None, r.quality or 0.0, -r.cache.total))
    notes = []
    if spec.max_context and prompt_len + gen_len > spec.max_context:
        notes.append(f"prompt + gen = {prompt_len + gen_len} tokens exceeds the model's context of {spec.max_context}")
    if any(b < 16 for b in bits) and all(spec.dims.head_dim % g for g in group_sizes):
        notes.append(f"no group size in {list(group_sizes)} divides head_dim={spec.dims.head_dim}: 16-bit settings only")
    fp16 = spec.dims.fp16_bytes_per_token * batch * (prompt_len + gen_len - 1)
    return PlanReport(
        model=spec.name, dims=spec.dims, memory_limit=limit, batch=batch, prompt_len=prompt_len, gen_len=gen_len,
        weights_bits=weights_bits if spec.loaded_bytes is None else loaded_weights_bits(model),
        dtype=str(kv_dtype).removeprefix("torch."),
        weight_bytes=weights, fp16_cache_bytes=fp16, model_context=spec.max_context, rows=rows,
        recommended=next((r for r in rows if r.fits), None), order=str(profile) if profile else "bytes", notes=notes,
        headroom_bytes=reserve, warnings=warnings, compiled=compiled,
    )


def _compiled_by_default(model, spec: ModelSpec, weights_bits: int) -> bool:
    """Whether ``generate`` would compile the decode step of ``model`` by default (see :func:`plan`)."""
    if spec.loaded_bytes is None:
        return weights_bits == 16
    return compiles_by_default(next(model.parameters()).device, model)


def choose(model, memory, batch: int = 1, prompt_len: int = 2048, gen_len: int = 128, **options) -> PlanRow:
    """The setting :func:`plan` recommends (same arguments), or an error saying the smallest memory that fits.

    Raises:
        ConfigError: nothing fits; the message names the smallest memory any candidate needs and that setting.
    """
    report = plan(model, memory, batch, prompt_len, gen_len, **options)
    if report.recommended is not None:
        return report.recommended
    smallest = min(report.rows, key=lambda r: r.total_bytes)
    raise ConfigError(
        f"no setting fits in {format_bytes(report.memory_limit)} for batch {batch}, {prompt_len} + {gen_len} tokens: "
        f"the smallest, {smallest.label}, needs {format_bytes(smallest.total_bytes)} ({smallest.total_bytes} bytes: "
        f"weights {format_bytes(smallest.weight_bytes)}, KV cache {format_bytes(smallest.cache.total)}, workspace "
        f"{format_bytes(smallest.workspace_bytes)})"
    )


def describe_choice(row: PlanRow, memory) -> str:
    """One line saying what the planner picked for ``memory`` and what it costs (``generate --memory-limit``)."""
    return (
        f"memory limit {format_bytes(parse_memory(memory))}: picked {row.label} (weights "
        f"{format_bytes(row.weight_bytes)} + KV cache {format_bytes(row.cache.total)} + workspace "
        f"{format_bytes(row.workspace_bytes)} = {format_bytes(row.total_bytes)})"
    )


def choose_for_prompt(
    model, tokenizer, prompt: str, memory, max_new_tokens: int = 128, chat: bool = True,
    base: CompressionConfig | None = None, **options,
) -> PlanRow:
    """The setting for one :func:`h2o_compress.generate` call within ``memory`` (the ``--memory-limit`` path).

    Tokenizes ``prompt`` as ``generate`` does, then :func:`choose` at batch 1 for the loaded ``model`` (its exact
    weight bytes and dtype). ``base`` gives the policy, heavy ratio, sinks, quant format and residual; the
    planner picks budget, bits and group size. Use as ``generate(model, tok, prompt, row.config, ...)``.

    Raises:
        InputError: empty prompt.
        ConfigError: nothing fits (the message names the smallest memory that would).
    """
    from .generation import encode_prompt

    base = base or CompressionConfig()
    prompt_len = encode_prompt(tokenizer, prompt, chat).shape[1]
    options = {"policies": (base.policy,), "quant": base.quant, "residuals": (base.residual,),
               "heavy_ratio": base.heavy_ratio, "sink_tokens": base.sink_tokens, **options}
    row = choose(model, memory, 1, prompt_len, max_new_tokens, **options)
    row.config = replace(row.config, rotate=base.rotate, score_chunk_size=base.score_chunk_size)
    return row
