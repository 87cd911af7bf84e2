"""`LayoutSpec`: how a cache's capacity is spread over the layers (``layer_budgets``) and over a layer's KV heads
(``head_budgets``), checked on its own, and the spreading itself (`LayoutSpec.layer_capacities`, `fit_to_total`).

[`CompressionConfig`][h2o_compress.config.CompressionConfig] holds one as ``config.layout`` and reads both as flat
settings (``config.layer_budgets``; its keywords, config files, CLI flags and saved caches name them so). What
combines the layout with the policy (``global`` needs a scoring pass, ``adaptive`` a policy that ranks across
heads) or with the decode kernel the config checks; the smallest capacity a layer may get depends on the policy's
split, so the config passes it in (`CompressionConfig.min_layer_capacity`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from h2o_compress.utils.checks import is_real
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.utils.files import read_json

LAYER_BUDGETS = ("uniform", "pyramid", "global")
HEAD_BUDGETS = ("uniform", "adaptive")
PYRAMID_BETA = 20  # PyramidKV's beta: the last layer gets capacity / beta (Cai et al. 2024, arXiv 2406.02069 §3.2)
MAX_LAYERS = 10_000  # layer weights a config may give
MAX_LAYER_WEIGHT = 1e100  # a layer weight's bound: the weights, their sum and capacity x layers x weight stay finite


@dataclass(frozen=True)
class LayoutSpec:
    """How the capacity is spread over layers and heads (``CompressionConfig.layout``); checked when made.

    Args:
        layer_budgets: spread of the capacity over layers, same total: ``uniform`` (default), ``pyramid``,
            ``global`` (a policy with a scoring pass: ``kvzip``, ``lookahead``), or per-layer weights (a sequence of
            positive numbers, or the path of a JSON file holding one), read into a tuple of floats when made
            (`layer_weights`).
        head_budgets: spread of a layer's capacity over its KV heads: ``uniform`` (default) or ``adaptive`` (a
            policy that ranks across heads).

    Raises:
        ConfigError: a value not supported, naming it and what is allowed.
    """

    layer_budgets: str | tuple[float, ...] = "uniform"
    head_budgets: str = "uniform"

    def __post_init__(self) -> None:
        if not (isinstance(self.layer_budgets, str) and self.layer_budgets in LAYER_BUDGETS):
            object.__setattr__(self, "layer_budgets", layer_weights(self.layer_budgets))
        if not isinstance(self.head_budgets, str) or self.head_budgets not in HEAD_BUDGETS:
            raise ConfigError(
                f"head_budgets={short(self.head_budgets)} is not supported; allowed: {', '.join(HEAD_BUDGETS)}"
            )

    @property
    def weights(self) -> tuple[float, ...] | None:
        """The per-layer weights, or ``None`` for a named spread."""
        return self.layer_budgets if isinstance(self.layer_budgets, tuple) else None

    @property
    def head_adaptive(self) -> bool:
        """Whether a layer's capacity is pooled over its KV heads (``head_budgets='adaptive'``)."""
        return self.head_budgets == "adaptive"

    def layer_capacities(self, capacity: int | None, num_layers: int,
                         floor: Callable[[int], int]) -> list[int | None]:
        """Capacity of each of ``num_layers`` layers for a per-layer ``capacity``, with the same total ``num_layers x
        capacity`` (``global`` before any scores: uniform); ``None`` (unbounded) stays ``None``.

        Args:
            capacity: tokens per layer and KV head (``None``: unbounded).
            num_layers: the model's layers.
            floor: the smallest capacity a layer may get, for ``capacity`` (the policy's: it must leave a recent
                window); called only where the capacity is spread.

        Raises:
            ConfigError: per-layer weights of another count than ``num_layers``.
        """
        weights = self.weights
        if weights is not None and len(weights) != num_layers:
            raise ConfigError(f"layer_budgets gives {len(weights)} layer weights but the model has {num_layers} layers; "
                              f"allowed: {num_layers} weights, one per layer")
        if capacity is None or self.layer_budgets in ("uniform", "global") or num_layers < 2:
            return [capacity] * num_layers
        least = floor(capacity)
        if weights is not None:  # each layer its weight's share, rounded down, then to the exact total
            total = math.fsum(weights)  # finite: each weight is at most MAX_LAYER_WEIGHT (layer_weights)
            caps = [max(least, int(capacity * num_layers * (w / total))) for w in weights]
            order = sorted(range(num_layers), key=lambda i: -weights[i])  # the heaviest gain (or lose) first
            return fit_to_total(caps, capacity * num_layers, least, order=order)
        last = max(capacity / PYRAMID_BETA, least)
        first = 2 * capacity - last
        caps = [max(least, int(first + (last - first) * i / (num_layers - 1))) for i in range(num_layers)]
        return fit_to_total(caps, capacity * num_layers, least)  # rounding: from the first layers on


def _weight(w) -> bool:
    """``w`` is a positive number at most `MAX_LAYER_WEIGHT` (compared before any float conversion)."""
    if not is_real(w):
        return False
    if isinstance(w, int):
        return 0 < w <= MAX_LAYER_WEIGHT
    return math.isfinite(w) and 0 < w <= MAX_LAYER_WEIGHT


def layer_weights(value) -> tuple[float, ...]:
    """``layer_budgets`` given as per-layer weights: a sequence of positive finite numbers (each at most
    `MAX_LAYER_WEIGHT`), or the path of a JSON file holding one (a list, or an object with a ``weights``
    list; read bounded: at most 16 MiB, numbers finite), as a tuple of floats.

    Raises:
        ConfigError: naming the value (or file) and what is allowed.
    """
    allowed = (f"allowed: {', '.join(LAYER_BUDGETS)}, per-layer weights (1 to {MAX_LAYERS} positive numbers, each at "
               f"most {MAX_LAYER_WEIGHT:g}) or the path of a JSON file holding them (a list, or {{\"weights\": [...]}})")
    source = "layer_budgets"
    if isinstance(value, str):
        path = Path(value)
        if not path.is_file():
            what = "a directory, not a file" if path.is_dir() else "no such file"
            raise ConfigError(f"layer_budgets={short(value)} is not supported ({what}); {allowed}")
        value = read_json(path, "layer_budgets file", ConfigError, bounded=True)
        if isinstance(value, dict):
            value = value.get("weights")
        source = f"layer_budgets file {short(str(path))}"
    if (not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_LAYERS
            or not all(_weight(w) for w in value)):
        raise ConfigError(f"{source} holds {short(value)}, not per-layer weights; {allowed}")
    return tuple(float(w) for w in value)


def fit_to_total(caps: list[int], total: int, floor: int, ceiling: int | None = None,
                 order: list[int] | None = None) -> list[int]:
    """``caps`` (per-layer capacities, tokens per KV head) moved one token at a time, layer by layer in ``order``
    (default: first to last) and round again, until they sum to ``total``: a layer gains up to ``ceiling`` (default:
    no limit) or loses down to ``floor``. Stops short of ``total`` only where the bounds forbid it. Used by the
    ``pyramid`` and ``global`` layer budgets to round to the uniform total."""
    caps, order = list(caps), list(range(len(caps))) if order is None else order
    spare = total - sum(caps)
    while spare != 0:
        moved = False
        for layer in order:
            if spare > 0 and (ceiling is None or caps[layer] < ceiling):
                caps[layer], spare, moved = caps[layer] + 1, spare - 1, True
            elif spare < 0 and caps[layer] > floor:
                caps[layer], spare, moved = caps[layer] - 1, spare + 1, True
            if spare == 0:
                break
        if not moved:
            break
    return caps
