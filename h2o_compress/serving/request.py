"""`ServeRequest`: the settings of one server ([`h2o_compress.serving.serve`][h2o_compress.serving.serve], ``h2o-compress
serve``), validated once, when made, before anything loads; `build_app`, `serve_on_ray` and the `Engine` trust it.

The checks are grouped as the settings belong together: where the server listens (`_validate_listening`), the
compression setting, how it shuts down and whether it runs on Ray (`_validate_shutdown`), the batches and the
requests' defaults, the prefix cache (`_validate_prefix_cache`), and how the model is loaded (`_validate_loading`).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from dataclasses import dataclass

from h2o_compress.config import CompressionConfig
from h2o_compress.models import DEFAULT_MODEL, placement_options
from h2o_compress.models.loading import check_model_name
from h2o_compress.planner import parse_memory
from h2o_compress.policies import POLICIES
from h2o_compress.runtime.batch import check_batch_size
from h2o_compress.runtime.compiled import check_compile
from h2o_compress.runtime.generation import check_config, check_generation_args
from h2o_compress.utils.checks import check_count, check_flag, check_threads, is_integer, is_real
from h2o_compress.utils.errors import ConfigError, short

#: The serve extra's modules, by the name pip installs them under.
NEEDED = {"fastapi": "fastapi", "uvicorn": "uvicorn", "sse_starlette": "sse-starlette",
          "prometheus_client": "prometheus-client"}
#: The largest TCP port.
MAX_PORT = 65535
#: What installs Ray Serve for ``serve --ray``.
RAY_SERVE_EXTRA = "'h2o-compress[serve-ray]'"
#: Modules ``serve --ray`` needs (without importing Ray): Ray, and grpc, which ``ray.serve`` imports and only the
#: ``ray[serve]`` extra installs.
RAY_SERVE_NEEDS = ("ray", "grpc")
#: uvicorn's log levels.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServeRequest:
    """What one server runs, validated once, when made (in this order, the first bad value refused): the serve
    extra installed, ``host``, ``port``, ``max_queue``, ``log_level``; ``config``; ``grace_period``, ``replicas``
    and ``ray``; ``batch_size``; ``max_tokens`` and ``temperature``; ``memory_limit`` and
    ``prefix_cache_bytes``; ``threads``; ``model``, ``name``, ``compile``, ``trust_remote_code`` and ``load``.

    Attributes:
        model: as for [`h2o_compress.load_model`][h2o_compress.load_model] (a non-empty text).
        config: the compression setting of every request; once made, the checked one (``None``: the default).
        host: the address to listen on (a non-empty text).
        port: the TCP port, 0 (any free one; not with ``ray``) to `MAX_PORT`.
        max_queue: requests waiting at most (an integer >= 1).
        batch_size: rows decoded at once.
        memory_limit: bytes or a text such as ``"2GiB"`` (as ``--memory-limit`` reads it), or ``None``.
        max_tokens: the default of a request without ``max_tokens``.
        temperature: the default of a request without ``temperature`` (0: greedy).
        name: the model id of the API; once made, ``model`` where none was given.
        compile: as for ``generate``.
        load: keyword arguments of ``load_model`` (``device``, ``dtype``...), or ``None``.
        threads: torch CPU threads (``None``: torch's default).
        trust_remote_code: as for ``load_model`` (a bool).
        log_level: one of `LOG_LEVELS`.
        ray: a Ray address, or ``None`` (no Ray); once made, stripped and checked to answer.
        replicas: Ray Serve replicas (1 without ``ray``).
        prefix_cache_bytes: bytes or a text such as ``"64MiB"`` (``None`` or 0: off), below ``memory_limit``;
            once made, the budget in bytes (0: off).
        grace_period: seconds a shutdown lets the open requests run on (>= 0); once made, a float.

    Raises (when made):
        ConfigError: the serve extra missing (or Ray Serve, with ``ray``), or a bad setting, naming it and what
            is allowed.
        ModelLoadError: ``model`` not a non-empty text.
    """

    model: str = DEFAULT_MODEL
    config: CompressionConfig | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 64
    batch_size: int = 8
    memory_limit: str | int | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    name: str | None = None
    compile: bool | None = None
    load: dict | None = None
    threads: int | None = None
    trust_remote_code: bool = False
    log_level: str = "info"
    ray: str | None = None
    replicas: int = 1
    prefix_cache_bytes: str | int | None = None
    grace_period: float = 30.0

    def __post_init__(self) -> None:
        self._validate_listening()
        self._set("config", check_config(self.config))
        self._validate_shutdown()
        check_batch_size(self.batch_size)
        check_generation_args(self.max_tokens, self.temperature, None)
        self._validate_prefix_cache()
        check_threads(self.threads)
        self._validate_loading()

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def _validate_listening(self) -> None:
        """The serve extra installed, then where the server listens: ``host`` a non-empty text, ``port`` in
        [0, `MAX_PORT`], ``max_queue`` an integer >= 1, ``log_level`` one of `LOG_LEVELS`."""
        missing = [package for module, package in NEEDED.items() if importlib.util.find_spec(module) is None]
        if missing:
            raise ConfigError(f"serving needs {', '.join(missing)}; allowed: pip install 'h2o-compress[serve]'")
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError(f"host={short(self.host)} is invalid; allowed: an address or name such as 127.0.0.1 "
                              "or 0.0.0.0")
        check_count("port", self.port, minimum=0, maximum=MAX_PORT, allowed=f"an integer from 0 to {MAX_PORT}")
        check_count("max_queue", self.max_queue, maximum=None, allowed="an integer >= 1")
        if not isinstance(self.log_level, str) or self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level={short(self.log_level)} is invalid; allowed: {', '.join(LOG_LEVELS)}")

    def _validate_shutdown(self) -> None:
        """``grace_period`` a finite number of seconds >= 0 (kept as a float), then ``replicas`` and ``ray`` as
        ``batch --ray`` checks its address (`check_address`: ``local`` as it is; ``auto``, ``HOST:PORT`` and
        ``ray://HOST:PORT`` must answer; kept stripped), with a fixed ``port`` and Ray Serve installed."""
        grace = self.grace_period
        if not is_real(grace) or not 0 <= grace < math.inf:
            raise ConfigError(f"grace_period={short(grace)} is invalid; allowed: a number of seconds >= 0 "
                              "(0: cancel the open requests at once)")
        self._set("grace_period", float(grace))
        check_count("replicas", self.replicas, maximum=None, allowed="an integer >= 1 (with --ray)")
        if self.ray is None:
            if self.replicas != 1:
                raise ConfigError(f"--replicas {short(self.replicas)} needs --ray; allowed: --replicas 1 without "
                                  "--ray")
            return
        from h2o_compress.integrations.ray_sweep import check_address  # deferred: imports nothing of Ray

        address = check_address(self.ray, reach=True)
        if self.port == 0:
            raise ConfigError("--port 0 with --ray is invalid: Ray Serve's proxy listens on a fixed port; allowed: a "
                              f"port from 1 to {MAX_PORT}")
        if any(importlib.util.find_spec(m) is None for m in RAY_SERVE_NEEDS):
            raise ConfigError(f"--ray needs Ray Serve, which is not installed; allowed: pip install "
                              f"{RAY_SERVE_EXTRA}, or run without --ray")
        self._set("ray", address)

    def _validate_prefix_cache(self) -> None:
        """``memory_limit`` an amount, then ``prefix_cache_bytes`` 0 (off) for ``None`` or 0, else an amount below
        ``memory_limit`` (kept in bytes), and a ``config`` whose policy has no scoring pass of its own (the
        commands' default, ``lookahead``, scores each prompt: no request could be resumed)."""
        value, memory_limit = self.prefix_cache_bytes, self.memory_limit
        limit = None if memory_limit is None else parse_memory(memory_limit)
        if value is None or ((is_integer(value) or isinstance(value, str)) and str(value).strip() == "0"):
            self._set("prefix_cache_bytes", 0)
            return
        try:
            budget = parse_memory(value)
        except ConfigError:
            raise ConfigError(f"prefix_cache_bytes={short(value)} is invalid; allowed: 0 (off) or an amount like "
                              "64MiB or 1GB") from None
        if limit is not None and budget >= limit:
            raise ConfigError(f"prefix_cache_bytes={short(value)} is not below --memory-limit {short(memory_limit)}; "
                              "allowed: a share of the limit (the batches get what it leaves)")
        if budget and POLICIES[self.config.policy].scorer:
            usable = ", ".join(name for name, policy in POLICIES.items() if not policy.scorer)
            raise ConfigError(f"--prefix-cache-bytes needs a policy without a scoring pass of its own: policy "
                              f"{self.config.policy!r} scores each whole prompt, so no chat turn could be resumed; "
                              f"allowed: --policy {usable}, or no --prefix-cache-bytes")
        self._set("prefix_cache_bytes", budget)

    def _validate_loading(self) -> None:
        """How the model is loaded: ``model`` and ``name`` non-empty texts (``name`` kept as ``model`` where
        ``None``), a ``compile`` that ``generate`` takes for ``config``, ``trust_remote_code`` a bool, ``load``
        ``None`` or a dict of ``load_model`` arguments it takes."""
        model, name, load = self.model, self.name, self.load
        check_model_name(model)
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ConfigError(f"name={short(name)} is invalid; allowed: a non-empty text (the API's model id) or None")
        check_compile(self.compile, self.config)
        check_flag("trust_remote_code", self.trust_remote_code)
        if load is not None:
            keys = [k for k in inspect.signature(placement_options).parameters if k != "name_or_path"]
            if not isinstance(load, dict) or any(k not in keys for k in load):
                raise ConfigError(f"load={short(load)} is invalid; allowed: None or a dict of load_model arguments "
                                  f"({', '.join(keys)})")
            placement_options(**load)
        self._set("name", name or model)
