"""Errors raised by h2o-compress.

Every error a user can cause derives from [`H2OCompressError`][h2o_compress.H2OCompressError], itself a ``ValueError``, so callers may
catch either. The CLI turns these into a one-line message and exit code 2.
"""


class H2OCompressError(ValueError):
    """Base class of every error caused by bad input to h2o-compress."""


class ConfigError(H2OCompressError):
    """A compression setting is out of range or unknown (budget, heavy_ratio, bits, group size, policy...)."""


class ModelLoadError(H2OCompressError):
    """A model cannot be found or loaded (unknown alias, missing wheel, no network for a hub id...)."""


class UnsupportedModelError(H2OCompressError):
    """The model's attention does not go through transformers' AttentionInterface, so it cannot be scored."""


class InputError(H2OCompressError):
    """A prompt or token stream is unusable (empty prompt, longer than the model's context...)."""


class CacheStateError(H2OCompressError):
    """A cache is used in a way that would give wrong results (reused across models, attention bypassed...)."""


class CacheFileError(CacheStateError):
    """A saved cache file is missing, truncated, tampered with, or of an unknown format version."""


MAX_ECHO = 200
"""Characters of a bad value an error message echoes; longer values are cut (a 100 MB value is not a line)."""


def short(value, limit: int = MAX_ECHO, repr_: bool = True) -> str:
    """``repr(value)`` (or ``str`` when ``repr_`` is false) cut to ``limit`` characters, saying how long it was.

    Never raises: an integer too long for Python to write out (more than 4300 digits) is named by its size, and a
    value whose ``repr`` fails by its type.
    """
    try:
        text = repr(value) if repr_ else str(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits(): say its size, never lift the limit
        if not isinstance(value, int):
            return f"<{type(value).__name__} object>"
        digits = int(abs(value).bit_length() * 0.30103) + 1
        return f"<an integer of about {digits} digits>"
    except Exception:  # noqa: BLE001 - a broken __repr__ of a user object: name its type
        return f"<{type(value).__name__} object>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def one_line(message: str, limit: int = 2000) -> str:
    """``message`` on one line (newlines become spaces), cut to ``limit`` characters."""
    text = str(message)
    for newline in ("\r\n", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"):
        text = text.replace(newline, " ")
    return text if len(text) <= limit else text[:limit] + "..."


def write_failure(path, exc: OSError, nbytes: int | None = None, what: str = "") -> str:
    """One line for an ``OSError`` met while writing ``path``: what it is (``what``, e.g. ``"cache file"``), the path,
    the bytes it needed (when known), the system's reason, and what to do (free space for ``ENOSPC``/``EDQUOT``, a
    writable place for ``EROFS``/``EACCES``/``EPERM``, a higher ``ulimit -f`` for ``EFBIG``)."""
    import errno

    need = f" ({nbytes} bytes)" if nbytes is not None else ""
    reason = exc.strerror or str(exc) or type(exc).__name__
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free {'at least ' + str(nbytes) + ' bytes' if nbytes is not None else 'space'} there, or write elsewhere"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "a directory this user can write to"
    elif code == errno.EFBIG:
        fix = "a file size limit (ulimit -f) that lets the file be written, or a smaller file"
    else:
        fix = "a writable directory with free space"
    name = f"{what} " if what else ""
    return one_line(f"cannot write {name}{short(str(path))}{need}: {reason}; allowed: {fix}")


def os_error(exc: BaseException) -> OSError | None:
    """``exc`` as an ``OSError``: itself when it is one; for a safetensors error that wraps one (its text names the
    system's error: ``IoError { code: 28, ... }`` before safetensors 0.8, ``I/O error: No space left on device (os
    error 28)`` from 0.8 on), an ``OSError`` of that ``errno`` and its ``strerror``; ``None`` for anything else."""
    import os
    import re

    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    if type(exc).__name__ != "SafetensorError" or not ("IoError" in text or "I/O error" in text):
        return None
    code = re.search(r"(?:code: |os error )(\d{1,6})\b", text)
    if code is None:
        return OSError(one_line(text, 200))
    return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
