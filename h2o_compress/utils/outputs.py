"""Writing into a directory a user names (``profile --out``) without ever replacing a file of theirs.

A manifest in the directory (`MANIFEST`) records the name and SHA-256 of every file this package wrote
there. A file may be replaced only while it is still what the manifest says this package wrote; anything else of
the same name (a user's report.md, or a file edited since) is refused. Writes go to a temporary file in the
directory, then ``os.replace``: a symlink at the name is replaced, never followed, and a reader never sees half a
file. A leaf module.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

from h2o_compress.utils.errors import InputError, short, write_failure

MANIFEST = ".h2o-compress-manifest.json"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_out_path(out_dir) -> Path:
    """``out_dir`` as a path, refused when empty.

    Raises:
        InputError: an empty or whitespace-only path (it would mean the current directory).
    """
    if out_dir is None or not str(out_dir).strip():
        raise InputError("the output directory is empty (it would write into the current directory); allowed: a "
                         "directory path, e.g. --out results/run1")
    return Path(out_dir)


class OutputDir:
    """A directory that reports are written into (see the module docstring).

    Args:
        path: the directory (it need not exist yet: `write` creates it).
    """

    def __init__(self, path) -> None:
        self.path = check_out_path(path)

    def manifest(self) -> dict[str, str]:
        """``{file name: sha256}`` of what this package wrote here (empty when none or unreadable)."""
        file = self.path / MANIFEST
        try:
            if not stat.S_ISREG(os.lstat(file).st_mode):
                return {}
            entries = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, str)}

    def ours(self, name: str) -> bool:
        """Whether ``name`` is absent, or a regular file (no symlink) still holding what this package wrote."""
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
            return recorded is not None and _digest(file.read_bytes()) == recorded
        except OSError:
            return False

    def foreign(self, names) -> list[str]:
        """Those of ``names`` that exist here and were not written by this package (or were changed since)."""
        return [name for name in names if not self.ours(name)]

    def write(self, name: str, data: bytes | str) -> Path:
        """Write ``data`` (text as UTF-8) to ``name`` atomically and record it in the manifest.

        Raises:
            InputError: ``name`` holds something this package did not write, or the directory cannot be written.
        """
        if not self.ours(name):
            raise InputError(f"{short(str(self.path / name))} was not written by h2o-compress (or was changed since): "
                             "it is not replaced; allowed: a new or empty output directory")
        data = data.encode("utf-8") if isinstance(data, str) else data
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            _replace(self.path / name, data)
            manifest = self.manifest() | {name: _digest(data)}
            _replace(self.path / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        except OSError as exc:
            raise InputError(write_failure(self.path / name, exc, len(data))) from None
        return self.path / name


def _replace(target: Path, data: bytes) -> None:
    """``data`` into ``target`` through a temporary file in its directory and ``os.replace`` (no symlink followed)."""
    handle, tmp = tempfile.mkstemp(prefix=".h2o-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
