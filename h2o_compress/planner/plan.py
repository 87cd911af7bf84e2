"""The memory-budget planner: a memory limit -> the best setting that fits ([`plan`][h2o_compress.plan], [`choose`][h2o_compress.planner.choose]), with the
largest batch and context each setting allows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from h2o_compress.runtime.compiled import compiles_by_default
from h2o_compress.config import CompressionConfig
from h2o_compress.utils.checks import check_count, check_flag
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.models import ModelDims, model_dims, resolve_dtype
from h2o_compress.models.weights import floating_dtype, loaded_weights_bits
from h2o_compress.policies import POLICIES
from h2o_compress.planner.known_models import ModelSpec, resolve_model
from h2o_compress.planner.ranking import rank, shipped_ranking
from h2o_compress.planner.settings import DEFAULT_BUDGETS, _setting_key, candidates, describe, load_quality
from h2o_compress.planner.sizes import CacheBytes, _element_size, cache_bytes, weight_bytes, workspace_bytes
from h2o_compress.planner.states import state_bytes
from h2o_compress.planner.units import format_bytes, parse_headroom, parse_memory
from h2o_compress.runtime.generation import _check_argument_kinds, encode_prompt
from h2o_compress.runtime.prefill import context_window

MAX_BATCH = 2**20
MAX_CONTEXT = 2**24


@dataclass
class PlanRow:
    """One candidate setting evaluated at the requested batch and lengths (bytes; tokens for lengths).

    ``max_batch`` is the largest batch that fits at the requested lengths, ``max_context`` the longest
    prompt + generation (generation length fixed) that fits at the requested batch, both 0 when none does.
    ``quality`` orders the rows, lower is better: the profile report's metric (``None`` without a report entry), or
    without a report the perplexity ratio of the shipped measured ranking
    (`h2o_compress.planner.ranking.rank`: ``None`` where unranked). ``quality_from`` names the measured
    setting the figure comes from (the row's own label, or where the row is ranked by a setting it keeps at least as
    much as, that setting's), ``quality_note`` says it in words (empty without a figure from the ranking).
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
    quality_from: str | None = None
    quality_note: str = ""
    own_weight_bytes: int | None = None

    @property
    def loaded_text(self) -> str:
        """What ``weight_bytes`` counts, in words: ``weights 237.00 MiB``, or where it is the process's resident set
        measured once the model was loaded (larger than the weights: runtime, libraries, tokenizer) ``process
        memory 738.00 MiB (weights 237.00 MiB)``."""
        if self.own_weight_bytes is None:
            return f"weights {format_bytes(self.weight_bytes)}"
        return f"process memory {format_bytes(self.weight_bytes)} (weights {format_bytes(self.own_weight_bytes)})"

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

    ``order`` says how the recommendation was ranked: ``measured`` (the shipped quality ranking, ``ranking`` naming
    its data) or the profile report's path; ``reason`` is why the recommended row was picked, in one phrase. ``fp16_cache_bytes`` is the uncompressed fp16 cache of the attention layers at the same tokens
    (DESIGN.md §2). ``state_bytes``: a hybrid model's constant linear-attention/SSM/convolution states of the whole
    batch (uncompressed, the same at any length: in every row's cache bytes, or beside them where the model's own
    modules hold them), ``state_layers`` the layers that hold them.
    ``compiled``: whether the workspace counts the CUDA-graph pool of the compiled decode step
    ([`graph_pool_bytes`][h2o_compress.planner.graph_pool_bytes]; rows in a bitsandbytes format decode eagerly and count none).
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
    state_bytes: int = 0
    state_layers: int = 0
    reason: str = ""
    ranking: str = ""

    @property
    def usable_bytes(self) -> int:
        """The memory a setting may use: the limit less the headroom."""
        return self.memory_limit - self.headroom_bytes

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("rows", "recommended")}
        out["rows"] = [row.to_dict() for row in self.rows]
        out["recommended"] = self.recommended.to_dict() if self.recommended else None
        return out


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


