"""Compression settings from a file: JSON (``.json``) or TOML (``.toml``), one object of the flat settings of
[`CompressionConfig`][h2o_compress.config.CompressionConfig] (`h2o_compress.config.SETTING_DEFAULTS`), e.g.
``{"policy": "h2o", "budget": 0.2, "kv_bits": 4}``, and of the registered policies' own options by their config
names (those without a setting of their own go into ``policy_options``).

Every problem (missing file, syntax error, unknown key, value out of range or of the wrong type) is a
[`ConfigError`][h2o_compress.ConfigError] naming the file, the key and what is allowed.
"""

from __future__ import annotations

from pathlib import Path

from h2o_compress.config import SETTING_DEFAULTS, CompressionConfig, unfielded_policy_options
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.utils.files import check_path, parse_json, parse_toml, read_text

SUFFIXES = (".json", ".toml")


def config_fields() -> tuple[str, ...]:
    """Names a file may set: the flat settings of [`CompressionConfig`][h2o_compress.config.CompressionConfig]
    (`h2o_compress.config.SETTING_DEFAULTS`, in order), then the registered policies' options that have no setting
    of their own."""
    return tuple(SETTING_DEFAULTS) + unfielded_policy_options()


def read_config_values(path) -> dict:
    """The ``{field: value}`` object in ``path``, keys checked against `config_fields` (values unchecked).

    Raises:
        ConfigError: not a path, missing file, unsupported suffix, syntax error, not an object, or an unknown key.
    """
    source = Path(check_path(path, "config file", ConfigError))
    name = short(str(source))
    if source.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"config file {name} has an unsupported type; allowed: {', '.join(SUFFIXES)}")
    text = read_text(source, "config file", ConfigError)
    parse = parse_json if source.suffix.lower() == ".json" else parse_toml
    values = parse(text, f"config file {name}", ConfigError, bounded=True)
    if not isinstance(values, dict):
        kind = type(values).__name__
        raise ConfigError(f"config file {name} holds a {kind}; allowed: an object of settings")
    allowed = config_fields()
    unknown = sorted(k for k in values if k not in allowed)
    if unknown:
        keys = short(", ".join(map(repr, unknown)), repr_=False)
        raise ConfigError(f"unknown key(s) {keys} in {name}; allowed: {', '.join(allowed)}")
    return values


def load_config(path, overrides: dict | None = None, defaults: dict | None = None) -> CompressionConfig:
    """A validated [`CompressionConfig`][h2o_compress.config.CompressionConfig] from ``path``, with ``overrides`` (e.g. CLI flags) on top and
    ``defaults`` (e.g. a command's own defaults) beneath: fields none of the three sets keep the class's defaults.

    Raises:
        ConfigError: see `read_config_values`, or a value [`CompressionConfig`][h2o_compress.config.CompressionConfig] rejects (the message
            then names the file); ``overrides`` or ``defaults`` that are not dicts of field names.
    """
    for name, given in (("overrides", overrides), ("defaults", defaults)):
        if given is not None and not (isinstance(given, dict) and all(isinstance(key, str) for key in given)):
            raise ConfigError(f"{name}={short(given)} is invalid; allowed: a dict of CompressionConfig fields, or None")
    values = {**(defaults or {}), **read_config_values(path), **(overrides or {})}
    try:
        return CompressionConfig.from_values(values)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in config file {short(str(path))})") from None
    except TypeError as exc:  # e.g. a value of a type no field takes
        raise ConfigError(f"config file {short(str(path))}: {short(str(exc), repr_=False)}") from None
