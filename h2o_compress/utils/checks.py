"""Checks of plain values that every layer shares (a count of tokens, trials, threads...), each refusing a bad
value with one [`ConfigError`][h2o_compress.utils.errors.ConfigError] naming the option and what is allowed."""

from __future__ import annotations

from h2o_compress.utils.errors import ConfigError, short


def check_count(name: str, value, minimum: int = 1, unit: str = "tokens", maximum: int = 2**31 - 1) -> int:
    """``value`` if it is an integer in [``minimum``, ``maximum``]. Raises ConfigError naming the option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(
            f"{name}={short(value)} is invalid; allowed: an integer >= {minimum} ({unit}), at most {maximum}"
        )
    return value