def plan(
    model, memory, batch: int = 1, prompt_len: int = 2048, gen_len: int = 128, weights_bits: int = 16,
    dtype=None, profile=None, policies=("h2o",), budgets=DEFAULT_BUDGETS, bits=(16, 8, 4),
    group_sizes=(32, 128), residuals=(CompressionConfig.residual,), quant: str = "int", heavy_ratio: float = 0.5,
    sink_tokens: int | None = None, headroom=0, trust_remote_code: bool = False, high_bits_fraction: float = 0.0,
    head_budgets: str = "uniform", layer_budgets="uniform", compiled: bool | None = None, held: int | None = None,
) -> PlanReport:
    """Evaluate every candidate setting for ``model`` under ``memory`` and recommend one.

    For each candidate ([`candidates`][h2o_compress.planner.candidates]): exact cache bytes after ``generate`` with a ``prompt_len``-token
    prompt and ``gen_len`` new tokens at ``batch`` (seen = prompt + gen - 1, capacity from prompt + gen),
    weight bytes, an activation/workspace estimate, whether the sum fits, the largest batch and the longest
    context that fit. The recommendation: the fitting setting of best quality in the ``profile`` report, else in the
    shipped measured ranking (`h2o_compress.planner.ranking.rank`); ``reason`` says why. ``policies``, ``budgets``, ``bits``, ``group_sizes``,
    ``residuals``, ``quant``, ``heavy_ratio``, ``sink_tokens``, ``high_bits_fraction``, ``head_budgets`` and
    ``layer_budgets`` span the candidate grid, as [`candidates`][h2o_compress.planner.candidates] takes them.

    Args:
        model: a local model directory, a known model name, a transformers config or a loaded model (then its
            exact weight bytes and dtype are used, and ``weights_bits``/``dtype`` are ignored).
        memory: the limit, bytes or a string like ``"24GiB"``.
        batch: sequences.
        prompt_len: prompt tokens.
        gen_len: new tokens.
        weights_bits: 16 (in ``dtype``), 8 (LLM.int8) or 4 (NF4) for a model that is not loaded.
        dtype: compute and KV dtype name (default ``float16``).
        profile: path of a profile report (JSON) ranking instead ([`load_quality`][h2o_compress.planner.load_quality]).
        headroom: memory left free under ``memory`` for what is not counted (CUDA context, fragmentation):
            ``"10%"``, an amount (``"1GiB"``) or 0 (the default here; ``h2o-compress plan`` uses 10%). A row
            fits when its total is at most ``memory - headroom``.
        trust_remote_code: let a model directory with an ``auto_map`` be read (off: refused).
        compiled: count the CUDA-graph pool of the compiled decode step in the workspace. ``None``: as
            ``generate`` decides by default: for a loaded model, when it is on CUDA in one piece with 16-bit
            weights (`h2o_compress.runtime.compiled.compiles_by_default`); otherwise for 16-bit weights (a plan for a
            card: the CUDA default compiles).
        held: bytes held once the model is loaded, counted for its weights where larger (as `fit_batch`).

    Returns:
        A [`PlanReport`][h2o_compress.planner.PlanReport], rows ordered by quality, then by cache bytes, largest first.

    Raises:
        ModelLoadError: unknown model (the message lists the known ones).
        ConfigError: a bad memory string, headroom, length, batch, bit width, dtype or candidate value (lengths
            at most `MAX_CONTEXT` tokens, batch at most `MAX_BATCH`).
    """
    limit, reserve = _check_request(memory, headroom, compiled, batch=batch, prompt_len=prompt_len, gen_len=gen_len)
    spec, kv_dtype, weights, compiled = _counted_model(model, dtype, weights_bits, compiled, trust_remote_code, held)
    warnings: list[str] = []
    quality = _quality_of(profile, warnings)
    grid = _grid(spec, policies, budgets, bits, group_sizes, residuals, quant, heavy_ratio, sink_tokens,
                 high_bits_fraction, head_budgets, layer_budgets)
    rows = sorted((_row(spec, config, batch, prompt_len, gen_len, weights, kv_dtype, limit - reserve, compiled,
                        quality(config)) for config in grid), key=_quality_order)
    return PlanReport(
        model=spec.name, dims=spec.dims, memory_limit=limit, batch=batch, prompt_len=prompt_len, gen_len=gen_len,
        weights_bits=weights_bits if spec.loaded_bytes is None else loaded_weights_bits(model), compiled=compiled,
        dtype=str(kv_dtype).removeprefix("torch."), weight_bytes=weights, model_context=spec.max_context, rows=rows,
        **_recommendation(rows, profile),
        notes=_notes(spec, prompt_len, gen_len, bits, group_sizes), headroom_bytes=reserve, warnings=warnings,
        **_uncompressed(spec, batch, prompt_len + gen_len - 1, kv_dtype))


