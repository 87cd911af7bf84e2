"""The settings the planner weighs: their names ([`describe`][h2o_compress.planner.describe]), the candidate grid ([`candidates`][h2o_compress.planner.candidates]), and
their quality read from a profile report ([`load_quality`][h2o_compress.planner.load_quality])."""

from __future__ import annotations

import math

from h2o_compress.config import ALLOWED_GROUP_SIZES, FIELD_NAMES, CompressionConfig, MAX_RESIDUAL
from h2o_compress.utils.checks import is_integer, is_real
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.utils.files import read_json

DEFAULT_BUDGETS = (1.0, 0.5, 0.25, 0.1)
# Quality metrics a profile report may carry: lower is better for the first group, higher for the second.
LOWER_BETTER = ("ppl_ratio", "perplexity_ratio", "ppl", "perplexity")
HIGHER_BETTER = ("agreement", "greedy_agreement", "accuracy", "passkey_accuracy", "retrieval")


def describe(config: CompressionConfig, kv_dtype="float16") -> str:
    """``full 16-bit``, ``h2o 25% int4 g32 r4``, ``sink 512 tok k:int8/v:int4 g64 r4``, ``local 50% nf4 g64 r4``.

    Formats per tensor as each format labels them (``KVQuantizer.label``): ``int4``/``int8`` (ours), ``nf4``/``fp4``
    and ``bw8`` (bitsandbytes blockwise 8-bit), and for unquantized storage the width of ``kv_dtype`` (``16`` for
    fp16/bf16, ``32`` for an fp32 cache).
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
        return str(width) if bits == 16 else config.format.label(bits)

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
        ConfigError: a list that is not a list (or tuple) of at most `MAX_VALUES` values, a grid of more than
            `MAX_CANDIDATES` settings (checked before any is built), or an invalid value in any list (from
            [`CompressionConfig`][h2o_compress.config.CompressionConfig]).
    """
    policies, budgets, bits, group_sizes, residuals = check_grid(
        policies=policies, budgets=budgets, bits=bits, group_sizes=group_sizes, residuals=residuals)
    for group in group_sizes:
        if not is_real(group) or group not in ALLOWED_GROUP_SIZES:
            raise ConfigError(f"group size {short(group)} is not supported; allowed: 32, 64, 128")
    for residual in residuals:
        if not is_integer(residual) or not 0 <= residual <= MAX_RESIDUAL:
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


MAX_VALUES = 256
"""Values one list of the candidate grid may hold (``--budgets``, ``--bits``, ...)."""
MAX_CANDIDATES = 2048
"""Settings the candidate grid may have (the product of its lists' lengths): each is sized by bisection, a few
milliseconds apiece, so 2,048 plan in seconds (20,000 budgets ran for minutes)."""


def check_grid(**lists) -> list[tuple]:
    """Each of ``lists`` (policies, budgets, ...) as a tuple of 1 to `MAX_VALUES` values (a single text or number
    is one value), and their product at most `MAX_CANDIDATES`; returned in the order given.

    Raises:
        ConfigError: naming the list, its size or type, and what is allowed.
    """
    out = []
    for name, values in lists.items():
        if isinstance(values, (str, int, float)):
            values = (values,)
        if not isinstance(values, (list, tuple)):
            raise ConfigError(f"{name}={short(values)} is invalid; allowed: a list (or tuple) of 1 to {MAX_VALUES} values")
        if not 1 <= len(values) <= MAX_VALUES:
            raise ConfigError(f"{name} has {len(values)} values; allowed: 1 to {MAX_VALUES}")
        out.append(tuple(values))
    size = math.prod(len(values) for values in out)
    if size > MAX_CANDIDATES:
        sizes = " x ".join(f"{name} {len(values)}" for name, values in zip(lists, out))
        raise ConfigError(f"the candidate grid would have {size} settings ({sizes}); allowed: at most {MAX_CANDIDATES} "
                          "(fewer values in the lists)")
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
    gives the setting (under ``config`` or at top level, [`CompressionConfig`][h2o_compress.config.CompressionConfig] field names) and one metric,
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
    fields = set(FIELD_NAMES)
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
