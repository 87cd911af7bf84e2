"""Finished profile rows on disk, so that a rerun of the same sweep resumes (a leaf module: it imports nothing of
the profile).

Each configuration that finishes is written at once to ``OUT/rows/<label>.<hash>.json`` (a temporary file renamed
over the target, so a killed sweep never leaves half a row). The hash is that of the row's *key*: the compression
configuration, the model (its name, and for a local directory the names, sizes and modification times of its
files and the text of its config.json), every measurement setting of the sweep (lengths, tokens, prompts,
isolation, threads, device, dtype, compile, quality texts...; not the grid lists), the SHA-256 of each text read
(the main text and every quality text), and the versions
of h2o-compress, torch and transformers. A rerun reuses a row only when the key stored in its file equals the key
of the configuration now asked for, so a changed setting never reuses a stale row: it measures again and writes a
new file beside the old one (nothing is deleted).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import re
import stat
from pathlib import Path

from h2o_compress.utils.errors import InputError, short, write_failure
from h2o_compress.utils.files import staging_file, write_all

ROWS_DIR = "rows"
FORMAT = 2  # 2: peaks restarted per run (workspace, run adds), KV held vs the uncompressed cache in the model dtype
# ProfileSettings fields that list the grid: each row's own configuration stands for them in its key.
GRID_FIELDS = ("policies", "budgets", "kv_bits")


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def model_identity(model: str) -> dict:
    """What identifies ``model`` (an alias, hub id or local directory) without loading it: its name, and for a
    local directory the ``(name, bytes, mtime_ns)`` of each file in it and the text of its ``config.json``."""
    identity: dict = {"name": model}
    path = Path(model)
    if path.is_dir():
        files = []
        for entry in sorted(path.iterdir()):
            if entry.is_file():
                info = entry.stat()
                files.append([entry.name, info.st_size, info.st_mtime_ns])
        identity["files"] = files
        config = path / "config.json"
        if config.is_file():
            identity["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    return identity


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def row_key(settings: dict, config: dict, text: str, isolate: bool, quality_texts: dict | None = None) -> dict:
    """The key of one row (JSON-normalised, so it compares equal to the key read back from its file).

    Args:
        settings: the sweep's settings (``dataclasses.asdict(ProfileSettings)``); the grid lists are left out.
        config: the row's ``CompressionConfig.to_dict()``.
        text: the text the sweep reads (perplexity, speed and passkey runs).
        isolate: whether the row is measured in a fresh worker process (it changes what peak memory means).
        quality_texts: ``{name: text}`` of the sweep's quality texts (a file's content may change under its name);
            none (default) adds nothing (their names are in ``settings``).
    """
    key = {
        "format": FORMAT,
        "config": config,
        "model": model_identity(settings["model"]),
        "settings": {k: v for k, v in settings.items() if k not in GRID_FIELDS and k != "isolate"},
        "isolate": bool(isolate),
        "text_sha256": _sha256(text),
        "packages": {name: _version(name) for name in ("h2o-compress", "torch", "transformers")},
    }
    if quality_texts:
        key["quality_texts_sha256"] = {name: _sha256(value) for name, value in quality_texts.items()}
    return json.loads(json.dumps(key, sort_keys=True, default=str))


class RowStore:
    """The finished rows of a sweep in ``out_dir/rows`` (created on the first `save`). ``rows`` is never followed
    when it is a symbolic link (rows would be written into, and read from, the directory it names).

    Raises:
        InputError (from the constructor): ``out_dir/rows`` exists and is not a directory (`check`).
    """

    def __init__(self, out_dir: str | Path):
        self.dir = self.check(out_dir)

    @staticmethod
    def check(out_dir: str | Path) -> Path:
        """``out_dir/rows``, refused unless it is absent or a directory (not a symbolic link, even to one); creates
        nothing (run before the sweep does any work).

        Raises:
            InputError: naming the path and what it is.
        """
        rows = Path(out_dir) / ROWS_DIR
        if rows.is_symlink():
            raise InputError(f"{short(str(rows))} is a symbolic link (to {short(os.readlink(rows))}): the finished "
                             "rows would be written into what it names; allowed: a directory that holds the finished "
                             "rows of the sweep (or no such path)")
        if os.path.lexists(rows) and not rows.is_dir():
            raise InputError(f"{short(str(rows))} exists and is not a directory; allowed: a directory that "
                             "holds the finished rows of the sweep (or no such path)")
        return rows

    def path(self, key: dict, label: str) -> Path:
        """``rows/<label>.<first 20 hex digits of the key's SHA-256>.json``."""
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        name = re.sub(r"[^A-Za-z0-9.-]+", "_", label)
        return self.dir / f"{name}.{digest}.json"

    def load(self, key: dict, label: str) -> dict | None:
        """The record finished earlier under exactly ``key``, or ``None`` (no file, unreadable, another key)."""
        path = self.path(key, label)
        try:
            if self.dir.is_symlink() or not stat.S_ISREG(os.lstat(path).st_mode):  # never read through a link
                return None
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("record"), dict):
            return None
        return stored["record"]

    def save(self, key: dict, label: str, record: dict) -> Path:
        """Write ``record`` under ``key`` atomically (temporary file in the same directory, then ``os.replace``).

        Raises:
            InputError: the row cannot be written (disk full, read-only or not ours): one line naming the file and
                the bytes it needed; no temporary file is left behind.
        """
        path = self.path(key, label)
        data = json.dumps({"key": key, "record": record}, indent=1, default=str).encode("utf-8")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.check(self.dir.parent)  # a symbolic link put there since the sweep began: not followed
            with staging_file(self.dir, ".row-", ".tmp") as (handle, tmp):  # removed unless renamed: never half a row
                write_all(handle, data)
                os.replace(tmp, path)
        except OSError as exc:
            raise InputError(write_failure(path, exc, len(data))) from None
        return path