def _uncompressed(spec: ModelSpec, batch: int, tokens: int, kv_dtype: torch.dtype) -> dict[str, int]:
    """[`PlanReport`][h2o_compress.planner.PlanReport]'s ``fp16_cache_bytes`` (the attention layers' keys and values
    of ``batch`` x ``tokens`` in fp16), ``state_bytes`` (a hybrid's constant states of ``batch`` sequences, wherever
    held) and ``state_layers`` (the layers holding them)."""
    return {"fp16_cache_bytes": spec.dims.fp16_bytes_per_token * batch * tokens,
            "state_bytes": sum(state_bytes(spec.states, batch, kv_dtype)),
            "state_layers": sum(span.stateful or span.paired for span in spec.dims.spans)}


def _check_request(memory, headroom, compiled, **sizes: int) -> tuple[int, int]:
    """[`plan`][h2o_compress.plan]'s memory, headroom, ``compiled`` and sizes, checked in that order.

    Args:
        memory: the limit, bytes or a string like ``"24GiB"``.
        headroom: ``"10%"``, an amount or 0 (`parse_headroom`).
        compiled: ``True``, ``False`` or ``None``.
        **sizes: ``batch``, ``prompt_len`` and ``gen_len`` (each checked by `_check_sizes`).

    Returns:
        ``(limit, reserve)``: the memory limit and the headroom under it, in bytes.

    Raises:
        ConfigError: the first value out of range.
    """
    if compiled is not None:
        check_flag("compiled", compiled, allowed="True, False or None (auto)")
    limit = parse_memory(memory)
    reserve = parse_headroom(headroom, limit)
    _check_sizes(**sizes)
    return limit, reserve


#: The largest value of each size a plan takes.
_SIZE_LIMITS = {"batch": MAX_BATCH, "prompt_len": MAX_CONTEXT, "gen_len": MAX_CONTEXT}


def _check_sizes(**sizes: int) -> None:
    """Each of ``sizes`` (``batch``, ``prompt_len``, ``gen_len``), in the order given: an integer from 1 to its
    limit (`MAX_BATCH` sequences, `MAX_CONTEXT` tokens).

    Raises:
        ConfigError: the first that is not, naming it and its limit.
    """
    for name, value in sizes.items():
        check_count(name, value, unit="", maximum=_SIZE_LIMITS[name])


def _counted_model(model, dtype, weights_bits: int, compiled: bool | None, trust_remote_code: bool,
                   held: int | None = None) -> tuple[ModelSpec, torch.dtype, int, bool]:
    """``model`` as [`plan`][h2o_compress.plan] counts it (the arguments as there; ``held``: `_with_held`).

    Returns:
        ``(spec, kv_dtype, weights, compiled)``: its [`ModelSpec`][h2o_compress.planner.ModelSpec], the dtype of
        its KV cache (a loaded model's own, else ``dtype``, default ``float16``), its weight bytes, and whether
        its decode step compiles (``compiled``, or as ``generate`` decides by default where ``None``).

    Raises:
        ModelLoadError: unknown model. ConfigError: a bad ``dtype`` or ``weights_bits``, or a loaded model in
            another dtype than float16, bfloat16 or float32.
    """
    spec = resolve_model(model, trust_remote_code=trust_remote_code)
    kv_dtype = spec.dtype or resolve_dtype(dtype or "float16", torch.device("cpu"))
    if spec.dtype is not None and spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ConfigError(f"loaded model dtype {spec.dtype} is not supported; allowed: float16, bfloat16, float32")
    weights = _with_held(weight_bytes(spec, weights_bits, kv_dtype), held)
    return spec, kv_dtype, weights, _compiled_by_default(model, spec, weights_bits) if compiled is None else compiled


def _grid(spec: ModelSpec, policies, budgets, bits, group_sizes, *options) -> list[CompressionConfig]:
    """[`candidates`][h2o_compress.planner.candidates] for ``spec``'s head size (``options``: ``residuals`` to
    ``layer_budgets``, in its order).

    Raises:
        ConfigError: a bad grid value, or no candidate at all (no group size divides the head size and 16 bits is
            not among ``bits``).
    """
    grid = candidates(spec.dims.head_dim, policies, budgets, bits, group_sizes, *options)
    if not grid:
        raise ConfigError(
            f"no candidate setting: group sizes {list(group_sizes)} do not divide head_dim={spec.dims.head_dim} "
            "and 16 bits was not among the bit widths"
        )
    return grid


