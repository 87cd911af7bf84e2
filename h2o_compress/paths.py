"""Where h2o-compress keeps what it builds once: converted models and compiled kernels (a leaf module)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError, short


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
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{name} is not a directory; allowed: a writable directory, or unset") from None
    except OSError as exc:
        raise ConfigError(f"{name} cannot be created ({exc.strerror}); allowed: a writable directory") from None
    if not root.is_dir():
        raise ConfigError(f"{name} is not a directory; allowed: a writable directory, or unset")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} is not writable; allowed: a writable directory, or unset")
    return root
