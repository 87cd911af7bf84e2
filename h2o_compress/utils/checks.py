"""Checks of plain values that every layer shares (a count of tokens, trials, threads...), each refusing a bad
value with one [`ConfigError`][h2o_compress.utils.errors.ConfigError] naming the option and what is allowed."""

from __future__ import annotations

import math
import os

from h2o_compress.utils.errors import ConfigError, short


def is_integer(value) -> bool:
    """Whether ``value`` is an integer and not a bool (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """Whether ``value`` is an int or a float and not a bool (it may still be NaN or infinite: `check_number`)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_flag(name: str, value, allowed: str = "True or False", error: type[Exception] = ConfigError) -> bool:
    """``value`` if it is a bool. Raises ``error`` (ConfigError by default) otherwise:
    ``{name}={value} is invalid; allowed: {allowed}``."""
    if not isinstance(value, bool):
        raise error(f"{name}={short(value)} is invalid; allowed: {allowed}")
    return value


def check_callback(name: str, value, allowed: str = "a function or None") -> None:
    """Refuse a callback ``value`` (``on_text``, ``on_step``...) that is neither callable nor ``None``, before
    anything runs.

    Raises:
        ConfigError: ``{name}={value} is not callable; allowed: {allowed}``.
    """
    if value is not None and not callable(value):
        raise ConfigError(f"{name}={short(value)} is not callable; allowed: {allowed}")


def check_count(name: str, value, minimum: int = 1, unit: str = "tokens", maximum: int | None = 2**31 - 1,
                allowed: str | None = None, error: type[Exception] = ConfigError) -> int:
    """``value`` if it is an integer (not a bool) in [``minimum``, ``maximum``] (``maximum`` ``None``: no upper
    bound). Raises ``error`` (ConfigError by default) naming the option otherwise:
    ``{name}={value} is invalid; allowed: {allowed}``, where ``allowed`` defaults to
    ``an integer >= {minimum} ({unit}), at most {maximum}`` (an empty ``unit`` and a ``None`` maximum leave their
    part out)."""
    if not is_integer(value) or value < minimum or (maximum is not None and value > maximum):
        if allowed is None:
            allowed = f"an integer >= {minimum}" + (f" ({unit})" if unit else "")
            allowed += "" if maximum is None else f", at most {maximum}"
        raise error(f"{name}={short(value)} is invalid; allowed: {allowed}")
    return value


def check_fraction(name: str, value, allowed: str = "a number in [0, 1]", low: float = 0.0, high: float = 1.0,
                   include_high: bool = True, error: type[Exception] = ConfigError) -> float:
    """``value`` if it is a finite number (not a bool) in [``low``, ``high``] (``include_high`` false:
    [``low``, ``high``)). Raises ``error`` (ConfigError by default) naming the option and ``allowed`` otherwise."""
    if not is_real(value) or not (low <= value <= high) or (value == high and not include_high):
        raise error(f"{name}={short(value)} is invalid; allowed: {allowed}")
    return value


def check_number(name: str, value, allowed: str, shown: str | None = None,
                 error: type[Exception] = ConfigError) -> float:
    """``value`` if it is a finite int or float (not a bool). Raises ``error`` (ConfigError by default) naming the
    option (``is not a number`` or ``is not finite``) and ``allowed`` otherwise; ``shown``: the value as the user
    typed it, for the message (default: ``value``'s repr, cut short)."""
    shown = short(value) if shown is None else shown
    if not is_real(value):
        raise error(f"{name}={shown} is not a number; allowed: {allowed}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer too large for a float (a config file may hold one of 4,000 digits)
        finite = False
    if not finite:
        raise error(f"{name}={shown} is not finite; allowed: {allowed}")
    return value


MAX_THREADS = 4096
"""The most torch CPU threads a job or command may ask for on any machine (`max_threads` bounds it by the CPUs)."""
THREADS_PER_CPU = 4
"""Torch CPU threads allowed per CPU this process may run on: more only take turns on the same cores, and each
thread reserves its stack (8 MiB by default), so thousands of them fill an address-space limit (``ulimit -v``)."""


def max_threads() -> int:
    """The most torch CPU threads allowed here: `THREADS_PER_CPU` per CPU this process may run on (its affinity, else
    ``os.cpu_count()``), at most `MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, THREADS_PER_CPU * cpus))


def check_threads(threads, here: bool = True) -> int | None:
    """``threads`` (torch CPU threads to set before loading) if it is ``None`` (torch's default) or an integer from 1
    to `max_threads` (``here`` false: threads of other machines, a Ray cluster's, to `MAX_THREADS`). Raises
    ConfigError naming it otherwise (`check_count`)."""
    if threads is not None and here:
        check_count("threads", threads, unit=f"threads; {THREADS_PER_CPU} per CPU here", maximum=max_threads())
    elif threads is not None:
        check_count("threads", threads, unit="threads", maximum=MAX_THREADS)
    return threads