def _quality_of(profile, warnings: list[str]):
    """A function giving a candidate's quality fields for its [`PlanRow`][h2o_compress.planner.PlanRow]
    (``quality``, ``quality_from``, ``quality_note``): from the ``profile`` report where given (`load_quality`;
    its non-finite metrics said in ``warnings``), else from the shipped measured ranking (`rank`).

    Raises:
        ConfigError: an unreadable profile report, or one without a usable row.
    """
    if profile is not None:
        measured = load_quality(profile, warnings)

        def from_profile(config: CompressionConfig) -> dict:
            value = measured.get(_setting_key(config))
            return {"quality": value, "quality_from": None if value is None else describe(config)}

        return from_profile

    def from_ranking(config: CompressionConfig) -> dict:
        found = rank(config)
        return {"quality": found.ratio, "quality_from": found.entry.label if found.entry else None,
                "quality_note": found.note()}

    return from_ranking


def _recommendation(rows: list[PlanRow], profile) -> dict:
    """[`PlanReport`][h2o_compress.planner.PlanReport]'s ``recommended`` (the first of the ordered ``rows`` that
    fits), ``order``, ``reason`` and ``ranking`` (the data the order comes from)."""
    best = next((r for r in rows if r.fits), None)
    source = str(profile) if profile is not None else shipped_ranking().source
    if best is None:
        reason = ""
    elif best.quality is None:
        ranked_by = f"the profile report {profile}" if profile is not None else "the measured quality ranking"
        reason = f"no setting in {ranked_by} fits: the least compressed that fits (most cache bytes)"
    elif profile is not None:
        reason = f"best quality in {profile} that fits"
    else:
        reason = f"best measured quality that fits: {best.quality_note}"
    return {"recommended": best, "order": str(profile) if profile is not None else "measured", "reason": reason,
            "ranking": source}


def _quality_order(row: PlanRow) -> tuple:
    """The order of a plan's rows: those with a quality figure first, best first (the lower the better), then by
    cache bytes, largest first."""
    return row.quality is None, row.quality or 0.0, -row.cache.total


def _notes(spec: ModelSpec, prompt_len: int, gen_len: int, bits, group_sizes) -> list[str]:
    """What a reader of the plan should know: the lengths exceed the model's context; no group size divides the
    head size, so only 16-bit settings are candidates."""
    notes = []
    if spec.max_context and prompt_len + gen_len > spec.max_context:
        notes.append(f"prompt + gen = {prompt_len + gen_len} tokens exceeds the model's context of {spec.max_context}")
    if any(b < 16 for b in bits) and all(spec.dims.head_dim % g for g in group_sizes):
        notes.append(f"no group size in {list(group_sizes)} divides head_dim={spec.dims.head_dim}: 16-bit settings only")
    return notes


def _row(spec: ModelSpec, config: CompressionConfig, batch: int, prompt_len: int, gen_len: int, weights: int,
         kv_dtype: torch.dtype, usable: int, compiled: bool, quality: dict | None = None,
         rows_alone: bool = False) -> PlanRow:
    """``config`` evaluated at ``batch`` and the lengths: its bytes, whether it fits ``usable`` bytes, its largest
    batch and longest context; ``quality``: its quality fields (`_quality_of`). ``rows_alone``: each sequence is prefilled alone into a cache of its own, then moved
    into the batch ([`h2o_compress.generate_batch`][h2o_compress.generate_batch]): the prefill's workspace is one sequence's, plus that
    sequence's cache while it is moved."""

    def total(b: int, prompt: int) -> tuple[CacheBytes, int, int]:
        cache = cache_bytes(spec.dims, config, b, prompt, gen_len - 1, prompt + gen_len, kv_dtype, spec.states)
        work = workspace_bytes(spec, config, b, prompt, cache.kept, kv_dtype, cache.slots, cache.residual, compiled,
                               prefill_batch=1 if rows_alone else None)
        if rows_alone:
            work += cache.total // b
        return cache, work, weights + cache.total + cache.model_states + work

    cache, work, need = total(batch, prompt_len)
    longest_prompt = _largest(lambda p: total(batch, p)[2] <= usable, 1, MAX_CONTEXT)
    return PlanRow(
        config=config, cache=cache, weight_bytes=weights, workspace_bytes=work, total_bytes=need,
        fits=need <= usable, max_batch=_largest(lambda b: total(b, prompt_len)[2] <= usable, 1, MAX_BATCH),
        max_context=longest_prompt + gen_len if longest_prompt else 0, **(quality or {}),
        kv_dtype=str(kv_dtype).removeprefix("torch."), own_weight_bytes=getattr(weights, "weights", None),
    )


