"""The checks every job shares, run when a job is made (before anything is loaded or written): the settings a
``run_*`` call passes on, the model name, the switches, the load options and the paths, each refused with one
[`H2OCompressError`][h2o_compress.H2OCompressError] naming the value and what is allowed, never a ``TypeError`` from a
dataclass or ``load_model`` minutes later.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from h2o_compress.config import CompressionConfig
from h2o_compress.models import placement_options
from h2o_compress.models.loading import check_model_name
from h2o_compress.runtime.generation import ON_TEXT, GenerationRequest
from h2o_compress.utils.checks import check_callback, check_flag
from h2o_compress.utils.errors import ConfigError, InputError, short
from h2o_compress.utils.files import check_path


class JobRequest:
    """The request of one command (generate, ask, batch), validated once, when the job is made: each job's
    ``__post_init__`` runs `_validate_shared` (the fields every job has) and builds its
    [`GenerationRequest`][h2o_compress.runtime.generation.GenerationRequest] (`_generation_request`; kept as its
    ``request``), so nothing is loaded or written before every value is known to be good; ``run`` then trusts them. `from_call` is the
    ``run_*`` functions' door: their ``**settings`` and callbacks checked, then the job made."""

    @classmethod
    def from_call(cls, taken: tuple[str, ...], args: tuple, settings: dict, **callbacks):
        """``cls(*args, **settings)``, after refusing a key of ``settings`` (the ``**settings`` of a ``run_*``
        call) that is not a field of the job or is one of ``taken`` (the call's own arguments, given again), and a
        callback (``on_text=...``) that is neither callable nor ``None``.

        Raises:
            ConfigError: naming the key or the callback and what is allowed; the job's own errors when made.
        """
        fields = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in taken]
        unknown = sorted(str(key) for key in settings if key not in fields)
        if unknown:
            raise ConfigError(f"unknown setting {', '.join(map(short, unknown))} for {cls.__name__}; allowed: "
                              f"{', '.join(fields)}")
        for name, value in callbacks.items():
            check_callback(name, value, ON_TEXT if name == "on_text" else "a function or None")
        return cls(*args, **settings)

    def _validate_shared(self) -> None:
        """The fields every job shares: ``model`` a non-empty text, the `SWITCHES` booleans, ``given`` a dict,
        ``load`` the keyword arguments of ``load_model`` (`LOAD_KEYS`, each value as ``load_model`` would check it),
        the `PATHS` paths.

        Raises:
            ModelLoadError: ``model`` not a non-empty text; 8/4-bit weights bitsandbytes cannot run here.
            ConfigError: a switch that is not a bool, ``given`` not a dict, ``load`` not a dict, an unknown key of
                it, or a value ``load_model`` refuses (device, dtype, weights bits, device map, max memory, offload
                folder).
            InputError: a path that is not a str or ``os.PathLike``.
        """
        check_model_name(self.model)
        for name in SWITCHES:
            check_flag(name, getattr(self, name, False))
        if not isinstance(getattr(self, "given", {}), dict):
            raise ConfigError(f"given={short(self.given)} is invalid; allowed: a dict of the settings given explicitly")
        load = self.load
        if not isinstance(load, dict):
            raise ConfigError(f"load={short(load)} is invalid; allowed: a dict of load_model arguments "
                              f"({', '.join(LOAD_KEYS)})")
        unknown = sorted(str(key) for key in load if key not in LOAD_KEYS)
        if unknown:
            raise ConfigError(f"load has the unknown key {', '.join(map(short, unknown))}; allowed: "
                              f"{', '.join(LOAD_KEYS)}")
        placement_options(**load)
        for name, (what, optional) in PATHS.items():
            if hasattr(self, name) and not (optional and getattr(self, name) is None):
                check_path(getattr(self, name), what, InputError)

    def _generation_request(self, config: CompressionConfig | None = None) -> GenerationRequest:
        """The job's generation settings as a [`GenerationRequest`][h2o_compress.runtime.generation.GenerationRequest]
        for ``config`` (default: the job's): ``max_new_tokens``, ``temperature``, ``seed``, ``chat`` and
        ``compile`` validated as [`h2o_compress.generate`][h2o_compress.generate] validates them (``compile``
        for that setting).

        Raises:
            ConfigError: naming the value and what is allowed.
        """
        return GenerationRequest(self.config if config is None else config, self.max_new_tokens, self.chat,
                                 self.temperature, self.seed, self.compile)


@dataclass(kw_only=True)
class CacheRunFields(JobRequest):
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


#: The keyword arguments of [`load_model`][h2o_compress.load_model] a job's ``load`` may carry (the model and
#: ``trust_remote_code`` are fields of the job itself).
LOAD_KEYS = ("device", "dtype", "weights_bits", "device_map", "max_memory", "offload_folder")
