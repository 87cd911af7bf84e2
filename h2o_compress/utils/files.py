"""Reading the small files users name (config files, text files, reports, model configs) safely, and the staging
files and directories that writes go through.

Only regular files are read (a FIFO would block, ``/dev/zero`` never ends), at most a size limit, as UTF-8;
JSON and TOML nested too deeply for the parser are refused instead of overflowing the stack.

A write (a conversion, a saved cache or calibration, a report) goes to a staging file or directory beside its target,
named ``{prefix}{pid}-{random}{suffix}`` and locked (``flock``) by the writer until it is renamed into place
(`staging_file`, `staging_dir`). One that a writer killed outright left behind (SIGKILL, the OOM killer, power
loss) is removed by the next write that finds it (`remove_stale`): only this user's, only when no process holds its
lock, and only when its writer's PID has ended or it is older than `STALE_AFTER_S`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no way to tell a running write's staging from an orphan
    fcntl = None

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from h2o_compress.utils.checks import is_integer
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
    as `parse_json` (integers beyond `MAX_NUMBER`, ``inf``/``nan`` refused: the value is walked without recursion
    and ``error`` names the first such number)."""
    try:
        value = tomllib.loads(text, parse_float=_finite_float) if bounded else tomllib.loads(text)
    except _NumberRefused as exc:
        raise error(f"{what} holds {exc.reason}; {NUMBERS_ALLOWED}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} is not valid TOML: {short(str(exc), 200, repr_=False)}") from None
    except (RecursionError, ValueError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else _reason(exc)
        raise error(f"{what} is not usable TOML ({reason})") from None
    stack = [value] if bounded else []
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list)):
            stack.extend(item.values() if isinstance(item, dict) else item)
        elif is_integer(item) and abs(item) > MAX_NUMBER:
            raise error(f"{what} holds an integer of more than {MAX_INT_DIGITS} digits; {NUMBERS_ALLOWED}")
        elif isinstance(item, float) and not (item == item and abs(item) != float("inf")):
            raise error(f"{what} holds the number {item}, which is not finite; {NUMBERS_ALLOWED}")
    return value


def read_json(path, what: str, error: type[H2OCompressError], limit: int = MAX_SETTINGS_BYTES, bounded: bool = False):
    """The JSON value in the regular file ``path`` (see `read_text` and `parse_json`)."""
    return parse_json(read_text(path, what, error, limit), f"{what} {short(str(Path(path)))}", error, bounded)


STALE_AFTER_S = 3600.0
"""Seconds since its last change after which a staging file or directory that no process holds locked is removed
even though the PID in its name runs (a reused PID) or it has no lock (one made before staging names carried them)."""
LOCK_FILE = ".lock"
"""The file in a staging directory that its writer holds locked."""


def _lock(fd: int, wait: bool = True) -> bool:
    """An exclusive ``flock`` on ``fd``: True when taken (not when another process holds it and ``wait`` is false).
    The kernel drops it when its holder ends, SIGKILL included."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def _pid_ended(pid: int | None) -> bool:
    """Whether no process ``pid`` runs on this machine (``None``: not known, so not ended)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # PermissionError: it runs, as another user
        return False
    return False


def _staging_pattern(prefix: str, suffix: str) -> re.Pattern:
    """Names `staging_file`/`staging_dir` give (``{prefix}{pid}-{8 random}{suffix}``), and those ``tempfile`` gave
    before a PID was part of them (``{prefix}{8 random}{suffix}``)."""
    return re.compile(rf"{re.escape(prefix)}(?:(\d{{1,9}})-)?[a-z0-9_]{{8}}{re.escape(suffix)}")


