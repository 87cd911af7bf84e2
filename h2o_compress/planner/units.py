"""Amounts the planner reads and writes: memory (``"24GiB"`` -> bytes), comma-separated lists, headroom, and bytes
in binary units."""

from __future__ import annotations

import math
import re

from h2o_compress.utils.checks import is_integer, is_real
from h2o_compress.utils.errors import ConfigError, short

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value) -> int:
    """``"24GiB"``, ``"2GB"``, ``"512MiB"``, ``"1.5 GiB"`` or an int -> bytes (GB = ``10**9``, GiB = ``2**30``).

    Raises:
        ConfigError: not a positive amount with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    allowed = "a positive amount like 24GiB, 2GB or 512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    if is_integer(value) and value > 0:
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


def parse_headroom(value, limit: int) -> int:
    """Bytes to leave free under ``limit``: ``"10%"`` (a share of it), an amount (``"1GiB"``, bytes), or 0.

    Raises:
        ConfigError: a share outside [0%, 90%], an amount not below the limit, or an unparsable value.
    """
    allowed = "a share like 10% (0% to 90%), an amount below the limit like 1GiB, or 0"
    if value is None or (is_real(value) and value == 0):
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
