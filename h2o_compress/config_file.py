"""Compression settings from a file: JSON (``.json``) or TOML (``.toml``), one object of
:class:`~h2o_compress.config.CompressionConfig` fields, e.g. ``{"policy": "h2o", "budget": 0.2, "kv_bits": 4}``.

Every problem (missing file, syntax error, unknown key, value out of range or of the wrong type) is a
:class:`~h2o_compress.errors.ConfigError` naming the file, the key and what is allowed.
"""

from __future__ import annotations

import json

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from dataclasses import fields
from pathlib import Path

from .config import CompressionConfig
from .errors import ConfigError

SUFFIXES = (".json", ".toml")


def config_fields() -> tuple[str, ...]:
    """Names of the :class:`CompressionConfig` fields a file may set."""
    return tuple(f.name for f in fields(CompressionConfig))


def read_config_values(path) -> dict:
    """The ``{field: value}`` object in ``path``, keys checked against :func:`config_fields` (values unchecked).

    Raises:
        ConfigError: missing file, unsupported suffix, syntax error, not an object, or an unknown key.
    """
    source = Path(path)
    if source.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"config file {str(source)!r} has an unsupported type; allowed: {', '.join(SUFFIXES)}")
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(source)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(source)!r} cannot be read ({exc})") from None
    try:
        values = json.loads(text) if source.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {str(source)!r} is not valid {source.suffix[1:].upper()}: {exc}") from None
    if not isinstance(values, dict):
        kind = type(values).__name__
        raise ConfigError(f"config file {str(source)!r} holds a {kind}; allowed: an object of settings")
    allowed = config_fields()
    unknown = sorted(k for k in values if k not in allowed)
    if unknown:
        keys = ", ".join(map(repr, unknown))
        raise ConfigError(f"unknown key(s) {keys} in {str(source)!r}; allowed: {', '.join(allowed)}")
    return values


def load_config(path, overrides: dict | None = None) -> CompressionConfig:
    """A validated :class:`CompressionConfig` from ``path``, with ``overrides`` (e.g. CLI flags) on top.

    Raises:
        ConfigError: see :func:`read_config_values`, or a value :class:`CompressionConfig` rejects (the message
            then names the file).
    """
    values = {**read_config_values(path), **(overrides or {})}
    try:
        return CompressionConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in config file {str(path)!r})") from None