def fit_batch(model, config: CompressionConfig, memory, prompt_len: int, gen_len: int, headroom=0,
              compiled: bool | None = None, batch: int = 1, held: int | None = None) -> PlanRow:
    """``config`` as it is (no candidate grid) for a loaded ``model`` under ``memory``: the [`PlanRow`][h2o_compress.planner.PlanRow] whose
    ``max_batch`` is the largest batch of ``prompt_len + gen_len``-token sequences that fits with the weights as
    loaded (what ``h2o-compress batch --batch-size auto`` runs), 0 when not even one does; its bytes are those of
    ``batch`` sequences. Same accounting as [`plan`][h2o_compress.plan] but for the prefill, which [`h2o_compress.generate_batch`][h2o_compress.generate_batch]
    runs one sequence at a time (its workspace is one sequence's, plus that sequence's cache until it joins the
    batch); ``headroom`` and ``compiled`` as there.

    ``held``: the bytes the process holds once the model is loaded, measured (`PeakMemory.held`): on a CPU the
    batch job measures its whole resident set (the Python runtime, torch, the libraries transformers imports, the
    weights and the tokenizer; its size for SmolLM2: docs/guide/weights-and-devices.md), so that the limit bounds the
    process's peak, which is what it measures too. The row's ``weight_bytes`` is the larger of the weights' own
    bytes and ``held``.

    Raises:
        ConfigError: a bad memory amount, headroom, length or ``held``.
    """
    limit = parse_memory(memory)
    usable = limit - parse_headroom(headroom, limit)
    _check_sizes(prompt_len=prompt_len, gen_len=gen_len, batch=batch)
    spec = resolve_model(model)
    kv_dtype = spec.dtype or resolve_dtype("float16", torch.device("cpu"))
    weights = _with_held(weight_bytes(spec, 16, kv_dtype), held)
    if compiled is None:
        compiled = _compiled_by_default(model, spec, 16)
    return _row(spec, config, batch, prompt_len, gen_len, weights, kv_dtype, usable, compiled, rows_alone=True)


class HeldBytes(int):
    """The bytes a plan counts for the loaded model where the process's resident set measured once it was loaded
    exceeds the weights (an int: those bytes), keeping ``weights``, the weights' own bytes, so that a row names
    each (`PlanRow.loaded_text`)."""

    weights: int

    def __new__(cls, held: int, weights: int):
        value = super().__new__(cls, held)
        value.weights = weights
        return value


def _with_held(weights: int, held: int | None) -> int:
    """The bytes a plan counts for the loaded model: its ``weights``, or the ``held`` bytes measured once it was
    loaded where larger (see [`fit_batch`][h2o_compress.planner.fit_batch]).

    Raises:
        ConfigError: ``held`` neither ``None`` nor bytes (an integer >= 0).
    """
    if held is None:
        return weights
    check_count("held", held, minimum=0, maximum=None, allowed="bytes (an integer >= 0) or None")
    return HeldBytes(held, weights) if held > weights else weights


def _compiled_by_default(model, spec: ModelSpec, weights_bits: int) -> bool:
    """Whether ``generate`` would compile the decode step of ``model`` by default (see [`plan`][h2o_compress.plan])."""
    if spec.loaded_bytes is None:
        return weights_bits == 16
    return compiles_by_default(next(model.parameters()).device, model)


