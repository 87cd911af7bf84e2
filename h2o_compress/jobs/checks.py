"""The checks every job shares, run when a job is made (before anything is loaded or written): the settings a
``run_*`` call passes on, the model name, the switches, the load options and the paths, each refused with one
[`H2OCompressError`][h2o_compress.H2OCompressError] naming the value and what is allowed, never a ``TypeError`` from a
dataclass or ``load_model`` minutes later.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from h2o_compress.models import placement_options
from h2o_compress.runtime.compiled import check_compile
from h2o_compress.runtime.generation import check_generation_args
from h2o_compress.utils.errors import ConfigError, InputError, ModelLoadError, short
from h2o_compress.utils.files import check_path

@dataclass(kw_only=True)
class CacheRunFields:
    """The fields `GenerateJob` and `AskJob` share, after their own (keyword-only): the cache file to write
    (``save_cache``, replacing an existing file only with ``overwrite``) or to resume from (``load_cache``), the
    settings given explicitly (``given``, which ``--config`` files go under), ``load_model``'s keyword arguments
    (``load``), torch CPU ``threads`` and ``trust_remote_code`` (run a model directory's own code)."""

    save_cache: str | None = None
    load_cache: str | None = None
    overwrite: bool = False
    given: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)
    threads: int | None = None
    trust_remote_code: bool = False


#: Fields of a job that are switches: each must be ``True`` or ``False``.
SWITCHES = ("chat", "overwrite", "trust_remote_code", "verbose")
#: Fields of a job that name a file it reads or writes: how messages name each, and whether ``None`` is allowed.
PATHS = {"input": ("input file", False), "output": ("output", False), "context_file": ("context file", True)}


def check_settings(job_class, settings: dict, taken: tuple[str, ...]) -> None:
    """Refuse a key of ``settings`` (the ``**settings`` of a ``run_*`` call) that is not a field of ``job_class``,
    or one of ``taken`` (the call's own arguments, given again).

    Raises:
        ConfigError: naming the key and the settings allowed.
    """
    fields = [f.name for f in dataclasses.fields(job_class) if f.init and f.name not in taken]
    unknown = sorted(str(key) for key in settings if key not in fields)
    if unknown:
        raise ConfigError(f"unknown setting {', '.join(map(short, unknown))} for {job_class.__name__}; allowed: "
                          f"{', '.join(fields)}")


def check_callbacks(**callbacks) -> None:
    """Refuse a callback (``on_text=...``) that is neither callable nor ``None``, before anything runs.

    Raises:
        ConfigError: naming the argument and its value.
    """
    for name, value in callbacks.items():
        if value is not None and not callable(value):
            raise ConfigError(f"{name}={short(value)} is not callable; allowed: a function or None")


#: The keyword arguments of [`load_model`][h2o_compress.load_model] a job's ``load`` may carry (the model and
#: ``trust_remote_code`` are fields of the job itself).
LOAD_KEYS = ("device", "dtype", "weights_bits", "device_map", "max_memory", "offload_folder")


def check_load(load) -> dict:
    """``load`` (keyword arguments of ``load_model``) checked as ``load_model`` would check them, before it runs.

    Raises:
        ConfigError: not a dict, an unknown key, or a value ``load_model`` refuses (device, dtype, weights bits,
            device map, max memory, offload folder).
        ModelLoadError: 8/4-bit weights bitsandbytes cannot run here.
    """
    allowed = LOAD_KEYS
    if not isinstance(load, dict):
        raise ConfigError(f"load={short(load)} is invalid; allowed: a dict of load_model arguments ({', '.join(allowed)})")
    unknown = sorted(str(key) for key in load if key not in allowed)
    if unknown:
        raise ConfigError(f"load has the unknown key {', '.join(map(short, unknown))}; allowed: {', '.join(allowed)}")
    placement_options(**load)
    return load


def check_job(job) -> None:
    """The fields every job (generate, ask, batch) shares: ``model`` a non-empty text, the `SWITCHES` booleans,
    ``given`` a dict, ``load`` as [`check_load`][h2o_compress.jobs.checks.check_load] says, the `PATHS` paths.

    Raises:
        ModelLoadError: ``model`` not a non-empty text.
        ConfigError: a switch that is not a bool, ``given`` not a dict, a bad ``load``.
        InputError: a path that is not a str or ``os.PathLike``.
    """
    if not isinstance(job.model, str) or not job.model.strip():
        raise ModelLoadError(f"model name {short(job.model)} is empty or not a text; allowed: an alias, a local model "
                             "directory or a hub id (a str)")
    for name in SWITCHES:
        value = getattr(job, name, False)
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={short(value)} is invalid; allowed: True or False")
    if not isinstance(getattr(job, "given", {}), dict):
        raise ConfigError(f"given={short(job.given)} is invalid; allowed: a dict of the settings given explicitly")
    check_load(job.load)
    for name, (what, optional) in PATHS.items():
        if hasattr(job, name) and not (optional and getattr(job, name) is None):
            check_path(getattr(job, name), what, InputError)


def check_generation(job) -> None:
    """The generation settings every job that generates (generate, ask, batch) checks when it is made, after its
    ``config`` is set: ``max_new_tokens``, ``temperature`` and ``seed`` as [`h2o_compress.generate`][h2o_compress.generate] allows them
    (`check_generation_args`), and ``compile`` for the job's setting (`check_compile`); ``generate`` itself does not
    check them again for the job.

    Raises:
        ConfigError: naming the value and what is allowed.
    """
    check_generation_args(job.max_new_tokens, job.temperature, job.seed)
    check_compile(job.compile, job.config)
