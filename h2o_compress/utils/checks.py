"""Checks of plain values that every layer shares (a count of tokens, trials, threads...), each refusing a bad
value with one [`ConfigError`][h2o_compress.utils.errors.ConfigError] naming the option and what is allowed."""

from __future__ import annotations

import math

from h2o_compress.utils.errors import ConfigError, short


def check_count(name: str, value, minimum: int = 1, unit: str = "tokens", maximum: int = 2**31 - 1) -> int:
    """``value`` if it is an integer in [``minimum``, ``maximum``]. Raises ConfigError naming the option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(
            f"{name}={short(value)} is invalid; allowed: an integer >= {minimum} ({unit}), at most {maximum}"
        )
    return value


def check_number(name: str, value, allowed: str) -> float:
    """``value`` if it is a finite int or float (not a bool). Raises ConfigError naming the option (``is not a
    number`` or ``is not finite``) and ``allowed`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={short(value)} is not a number; allowed: {allowed}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer too large for a float (a config file may hold one of 4,000 digits)
        finite = False
    if not finite:
        raise ConfigError(f"{name}={short(value)} is not finite; allowed: {allowed}")
    return value


MAX_THREADS = 4096
"""The most torch CPU threads a job or command may ask for."""


def check_threads(threads) -> int | None:
    """``threads`` (torch CPU threads to set before loading) if it is ``None`` (torch's default) or an integer from 1
    to `MAX_THREADS`. Raises ConfigError naming it otherwise (`check_count`)."""
    if threads is not None:
        check_count("threads", threads, unit="threads", maximum=MAX_THREADS)
    return threads