def _is_stale(path: Path, pid: int | None, is_dir: bool) -> bool:
    """Whether ``path`` is a staging entry a dead writer of this user left: a directory (``is_dir``) or a regular file,
    no symbolic link, owned by this user, whose lock (the directory's `LOCK_FILE`, or the file itself) nobody holds,
    and whose writer's PID has ended or which is older than `STALE_AFTER_S`; one without a lock file only when old."""
    info = os.lstat(path)
    kind_ok = stat.S_ISDIR(info.st_mode) if is_dir else stat.S_ISREG(info.st_mode)
    if not kind_ok or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        return False
    old = time.time() - info.st_mtime > STALE_AFTER_S
    try:
        fd = os.open(path / LOCK_FILE if is_dir else path,
                     os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return old and is_dir
    except OSError:  # a link, or not ours to read: left alone
        return False
    try:
        if not is_dir and (os.fstat(fd).st_ino, os.fstat(fd).st_dev) != (info.st_ino, info.st_dev):
            return False  # replaced since it was looked at
        return _lock(fd, wait=False) and (old or _pid_ended(pid))
    finally:
        os.close(fd)


def remove_stale(parent: Path, prefix: str, suffix: str = "", is_dir: bool = False) -> list[Path]:
    """Remove the staging files (or, with ``is_dir``, directories) named ``{prefix}{pid}-{random}{suffix}`` in
    ``parent`` that writers killed outright left behind (`_is_stale`: this user's, not held by a running write, its
    PID ended or older than `STALE_AFTER_S`). Nothing else is touched; what cannot be checked or removed is left.
    Without ``fcntl`` nothing is removed.

    Returns:
        The paths removed.
    """
    if fcntl is None:
        return []
    pattern = _staging_pattern(prefix, suffix)
    try:
        found = [(entry.name, pattern.fullmatch(entry.name)) for entry in os.scandir(parent)]
    except OSError:
        return []
    removed = []
    for name, match in found:
        if match is None:
            continue
        path = Path(parent) / name
        try:
            if _is_stale(path, int(match.group(1)) if match.group(1) else None, is_dir):
                shutil.rmtree(path) if is_dir else os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


@contextmanager
def staging_file(parent: Path, prefix: str, suffix: str = "") -> Iterator[tuple[int, Path]]:
    """A new empty file ``{prefix}{pid}-{random}{suffix}`` in ``parent`` (mode 0600), open and locked for the block:
    write it through the descriptor, then ``os.replace`` it onto its target inside the block. When the block ends
    the name is removed if it is still there (an exception, Ctrl-C), and the descriptor closed. Stale ones
    (`remove_stale`) are removed first.

    Yields:
        ``(descriptor, path)``.

    Raises:
        OSError: it cannot be made (no room, not writable).
    """
    remove_stale(parent, prefix, suffix)
    fd, name = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", suffix=suffix, dir=parent)
    path = Path(name)
    try:
        if fcntl is not None:
            _lock(fd)
        yield fd, path
    finally:
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write part of it). Raises OSError (a full disk...)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextmanager
def staging_dir(parent: Path, prefix: str, suffix: str = "") -> Iterator[Path]:
    """A new directory ``{prefix}{pid}-{random}{suffix}`` in ``parent`` (mode 0700) for the block, holding a
    `LOCK_FILE` locked until the block ends; then it is removed with whatever it still holds (after an exception or
    Ctrl-C: no half-written copy is left), unless `publish_dir` renamed it. Stale ones (`remove_stale`) are
    removed first.

    Raises:
        OSError: it cannot be made (no room, not writable).
    """
    remove_stale(parent, prefix, suffix, is_dir=True)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", suffix=suffix, dir=parent))
    fd = None
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        if fcntl is not None:
            _lock(fd)
        yield path
    finally:
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)


def publish_dir(staging: Path, target: Path) -> None:
    """Rename the directory ``staging`` (of `staging_dir`) to ``target``, without its lock file. Where ``target``
    appeared meanwhile (another process finished the same work first), that copy stands and ``staging`` is left to
    its block to remove.

    Raises:
        OSError: the rename failed and ``target`` is not there.
    """
    (staging / LOCK_FILE).unlink(missing_ok=True)
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise
