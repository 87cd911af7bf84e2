"""Where h2o-compress keeps what it builds once: converted models and compiled kernels (a leaf module).

Everything the package loads from there is trusted only if this user made it: it lives in directories owned by this
user that nobody else can write (`private_dir`), checked before loading (`check_private`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.utils.files import make_dir


def cache_root() -> Path:
    """Directory of converted models: ``$H2O_COMPRESS_CACHE`` (unset or empty: ``~/.cache/h2o-compress``)."""
    value = os.environ.get("H2O_COMPRESS_CACHE", "")
    return Path(value) if value.strip() else Path.home() / ".cache" / "h2o-compress"


def check_cache_root(root: Path) -> Path:
    """``root`` if it is (or can be created as) a writable directory.

    Raises:
        ConfigError: it exists and is not a directory, cannot be created, or is not writable.
    """
    name = f"H2O_COMPRESS_CACHE directory {short(str(root))}"
    make_dir(root, lambda exc: ConfigError(
        f"{name} is not a directory; allowed: a writable directory, or unset" if exc is None
        else f"{name} cannot be created ({exc.strerror}); allowed: a writable directory"))
    if not root.is_dir():
        raise ConfigError(f"{name} is not a directory; allowed: a writable directory, or unset")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} is not writable; allowed: a writable directory, or unset")
    return root


def _fix(path: Path) -> str:
    where = short(str(path), 120, repr_=False)
    return (f"allowed: a directory of your own that only you can write (chmod 700 {where}), or H2O_COMPRESS_CACHE "
            "set to one")


def check_private(path: Path, what: str = "directory") -> None:
    """Refuse ``path`` unless it is no symlink, owned by this user and not writable by group or others: what the
    package loads from it (compiled kernels, converted models) is then this user's own. ``what``: ``"directory"``
    or ``"file"`` (a file to load from a private directory, which must also be a regular file).

    Raises:
        ConfigError: naming the path, who owns it, its mode or its kind, and the fix.
    """
    name = short(str(path))
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"cache {what} {name} is a symbolic link; what it points to could be anyone's; {_fix(path)}")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise ConfigError(f"cache {what} {name} belongs to another user (uid {info.st_uid}, you are {os.getuid()}): "
                          f"it is not loaded; {_fix(path)}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"cache {what} {name} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): it "
                          f"is not loaded; {_fix(path)}")
    if what == "file" and not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"cache file {name} is not a regular file; {_fix(path.parent)}")


def private_dir(*parts: str) -> Path:
    """``cache_root() / parts`` as a directory only this user can write, created (mode 0700) if absent. Where the
    cache root itself is shared (owned by another user, or writable by others: a team's cache on a GPU server), the
    package's files go into ``cache_root() / "user-<uid>"`` instead, so nobody else can plant or swap them.

    Raises:
        ConfigError: the root is unusable (`check_cache_root`), or an existing directory on the way is not
            this user's own (`check_private`).
    """
    root = check_cache_root(cache_root())
    try:
        check_private(root, "directory")
    except ConfigError:
        root = root / f"user-{os.getuid() if hasattr(os, 'getuid') else 0}"
        _make(root)
    path = root
    for part in parts:
        path = path / part
        _make(path)
    return path


def _make(path: Path) -> None:
    """Create ``path`` with mode 0700 if absent, then `check_private` it."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(
            f"cache directory {short(str(path))} cannot be created ({exc.strerror}); {_fix(path)}") from None
    check_private(path)
