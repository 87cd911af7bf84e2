"""Writing into a directory a user names (``profile --out``) without ever replacing a file of theirs.

A manifest in the directory (`MANIFEST`) records the name of every file this package wrote there and its
HMAC-SHA-256 under a key only this user has (`manifest_key`: 32 random bytes made once in
``$H2O_COMPRESS_CACHE/keys``, a directory only this user can write and read). A file may be replaced only while it is
still what the manifest says this package wrote; anything else of the same name (a user's report.md, a file edited
since, or one that a hand-edited manifest lists with its plain SHA-256) is refused: without the key, no manifest
entry can be forged. A manifest path that is not a regular file holding a manifest (a directory, a symlink, a
user's file) is refused before anything is written. Writes go to a temporary file in the directory, then
``os.replace``: a symlink at the name is replaced, never followed, and a reader never sees half a file; the file and
the new manifest are both written before either is renamed, so a full disk leaves both as they were.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path

from h2o_compress.utils.errors import ConfigError, InputError, short, write_failure
from h2o_compress.utils.files import staging_file, write_all
from h2o_compress.utils.paths import check_private, private_dir

MANIFEST = ".h2o-compress-manifest.json"
KEY_FILE = "manifest.key"
KEY_BYTES = 32
STAGING_PREFIX = ".h2o-"
"""Staging files of a write here: ``.h2o-PID-XXXXXXXX.tmp`` (`h2o_compress.utils.files.staging_file`; one a
killed run left is removed by the next write here)."""
SIGNED = "hmac-sha256:"
"""How a signed manifest entry starts (then the HMAC-SHA-256 in hex); an entry without it vouches for nothing."""


def manifest_key() -> bytes:
    """This user's key for manifest entries: ``$H2O_COMPRESS_CACHE/keys/manifest.key`` (`private_dir`), made once
    (mode 0600, published whole by a hard link, so two processes making it at once read the same key).

    Raises:
        ConfigError: the cache directory is unusable or not this user's own, or the key file is not one this
            package made (a symlink, another user's, writable by others, of another size).
    """
    path = private_dir("keys") / KEY_FILE
    try:
        if not os.path.lexists(path):
            handle, tmp = tempfile.mkstemp(prefix=".key-", dir=path.parent)  # mode 0600
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(secrets.token_bytes(KEY_BYTES))
                    out.flush()
                    os.fsync(out.fileno())
                try:
                    os.link(tmp, path)
                except FileExistsError:  # another process made it first: use that one
                    pass
            finally:
                Path(tmp).unlink(missing_ok=True)
        check_private(path, "file")
        key = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"the manifest key {short(str(path))} cannot be made or read ({exc.strerror or exc}); "
                          "allowed: a writable H2O_COMPRESS_CACHE directory of your own") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"the manifest key {short(str(path))} holds {len(key)} bytes, not {KEY_BYTES}; allowed: "
                          "remove it (a new key is made; reports written with the old one are then not replaced)")
    return key


def _kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, for a message."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


class OutputDir:
    """A directory that reports are written into (see the module docstring).

    Args:
        path: the directory (it need not exist yet: `write` creates it).

    Raises:
        InputError: an empty or whitespace-only ``path`` (it would mean the current directory).
    """

    def __init__(self, path) -> None:
        if path is None or not str(path).strip():
            raise InputError("the output directory is empty (it would write into the current directory); allowed: a "
                             "directory path, e.g. --out results/run1")
        self.path = Path(path)
        self._key: bytes | None = None

    def manifest(self) -> dict[str, str]:
        """``{file name: signature}`` of what this package wrote here (empty when there is no manifest).

        Raises:
            InputError: the manifest path holds something else (`check`).
        """
        file = self.path / MANIFEST
        try:
            info = os.lstat(file)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise self._refused(f"cannot be read ({exc.strerror or exc})") from None
        if not stat.S_ISREG(info.st_mode):
            raise self._refused(f"is {_kind(info.st_mode)}, not a manifest file")
        try:
            entries = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            entries = None
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise self._refused("is not a manifest h2o-compress wrote (a JSON object of file names and signatures)")
        return entries

    def _refused(self, why: str) -> InputError:
        return InputError(f"the manifest path {short(str(self.path / MANIFEST))} {why}; nothing is written there; "
                          "allowed: a new or empty directory, or the output directory of an earlier profile run "
                          "(choose another --out)")

    def check(self) -> None:
        """Refuse this directory before anything is written when its manifest path holds anything but a manifest,
        or this user's manifest key cannot be had (`manifest_key`).

        Raises:
            InputError: the manifest path is a directory, a symlink or another non-regular file, or a file that is
                not a manifest.
            ConfigError: as `manifest_key`.
        """
        self.manifest()
        self._sign("", b"")

    def _sign(self, name: str, data: bytes) -> str:
        """The manifest entry of ``data`` written as ``name``: its HMAC-SHA-256 under `manifest_key`."""
        if self._key is None:
            self._key = manifest_key()
        return SIGNED + hmac.new(self._key, name.encode("utf-8") + b"\0" + data, hashlib.sha256).hexdigest()

    def ours(self, name: str) -> bool:
        """Whether ``name`` is absent, or a regular file (no symlink) still holding what this package wrote (its
        signature in the manifest: an entry made without this user's key never matches)."""
        file = self.path / name
        try:
            info = os.lstat(file)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if not stat.S_ISREG(info.st_mode):
            return False
        recorded = self.manifest().get(name)
        try:
            return recorded is not None and hmac.compare_digest(self._sign(name, file.read_bytes()), recorded)
        except OSError:
            return False

    def foreign(self, names) -> list[str]:
        """Those of ``names`` that exist here and were not written by this package (or were changed since)."""
        return [name for name in names if not self.ours(name)]

    def write(self, name: str, data: bytes | str) -> Path:
        """Write ``data`` (text as UTF-8) to ``name`` atomically and record it in the manifest; a new file whose
        manifest entry cannot be written is removed again.

        Raises:
            InputError: ``name`` holds something this package did not write, the manifest path something else than
                a manifest, or the directory cannot be written.
        """
        self.check()
        if not self.ours(name):
            raise InputError(f"{short(str(self.path / name))} was not written by h2o-compress (or was changed since): "
                             "it is not replaced; allowed: a new or empty output directory")
        data = data.encode("utf-8") if isinstance(data, str) else data
        target = self.path / name
        listing = b""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            manifest = self.manifest() | {name: self._sign(name, data)}
            listing = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
            new = not os.path.lexists(target)
            with staging_file(self.path, STAGING_PREFIX, ".tmp") as (fd, tmp), \
                    staging_file(self.path, STAGING_PREFIX, ".tmp") as (manifest_fd, manifest_tmp):
                write_all(fd, data)  # both written before either is renamed: a full disk changes neither
                write_all(manifest_fd, listing)
                os.replace(tmp, target)  # no symlink at either name is followed
                try:
                    os.replace(manifest_tmp, self.path / MANIFEST)
                except BaseException:
                    if new:  # never a file the manifest does not vouch for
                        target.unlink(missing_ok=True)
                    raise
        except OSError as exc:
            raise InputError(write_failure(target, exc, len(data) + len(listing))) from None
        return target
