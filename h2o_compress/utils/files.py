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


def read_text(path, what: str, error: type[H2OCompressError], limit: int = MAX_SETTINGS_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes.

    Args:
        path: the file.
        what: how messages name it, e.g. ``"config file"``.
        error: the :class:`H2OCompressError` subclass to raise.
        limit: the largest size accepted (bytes).

    Raises:
        error: missing, not a regular file, larger than ``limit``, unreadable or not UTF-8.
    """
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


def parse_json(text: str, what: str, error: type[H2OCompressError]):
    """``json.loads(text)``, every failure (syntax, nesting too deep, huge integers) as ``error``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    except (RecursionError, ValueError) as exc:  # ValueError: an integer of more than 4300 digits
        reason = "nested too deeply" if isinstance(exc, RecursionError) else short(str(exc), 120, repr_=False)
        raise error(f"{what} is not usable JSON ({reason})") from None


def parse_toml(text: str, what: str, error: type[H2OCompressError]):
    """``tomllib.loads(text)``, every failure (syntax, nesting too deep, huge integers) as ``error``."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} is not valid TOML: {short(str(exc), 200, repr_=False)}") from None
    except (RecursionError, ValueError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else short(str(exc), 120, repr_=False)
        raise error(f"{what} is not usable TOML ({reason})") from None


def read_json(path, what: str, error: type[H2OCompressError], limit: int = MAX_SETTINGS_BYTES):
    """The JSON value in the regular file ``path`` (see :func:`read_text` and :func:`parse_json`)."""
    return parse_json(read_text(path, what, error, limit), f"{what} {short(str(Path(path)))}", error)
