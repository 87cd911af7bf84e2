"""`EvictionSpec`: which policy evicts and how it splits a capacity (heavy hitters, sinks, its own options),
checked on its own; and the budget it serves (`check_budget`, `parse_budget`).

[`CompressionConfig`][h2o_compress.config.CompressionConfig] holds one as ``config.eviction`` and reads its fields
as flat settings (``config.policy``, ``config.heavy_ratio``); what combines the policy with the other parts (a
layout that needs a scoring pass or a policy ranking across heads, a calibration) the config checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from h2o_compress.attention.runtime_spec import MAX_TOKENS
from h2o_compress.policies import POLICIES, POLICY_OPTIONS, EvictionPolicy, make_policy
from h2o_compress.utils.checks import check_count, check_number
from h2o_compress.utils.errors import ConfigError, short

#: What a budget may be (`check_budget`).
BUDGET_ALLOWED = "a fraction in (0, 1] or an integer number of tokens >= 1"


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
class EvictionSpec:
    """The eviction setting; checked when made, the policy's own options by the policy
    ([`make_policy`][h2o_compress.policies.make_policy]).

    Args:
        policy: eviction policy, a name of `h2o_compress.policies.POLICIES` (``h2o``, ``h2o-mean``, ``local``,
            ``sink``, ``full``, ``snapkv``, ``tova``, ``a2sf``, ``kvzip``, ``lookahead``, ...). Default ``h2o``.
        heavy_ratio: share in [0, 1] of the capacity given to heavy hitters, the rest to the recent window (0.5;
            H2O, Zhang et al. 2023, arXiv 2306.14048, §4).
        sink_tokens: first tokens always kept, 0 to `MAX_TOKENS`; ``None`` (default): 4 for ``sink``, else 0.
        policy_options: the policy's own options by config name (`h2o_compress.policies.policy_option`), e.g.
            ``{"forgetting_factor": 0.5}`` for ``a2sf``; ``None`` or ``False`` (not given: the policy's default) are
            dropped when made. Refused for a policy that does not take it. Default: none.

    Raises:
        ConfigError: the first value out of range, naming it and what is allowed.
    """

    policy: str = "h2o"
    heavy_ratio: float = 0.5
    sink_tokens: int | None = None
    policy_options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {short(self.policy)}; allowed: {', '.join(sorted(POLICIES))}")
        ratio = check_number("heavy_ratio", self.heavy_ratio, "a number in [0, 1]")
        if not 0 <= ratio <= 1:
            raise ConfigError(f"heavy_ratio={short(self.heavy_ratio)} is out of range; allowed: [0, 1]")
        if self.sink_tokens is not None:
            check_count("sink_tokens", self.sink_tokens, minimum=0, maximum=None, allowed="an integer >= 0")
            if self.sink_tokens > MAX_TOKENS:
                raise ConfigError(f"sink_tokens={short(self.sink_tokens)} is too large; allowed: an integer from 0 "
                                  f"to {MAX_TOKENS}")
        options = self.policy_options
        if not isinstance(options, Mapping) or not all(isinstance(name, str) for name in options):
            raise ConfigError(f"policy_options={short(options)} is invalid; allowed: a mapping of policy option "
                              "names to values")
        for name in options:
            if name not in POLICY_OPTIONS:
                raise ConfigError(f"policy_options holds {short(name)}, an option no registered policy takes; "
                                  f"allowed: {', '.join(POLICY_OPTIONS) or 'none (no policy declares one)'}")
        # normalised once, as it is made: the options not given are not kept
        object.__setattr__(self, "policy_options", {name: value for name, value in options.items()
                                                    if value is not None and value is not False})
        self.eviction_policy()  # the policy checks its own options (and refuses those it does not take)

    def __hash__(self) -> int:
        """Of every field (``policy_options`` as its items): equal specs hash alike."""
        return hash((self.policy, self.heavy_ratio, self.sink_tokens, frozenset(self.policy_options.items())))

    @property
    def sinks(self) -> int:
        """Number of attention-sink tokens always kept: ``sink_tokens``, or 4 for ``sink`` and 0 otherwise."""
        if self.sink_tokens is not None:
            return self.sink_tokens
        return 4 if self.policy == "sink" else 0

    def options(self) -> dict:
        """The policy options set, by config name (a copy of ``policy_options``)."""
        return dict(self.policy_options)

    def eviction_policy(self) -> EvictionPolicy:
        """A fresh [`EvictionPolicy`][h2o_compress.policies.EvictionPolicy] of this setting (``policy`` with its
        heavy ratio, sinks and its own options): what each cache layer ranks by.

        Raises:
            ConfigError: an option the policy does not take, or a value it refuses.
        """
        return make_policy(self.policy, self.heavy_ratio, self.sink_tokens, **self.policy_options)

    def min_layer_capacity(self, capacity: int) -> int:
        """The smallest capacity (tokens per KV head, at most ``capacity``) whose split leaves a recent window of
        at least one token (``sink_tokens + 1`` for a heavy ratio below 1), or, for a split without a recent
        window (``heavy_ratio=1``, compress-then-ask), that holds the sinks (at least one token): the floor of a
        layer whose budget is spread (``layer_budgets``)."""
        policy = self.eviction_policy()
        if policy.recent_window(capacity) < 1:  # no recent window at all (heavy_ratio 1): the sinks, or one token
            return min(capacity, max(1, self.sinks))
        return next(c for c in range(1, capacity + 1) if policy.recent_window(c) >= 1)

    def ensure_usable(self, budget: float | int, capacity: int | None = None, frozen: bool = False) -> None:
        """Refuse a split that is valid field by field but cannot serve ``budget`` (a fraction of the sequence, or
        tokens) or ``capacity`` (tokens per layer and KV head the cache will keep, when known; ``None``: unbounded,
        or not yet known, and an integer budget is then used):

        - ``policy="full"`` with a budget other than 1.0: the budget would be ignored silently.
        - ``heavy_ratio`` of 1 with ``h2o``/``h2o-mean``: no recent window, so the newest token (the one being
          generated from) could be evicted and the text degenerates ("of of of ...").
        - a capacity whose split leaves no recent window, e.g. ``sink_tokens=50`` with ``budget=20``.

        With ``frozen`` (compress-then-ask: the compressed context never evicts again, each question and answer is
        added to a copy that grows) the two recent-window refusals do not apply: there is no newest token to lose,
        and KVzip's own setting keeps no recent window (``heavy_ratio=1`` with ``sink_tokens=4``).

        The choice is to refuse, not to change the split: the eviction policies keep exactly the split documented
        in DESIGN.md §2. The Python API (``CompressionConfig`` and ``make_cache``) still accepts these settings for
        experiments.

        Raises:
            ConfigError: naming the values and what is allowed.
        """
        if self.policy == "full":
            if budget != 1:
                raise ConfigError(
                    f"policy='full' keeps every token, so budget={budget!r} would be ignored; allowed: budget 1.0 "
                    f"with policy full, or another policy ({', '.join(n for n in POLICIES if n != 'full')}) for a "
                    "smaller budget")
            return
        if frozen:
            return
        if POLICIES[self.policy].needs_scores and self.heavy_ratio >= 1:
            raise ConfigError(f"heavy_ratio={self.heavy_ratio!r} leaves no recent window (the newest tokens could be "
                              "evicted); allowed: a heavy ratio in [0, 1)")
        if capacity is None and not (isinstance(budget, float) and budget <= 1):
            capacity = int(budget)
        if capacity is not None and self.eviction_policy().recent_window(capacity) < 1:
            raise ConfigError(
                f"a capacity of {capacity} tokens (budget={budget!r}) with sink_tokens={self.sinks} and "
                f"heavy_ratio={self.heavy_ratio!r} leaves no recent window; allowed: a budget larger than the "
                "sinks plus the heavy hitters (at least one recent token)")
