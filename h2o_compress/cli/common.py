"""What every command shares: one-line errors (exit code 2), torch threads, the ``--config`` merge."""

from __future__ import annotations

import functools
from typing import Optional

import typer

from h2o_compress.config import CompressionConfig, check_format_options, check_usable
from h2o_compress.utils.errors import H2OCompressError, one_line
from h2o_compress.cli.options import Compression
from h2o_compress.attention.choice import check_kernel
from h2o_compress.config_file import load_config, read_config_values
from h2o_compress.utils.checks import check_threads
from h2o_compress.models import placement_options
from h2o_compress.models.weights import parse_device_map


def fail(message: str) -> None:
    """Print ``error: message`` (one line) to stderr and exit with code 2."""
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(2)


def user_errors(fn):
    """Turn H2OCompressError into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except H2OCompressError as exc:
            fail(str(exc))

    return wrapper


def set_threads(threads: Optional[int]) -> None:
    """Apply ``--threads N`` to torch (``None``: leave torch's default). Raises ConfigError for N < 1 or more than
    `h2o_compress.utils.checks.max_threads` (a few per CPU: thousands of threads end the process when they cannot
    all be started)."""
    if threads is None:
        return
    check_threads(threads)
    import torch

    torch.set_num_threads(threads)


def merged_config(compression: Compression, config_file: Optional[str], frozen: bool = False,
                  check_formats: bool = True, usable: bool = True) -> tuple[CompressionConfig, dict]:
    """The compression flags merged over ``--config FILE`` (JSON/TOML), which goes over the command's own defaults
    (``ask``'s): flags given on the command line win; checked by [`check_usable`][h2o_compress.config.check_usable]
    (``frozen``: for compress-then-ask; not with ``usable`` false, where the job checks it when made) and, with ``check_formats`` (not where the planner picks the bits or a
    loaded cache brings its own), by [`check_format_options`][h2o_compress.config.check_format_options].

    Returns ``(config, settings)``: the merged config, and the settings the user asked for explicitly (the
    file's plus the flags given), which a loaded cache's config must match. Raises ConfigError.
    """
    config = compression.config(check=False)
    overrides = compression.overrides(config)
    settings = overrides
    if config_file is not None:
        config = load_config(config_file, overrides, compression.command_defaults())
        settings = {**read_config_values(config_file), **overrides}
    if usable:  # not where the job the config goes to checks it itself (GenerateJob)
        check_usable(config, frozen=frozen)
    if check_formats:
        check_format_options(config, settings)
    return config, settings


def load_options(device: str, dtype: Optional[str], placement: dict, attention_kernel: str = "auto") -> dict:
    """The keyword arguments of [`h2o_compress.load_model`][h2o_compress.load_model] for ``--device``, ``--dtype`` and the placement
    flags (`h2o_compress.cli.options.placement_flags`), all checked now, before any side effect
    (``--device-map`` parsed from its name, JSON or file), with ``--kernel`` against the device
    (`check_kernel`). Raises ConfigError or ModelLoadError."""
    options = {"device": device, "dtype": dtype, **placement, "device_map": parse_device_map(placement["device_map"])}
    check_kernel(attention_kernel, placement_options(**options)["_device"])  # where the weights (and cache) go
    return options
