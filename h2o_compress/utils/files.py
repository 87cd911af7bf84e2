"""Reading the small files users name (config files, text files, reports, model configs) safely.

Only regular files are read (a FIFO would block, ``/dev/zero`` never ends), at most a size limit, as UTF-8;
JSON and TOML nested too deeply for the parser are refused instead of overflowing the stack.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from h2o_compress.utils.errors import H2OCompressError, short

MAX_SETTINGS_BYTES = 16 * 2**20  # config files, reports, model config.json
MAX_TEXT_BYTES = 256 * 2**20  # text files read by the evaluations


def check_path(path, what: str, error: type[H2OCompressError]):
    """``path`` if it is a str or an ``os.PathLike`` that the file system can encode (never an int, which
    ``os.stat``/``open`` would take for an open file descriptor, nor ``None``, bytes or a lone surrogate).

    Raises:
        error: naming the value, its type and what is allowed.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} {short(path)} is of type {type(path).__name__}; allowed: a file path (str or "
                    "pathlib.Path)")
    try:
        os.fsencode(path)
    except (UnicodeEncodeError, TypeError) as exc:  # a lone surrogate; a PathLike that gives no path
        raise error(f"{what} {short(path)} is not a file name this system can hold ({type(exc).__name__}); allowed: "
                    "a path of valid text") from None
    return path


def make_dir(path: Path, refuse) -> Path:
    """Create the directory ``path`` and its parents where missing (an existing directory is fine).

    Args:
        path: the directory.
        refuse: ``refuse(None)`` gives the error for a path where something that is not a directory stands (or
            stands above it), ``refuse(exc)`` the error for any other ``OSError`` ``exc`` (no permission, no
            room, ...): an [`H2OCompressError`][h2o_compress.H2OCompressError] naming the path.

    Returns:
        ``path``.

    Raises:
        H2OCompressError: the error ``refuse`` gives.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise refuse(None) from None
    except OSError as exc:
        raise refuse(exc) from None
    return path


def read_text(path, what: str, error: type[H2OCompressError], limit: int = MAX_SETTINGS_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes.

    Args:
        path: the file.
        what: how messages name it, e.g. ``"config file"``.
        error: the [`H2OCompressError`][h2o_compress.H2OCompressError] subclass to raise.
        limit: the largest size accepted (bytes).

    Raises:
        error: ``path`` not a path (a str or ``os.PathLike``: an integer would be read as an open file
            descriptor), missing, not a regular file, larger than ``limit``, unreadable or not UTF-8.
    """
    check_path(path, what, error)
    name = short(str(path))
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {name} does not exist") from None
    except (OSError, ValueError) as exc:
        raise error(f"{what} {name} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what} {name} is not a regular file; allowed: a regular file (not a directory, device or FIFO)")
    if info.st_size > limit:
        raise error(f"{what} {name} has {info.st_size} bytes; allowed: at most {limit}")
    try:
        with open(path, "rb") as handle:  # read to its size (a file growing past it: at most the limit)
            data = handle.read(info.st_size + 1)
            while len(data) <= limit and (more := handle.read(min(1 << 20, limit + 1 - len(data)))):
                data += more
    except OSError as exc:
        raise error(f"{what} {name} cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise error(f"{what} {name} has more than {limit} bytes; allowed: at most {limit}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {name} is not UTF-8 text") from None


MAX_INT_DIGITS = 18
"""Digits an integer in a settings file (config, layer weights, device map) may have: up to ``10**18 - 1``,
past anything a setting means; parsed bounded, not through ``int()`` of thousands of digits."""
MAX_NUMBER = 2**63 - 1
"""The largest integer a bounded settings file may hold (TOML's 64-bit integers)."""
NUMBERS_ALLOWED = f"allowed: integers of at most {MAX_INT_DIGITS} digits and finite numbers"


class _NumberRefused(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-+"))
    if digits > MAX_INT_DIGITS:
        raise _NumberRefused(f"an integer of {digits} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise _NumberRefused(f"the number {short(text, 40, repr_=False)}, which is not finite as a float")
    return value


def _constant(text: str):
    raise _NumberRefused(f"{text}, which is not a finite number")


def check_numbers(value, what: str, error: type[H2OCompressError]):
    """``value`` (parsed JSON/TOML) if every number in it is a finite float or an integer within
    `MAX_NUMBER`; walked without recursion. Raises ``error`` naming the first other one."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int) and abs(item) > MAX_NUMBER:
            raise error(f"{what} holds an integer of more than {MAX_INT_DIGITS} digits; {NUMBERS_ALLOWED}")
        elif isinstance(item, float) and not (item == item and abs(item) != float("inf")):
            raise error(f"{what} holds the number {item}, which is not finite; {NUMBERS_ALLOWED}")
    return value


def parse_json(text: str, what: str, error: type[H2OCompressError], bounded: bool = False):
    """``json.loads(text)``, every failure (syntax, nesting too deep, huge integers) as ``error``.

    ``bounded``: integers of more than `MAX_INT_DIGITS` digits, numbers that overflow a float (``1e400``) and
    ``NaN``/``Infinity`` are refused as they are read (settings files: config, layer weights, device map).
    """
    hooks = {"parse_int": _bounded_int, "parse_float": _finite_float, "parse_constant": _constant} if bounded else {}
    try:
        return json.loads(text, **hooks)
    except _NumberRefused as exc:
        raise error(f"{what} holds {exc.reason}; {NUMBERS_ALLOWED}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    except (RecursionError, ValueError) as exc:  # ValueError: an integer of more than 4300 digits
        reason = "nested too deeply" if isinstance(exc, RecursionError) else _reason(exc)
        raise error(f"{what} is not usable JSON ({reason})") from None


def _reason(exc: Exception) -> str:
    if "Exceeds the limit" in str(exc):  # Python's int-str digit limit: say what it means, not how to lift it
        return "an integer of more than 4300 digits"
    return short(str(exc), 120, repr_=False)


def parse_toml(text: str, what: str, error: type[H2OCompressError], bounded: bool = False):
    """``tomllib.loads(text)``, every failure (syntax, nesting too deep, huge integers) as ``error``; ``bounded``:
    as `parse_json` (integers beyond `MAX_NUMBER`, ``inf``/``nan`` refused)."""
    try:
        value = tomllib.loads(text, parse_float=_finite_float) if bounded else tomllib.loads(text)
    except _NumberRefused as exc:
        raise error(f"{what} holds {exc.reason}; {NUMBERS_ALLOWED}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} is not valid TOML: {short(str(exc), 200, repr_=False)}") from None
    except (RecursionError, ValueError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else _reason(exc)
        raise error(f"{what} is not usable TOML ({reason})") from None
    return check_numbers(value, what, error) if bounded else value


def read_json(path, what: str, error: type[H2OCompressError], limit: int = MAX_SETTINGS_BYTES, bounded: bool = False):
    """The JSON value in the regular file ``path`` (see `read_text` and `parse_json`)."""
    return parse_json(read_text(path, what, error, limit), f"{what} {short(str(Path(path)))}", error, bounded)
