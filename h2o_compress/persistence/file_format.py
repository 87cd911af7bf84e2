"""The cache file on disk: one safetensors file, its header checks, its checksum and atomic writes.

File format (``format_version`` 3): tensors named ``layers.{i}.{name}`` (and ``prompt.*``) and string metadata
(``format``, ``format_version``, ``library_version``, ``model_fingerprint``, ``model_id``, ``model_dtype``,
``config``, ``capacity``, ``tokens``, ``layers``, ``checksum``); what those hold and how a cache is rebuilt from
them is `h2o_compress.persistence.cache_state`. The ``checksum`` is SHA-256 over every other metadata field
and every tensor's name, dtype, shape and bytes: it catches truncation and accidental damage, not a deliberate
edit (anyone can recompute it), so every structural field is checked on load as well.

Writes are atomic: the file is written to a temporary name in the target directory, flushed to disk and
renamed over the target, so an interrupted save leaves either the old file or the new one, never half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import stat
import threading
from pathlib import Path
import torch

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from h2o_compress.utils.checks import check_flag
from h2o_compress.utils.errors import CacheFileError, one_line, os_error, short, write_failure
from h2o_compress.utils.files import check_path, staging_dir
from h2o_compress.utils.version import __version__

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None


FORMAT = "h2o-compress-kv-cache"


FORMAT_VERSION = "3"


MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header larger than this is not one this library wrote


def _checksum(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    body = {k: v for k, v in metadata.items() if k != "checksum"}
    digest.update(json.dumps(body, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _as_path(path) -> Path:
    """``path`` as a Path: a str or os.PathLike the file system can encode (no lone surrogate), not blank."""
    check_path(path, "cache path", CacheFileError)
    if not str(path).strip():
        raise CacheFileError(f"cache path {short(path)} is blank; allowed: a file path (str or os.PathLike)")
    return Path(path)


def is_cache_file(path: Path) -> bool:
    """True when ``path`` is a safetensors file whose metadata says it is an h2o-compress cache (header only)."""
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= MAX_HEADER_BYTES:
                return False
            header = json.loads(handle.read(size))
    except (OSError, ValueError):
        return False
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(metadata, dict) and metadata.get("format") == FORMAT


def check_save_target(path, overwrite: bool = False) -> Path:
    """The path to save a cache to, checked before anything is computed or written.

    Refuses a missing or unwritable directory, anything at ``path`` that is not a regular file (a directory,
    device node, FIFO, socket or symbolic link), and, unless ``overwrite``, a regular file that is not a cache
    file written by this library ([`is_cache_file`][h2o_compress.persistence.is_cache_file]).

    Raises:
        CacheFileError: naming the path and what is allowed.
    """
    check_flag("overwrite", overwrite, error=CacheFileError)
    target = _as_path(path)
    name = short(str(target))
    if not target.parent.is_dir():
        raise CacheFileError(
            f"directory {short(str(target.parent))} does not exist; allowed: a path in an existing directory"
        )
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise CacheFileError(f"directory {short(str(target.parent))} is not writable; allowed: a writable directory")
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return target
    except OSError as exc:
        raise CacheFileError(f"cannot check {name}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CacheFileError(
            f"{name} is not a regular file ({_file_kind(info.st_mode)}); allowed: a new file or a cache file"
        )
    if not overwrite and not is_cache_file(target):
        raise CacheFileError(
            f"{name} exists and is not an h2o-compress cache file; allowed: a new path, a cache file, or "
            "--overwrite (overwrite=True) to replace it"
        )
    return target


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


class _Terminated(BaseException):
    """SIGTERM/SIGHUP arrived during an atomic write (raised so the temporary file is removed)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _cleanup_on_signals(signals=(signal.SIGTERM, signal.SIGHUP)):
    """Within the block, SIGTERM/SIGHUP raise `_Terminated` (so ``finally``/``except`` blocks run);
    afterwards the previous handlers are back, and a signal that arrived is delivered to them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    except _Terminated as exc:
        for sig, old in previous.items():
            signal.signal(sig, old)
        previous = {}
        signal.raise_signal(exc.signum)  # the previous handler's behaviour (by default: terminate)
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _lock(fd: int, wait: bool = True) -> bool:
    """An exclusive advisory lock (``flock``) on ``fd``: True when taken (always without ``fcntl``, not when another
    process holds it and ``wait`` is false). The kernel drops it when its holder dies, SIGKILL included."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def remove_orphaned_partials(target: Path) -> list[Path]:
    """Remove the temporary files that earlier saves to ``target`` left behind when killed outright (SIGKILL, power
    loss: no handler ran): ``.NAME.XXXX.partial`` beside ``target`` (``NAME`` its name, ``XXXX`` letters, digits or
    ``_``), regular files (not links) owned by this user, that no running save holds (each save locks its own with
    ``flock`` until its rename). Nothing else is touched; a file that cannot be opened, checked or removed is left.
    Without ``fcntl`` (no way to tell a running save's file from an orphan) nothing is removed.

    Returns:
        The paths removed.
    """
    if fcntl is None:
        return []
    pattern = re.compile(rf"\.{re.escape(target.name)}\.[A-Za-z0-9_]+\.partial")
    removed = []
    try:
        names = [entry.name for entry in os.scandir(target.parent) if pattern.fullmatch(entry.name)]
    except OSError:
        return removed
    for name in names:
        path = target.parent / name
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:  # gone, a link (O_NOFOLLOW), or not ours to read
            continue
        try:
            info = os.fstat(fd)
            if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or not _lock(fd, wait=False)):
                continue
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino):  # still the file checked: remove it
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _atomic_write(write, target: Path) -> None:
    """Run ``write(temp_path)`` then rename the temp file over ``target``.

    The temp file lives in a staging directory ``.NAME.PID-XXXX.partial`` beside ``target``, locked by this save
    (`h2o_compress.utils.files.staging_dir`; safetensors' own ``.tmpXXXXXX`` file goes there too). The new file gets
    the mode of the file it replaces (or ``0666`` less the umask). On any failure, including SIGTERM and SIGHUP (Ctrl-C
    raises KeyboardInterrupt), the staging directory is removed; one that an earlier save killed outright (SIGKILL)
    left is removed by the next save to the same target, as are the ``.NAME.XXXX.partial`` files of older versions
    (`remove_orphaned_partials`).
    """
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    remove_orphaned_partials(target)
    with _cleanup_on_signals(), staging_dir(target.parent, f".{target.name}.", ".partial") as staging:
        tmp = str(staging / target.name)
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    with contextlib.suppress(OSError):  # make the rename itself durable where the platform allows it
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def check_cache_source(path, header: bool = False) -> Path:
    """The path of a cache file to read, checked: it exists and is a regular file (not a device, FIFO or
    directory, which would block or never end); ``header`` true: also the file's safetensors header, readable, its
    tensors within the file's size, and an h2o-compress cache of this format version. The header only is read
    (the CLI checks it before the model loads; the checksum over the tensors is verified when the cache is read).

    Raises:
        CacheFileError: naming the path and what is allowed (or what is wrong).
    """
    source = _as_path(path)
    try:
        info = os.stat(source)
    except OSError:
        raise CacheFileError(
            f"cache file {short(str(source))} does not exist; allowed: a file written by save_cache()"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise CacheFileError(
            f"cache file {short(str(source))} is not a regular file ({_file_kind(info.st_mode)}); "
            "allowed: a file written by save_cache()"
        )
    if not header:
        return source
    try:
        with safe_open(str(source), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CacheFileError(f"cache file {str(source)!r} is truncated or not a safetensors file ({reason})") from None
    _check_format(metadata, source)
    return source


def check_cache_paths(save=None, load=None, overwrite: bool = False) -> None:
    """Refuse, before anything is loaded, a ``save`` target that cannot be written (or would replace a file that is
    not a cache file without ``overwrite``: [`check_save_target`][h2o_compress.persistence.check_save_target]) and a ``load`` source that cannot be read or
    whose header is not a cache file's (truncated, another format or version: `check_cache_source`);
    ``None`` skips either. What ``generate``/``ask`` ``--save-cache``/``--load-cache`` check first.

    Raises:
        CacheFileError: naming the path and what is allowed.
    """
    if save is not None:
        check_save_target(save, overwrite)
    if load is not None:
        check_cache_source(load, header=True)  # its header, before the model loads


def _check_format(metadata: dict[str, str], source: Path) -> None:
    """Refuse metadata that is not an h2o-compress cache's of `FORMAT_VERSION` (CacheFileError)."""
    if metadata.get("format") != FORMAT:
        raise CacheFileError(f"{str(source)!r} is not an h2o-compress cache file (format={metadata.get('format')!r})")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(
            f"cache file {str(source)!r} has format version {metadata.get('format_version')!r}; "
            f"allowed: {FORMAT_VERSION} (save it again with this version)"
        )


def read_cache_file(path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read and verify a saved cache: ``(metadata, tensors on CPU)``.

    Raises:
        CacheFileError: missing file, not a safetensors file, truncated, unknown format or version, or a
            checksum that does not match (the file was modified).
    """
    source = check_cache_source(path)
    try:
        with safe_open(str(source), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CacheFileError(f"cache file {str(source)!r} is truncated or not a safetensors file ({reason})") from None
    _check_format(metadata, source)
    if metadata.get("checksum") != _checksum(metadata, tensors):
        raise CacheFileError(f"cache file {str(source)!r} fails its checksum: it was truncated or modified")
    return metadata, tensors


def write_cache_file(target: Path, metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` (CPU, contiguous) and ``metadata`` to ``target`` atomically, adding ``format``,
    ``format_version``, ``library_version`` and the ``checksum``. ``target`` comes from [`check_save_target`][h2o_compress.persistence.check_save_target].

    Raises:
        CacheFileError: the write failed (full disk, file size limit, permission), naming the path and the reason.
    """
    metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__, **metadata}
    return write_checksummed(target, metadata, tensors, "cache file")


def write_checksummed(target: Path, metadata: dict[str, str], tensors: dict[str, torch.Tensor], what: str) -> Path:
    """Write ``tensors`` (CPU, contiguous) and ``metadata`` plus its ``checksum`` to ``target`` atomically
    (a cache file, a calibration file: ``what`` names it in the error).

    Raises:
        CacheFileError: the write failed (full disk, file size limit, permission), naming the path and the reason.
    """
    metadata = {**metadata, "checksum": _checksum(metadata, tensors)}
    try:
        _atomic_write(lambda tmp: save_file(tensors, tmp, metadata=metadata), target)
    except (OSError, SafetensorError) as exc:
        error = os_error(exc) or OSError(one_line(str(exc), 200))
        raise CacheFileError(write_failure(target, error, _file_bytes(metadata, tensors), what)) from None
    return target


def _file_bytes(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> int:
    """The size of the safetensors file of ``tensors`` and ``metadata`` (bytes), to within a few bytes of its header:
    the header's 8-byte length, the JSON header (metadata, and each tensor's dtype, shape and offsets) and the data."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    entries = {name: {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [data, data]} for name, t in tensors.items()}
    return 8 + len(json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":"))) + data