def choose(model, memory, batch: int = 1, prompt_len: int = 2048, gen_len: int = 128, **options) -> PlanRow:
    """The setting [`plan`][h2o_compress.plan] recommends (same arguments), or an error saying the smallest memory that fits.

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
        f"{smallest.loaded_text}, KV cache {format_bytes(smallest.cache.total)}, workspace "
        f"{format_bytes(smallest.workspace_bytes)})"
    )


def describe_choice(row: PlanRow, memory) -> str:
    """One line saying what the planner picked for ``memory``, what it costs and, where the measured ranking gives
    it, its quality (``generate --memory-limit``)."""
    return (
        f"memory limit {format_bytes(parse_memory(memory))}: picked {row.label} ({row.loaded_text} + KV cache {format_bytes(row.cache.total)} + workspace "
        f"{format_bytes(row.workspace_bytes)} = {format_bytes(row.total_bytes)})"
        + (f"; quality: {row.quality_note}" if row.quality_note else "")
    )


def choose_for_prompt(
    model, tokenizer, prompt: str, memory, max_new_tokens: int = 128, chat: bool = True,
    base: CompressionConfig | None = None, **options,
) -> PlanRow:
    """The setting for one [`h2o_compress.generate`][h2o_compress.generate] call within ``memory`` (the ``--memory-limit`` path).

    Tokenizes ``prompt`` as ``generate`` does, then [`choose`][h2o_compress.planner.choose] at batch 1 for the loaded ``model`` (its exact
    weight bytes and dtype). ``base`` gives every field but those the planner picks (`PICKED`: budget, bits
    and group size): the policy, heavy ratio, sinks, quant format, residual, layer and head budgets and mixed
    precision are sized by the planner as given; the rest (rotation, kernel, policy options, calibration file) are
    carried over, and ``key_offsets`` where the row stores 4- or 8-bit keys (the same bytes). Use
    as ``generate(model, tok, prompt, row.config, ...)``.

    Raises:
        InputError: empty prompt, or one longer than the model's window could hold.
        ConfigError: nothing fits (the message names the smallest memory that would); ``model``, ``tokenizer``,
            ``base``, ``chat`` or ``max_new_tokens`` of the wrong kind.
    """
    _check_argument_kinds(model, tokenizer, None)
    if base is not None and not isinstance(base, CompressionConfig):
        raise ConfigError(f"base={short(base)} is invalid; allowed: a CompressionConfig or None")
    base = base or CompressionConfig()
    check_flag("chat", chat)
    check_count("max_new_tokens", max_new_tokens, unit="", maximum=MAX_CONTEXT)
    prompt_len = encode_prompt(tokenizer, prompt, chat, context_window(model)).shape[1]
    options = {"policies": (base.policy,), "quant": base.quant, "residuals": (base.residual,),
               "heavy_ratio": base.heavy_ratio, "sink_tokens": base.sink_tokens, "layer_budgets": base.layer_budgets,
               "head_budgets": base.head_budgets, "high_bits_fraction": base.high_bits_fraction, **options}
    row = choose(model, memory, 1, prompt_len, max_new_tokens, **options)
    carried = ["rotate", "score_chunk_size", "prefill_chunk_size", "attention_kernel"]
    if row.config.policy == base.policy:  # not when the row keeps everything (policy "full")
        carried.append("policy_options")  # the policy's own options
    row.config = replace(row.config, **{name: getattr(base, name) for name in carried})
    offsets = base.key_offsets if row.config.kv_bits in (4, 8) else "none"  # same bytes; not where 16 bits are kept
    reads = offsets != "none" or POLICIES[row.config.policy].needs_calibration  # the calibration, where it is read
    row.config = replace(row.config, key_offsets=offsets, calibration=base.calibration if reads else None)
    return row


READS_WHOLE = ("observation_window", "lookahead")  # the scoring passes that hold a prompt's keys and values


def read_whole_fallback(model, row: PlanRow, prompt_len: int, memory) -> tuple[PlanRow, str | None]:
    """``row`` as it runs a prompt of ``prompt_len`` tokens within ``memory``: a policy that reads the prompt whole
    first (``snapkv``, ``lookahead``: `h2o_compress.runtime.context_scores.read_prompt`) holds the prompt's keys and values
    uncompressed, in the model's dtype, beside the row's own bytes until they are ranked into the cache; where
    that does not fit, the row evicts the prompt chunk by chunk instead (``h2o``). Returns the row to run and the
    one line saying why it changed (``None``: unchanged).

    Raises:
        ConfigError: a bad ``memory``.
    """
    config = row.config
    capacity = config.capacity(prompt_len + 1)
    if POLICIES[config.policy].scorer not in READS_WHOLE or capacity is None or capacity >= prompt_len:
        return row, None
    dims = model_dims(model.config)
    read = dims.fp16_bytes_per_token * prompt_len * _element_size(floating_dtype(model)) // 2
    limit = parse_memory(memory)
    if row.total_bytes + read <= limit:
        return row, None
    row.config = replace(config, policy="h2o")
    return row, (f"the whole prompt's keys and values ({format_bytes(read)} uncompressed) do not fit "
                 f"{format_bytes(limit)} beside the setting's {format_bytes(row.total_bytes)}: the prompt is evicted "
                 f"chunk by chunk (h2o) instead of read whole ({config.policy})")


#: The fields [`choose_for_prompt`][h2o_compress.planner.choose_for_prompt] picks itself (``--memory-limit``): a setting that fixes one of them is
#: refused there rather than silently replaced.
PICKED = ("budget", "kv_bits", "k_bits", "v_bits", "group_size")
