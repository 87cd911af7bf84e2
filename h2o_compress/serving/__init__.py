"""``h2o-compress serve`` as one Python call: `serve` loads a model and serves it over
HTTP with the OpenAI API, many requests decoded at once through compressed KV caches.

- `h2o_compress.serving.engine`: the thread that owns the model and runs the continuous-batching engine.
- `h2o_compress.serving.app`: the FastAPI app (`create_app`): the endpoints, validation, streaming.
- `h2o_compress.serving.metrics`: the Prometheus metrics of ``/metrics``.
- `h2o_compress.serving.prefix_cache`: the compressed caches of finished chat turns, kept for the next turn.

Needs the ``serve`` extra (``pip install 'h2o-compress[serve]'``: FastAPI, uvicorn, sse-starlette,
prometheus-client). This layer sits beside ``jobs``, above the planner and below the CLI.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

from h2o_compress import models
from h2o_compress.config import CompressionConfig
from h2o_compress.models import DEFAULT_MODEL, placement_options
from h2o_compress.runtime.batch import check_batch_size
from h2o_compress.runtime.compiled import check_compile
from h2o_compress.runtime.generation import check_config, check_generation_args
from h2o_compress.serving.prefix_cache import check_prefix_budget, check_prefix_policy
from h2o_compress.utils.checks import check_count, check_threads
from h2o_compress.utils.errors import ConfigError, ModelLoadError, short
from h2o_compress.utils.memory import PeakMemory

#: The serve extra's modules, by the name pip installs them under.
NEEDED = {"fastapi": "fastapi", "uvicorn": "uvicorn", "sse_starlette": "sse-starlette",
          "prometheus_client": "prometheus-client"}
#: The largest TCP port.
MAX_PORT = 65535
#: uvicorn's log levels.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def check_installed() -> None:
    """Raise ConfigError naming the missing packages when the ``serve`` extra is not installed."""
    missing = [package for module, package in NEEDED.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"serving needs {', '.join(missing)}; allowed: pip install 'h2o-compress[serve]'")


def check_server_settings(host: str, port: int, max_queue: int) -> None:
    """Raise ConfigError for a bad ``host`` (not a non-empty text), ``port`` (not in [0, 65535]) or ``max_queue``
    (not an integer >= 1)."""
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"host={short(host)} is invalid; allowed: an address or name such as 127.0.0.1 or 0.0.0.0")
    check_count("port", port, minimum=0, maximum=MAX_PORT, allowed=f"an integer from 0 to {MAX_PORT}")
    check_count("max_queue", max_queue, maximum=None, allowed="an integer >= 1")


def check_ray(ray: str | None, replicas: int) -> None:
    """Refuse ``--ray`` (and ``--replicas`` other than 1): this version serves from its own process only, not as a
    Ray Serve deployment (whether or not ``ray[serve]`` is installed).

    Raises:
        ConfigError: ``replicas`` not an integer >= 1 or given without ``ray``, an empty address, or any ``ray``.
    """
    check_count("replicas", replicas, maximum=None, allowed="an integer >= 1 (with --ray)")
    if ray is None:
        if replicas != 1:
            raise ConfigError(f"--replicas {short(replicas)} needs --ray; allowed: --replicas 1 without --ray")
        return
    from h2o_compress.integrations.ray_sweep import check_address  # deferred: imports nothing of Ray

    check_address(ray)
    raise ConfigError("--ray (a Ray Serve deployment) is not supported by this version; allowed: run without --ray, "
                      "one server per process (each with its own --memory-limit) behind a load balancer")


def check_loading(model, name, compile, config: CompressionConfig, load, trust_remote_code) -> None:
    """Refuse, before the model is loaded, a ``model`` or ``name`` that is not a non-empty text, a ``compile`` that
    ``generate`` refuses for ``config``, a ``load`` that is not a dict of ``load_model`` arguments it takes, and a
    ``trust_remote_code`` that is not a bool.

    Raises:
        ModelLoadError: ``model`` not a non-empty text.
        ConfigError: naming the value and what is allowed.
    """
    if not isinstance(model, str) or not model.strip():
        raise ModelLoadError(f"model name {short(model)} is empty or not a text; allowed: an alias, a local model "
                             "directory or a hub id (a str)")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"name={short(name)} is invalid; allowed: a non-empty text (the API's model id) or None")
    check_compile(compile, config)
    if not isinstance(trust_remote_code, bool):
        raise ConfigError(f"trust_remote_code={short(trust_remote_code)} is invalid; allowed: True or False")
    if load is None:
        return
    keys = [k for k in inspect.signature(placement_options).parameters if k != "name_or_path"]
    if not isinstance(load, dict) or any(k not in keys for k in load):
        raise ConfigError(f"load={short(load)} is invalid; allowed: None or a dict of load_model arguments "
                          f"({', '.join(keys)})")
    placement_options(**load)


def serve(model: str = DEFAULT_MODEL, config: CompressionConfig | None = None, host: str = "127.0.0.1",
          port: int = 8000, max_queue: int = 64, batch_size: int = 8, memory_limit: str | int | None = None,
          max_tokens: int = 128, temperature: float = 0.0, name: str | None = None, compile: bool | None = None,
          load: dict | None = None, threads: int | None = None, trust_remote_code: bool = False,
          log_level: str = "info", ray: str | None = None, replicas: int = 1,
          prefix_cache_bytes: str | int | None = None) -> None:
    """Load ``model`` and serve it until SIGINT or SIGTERM (graceful: open requests finish first).

    Args:
        model: as for [`h2o_compress.load_model`][h2o_compress.load_model].
        config: the compression setting of every request (a request's ``h2o`` object may override its ``budget``,
            ``kv_bits`` and ``policy``).
        host: the address to listen on.
        port: the TCP port (0: any free one).
        max_queue: requests waiting at most; past it a request gets 429 with ``Retry-After``.
        batch_size: rows decoded at once.
        memory_limit: bytes or a text such as ``"2GiB"``: each batch takes at most the rows the planner fits.
        max_tokens: the default of a request without ``max_tokens``.
        temperature: the default of a request without ``temperature`` (0: greedy).
        name: the model id of the API (default: ``model``).
        compile: as for ``generate``.
        load: keyword arguments of ``load_model`` (``device``, ``dtype``...).
        threads: torch CPU threads (``None``: torch's default).
        trust_remote_code: as for ``load_model``.
        log_level: uvicorn's log level.
        ray: a Ray address (``local``, ``auto``, ``HOST:PORT``, ``ray://HOST:PORT``) to serve on as a Ray Serve
            deployment: refused (`check_ray`).
        replicas: Ray Serve replicas (1 without ``ray``).
        prefix_cache_bytes: bytes or a text such as ``"64MiB"`` for the compressed caches of finished chat turns
            (``None`` or 0: off), below ``memory_limit`` (`h2o_compress.serving.prefix_cache`).

    Raises:
        ConfigError: the serve extra missing, ``ray`` given (`check_ray`), or a bad setting (checked before the
            model is loaded: `check_loading`, `check_prefix_budget`, `check_prefix_policy`...).
        ModelLoadError: ``model`` not a non-empty text (before loading), or the model cannot be loaded.
    """
    check_installed()
    check_server_settings(host, port, max_queue)
    config = check_config(config)
    check_ray(ray, replicas)
    check_batch_size(batch_size)
    check_generation_args(max_tokens, temperature, None)
    check_prefix_policy(config, check_prefix_budget(prefix_cache_bytes, memory_limit))  # memory_limit checked too
    check_threads(threads)
    if not isinstance(log_level, str) or log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level={short(log_level)} is invalid; allowed: {', '.join(LOG_LEVELS)}")
    check_loading(model, name, compile, config, load, trust_remote_code)
    from h2o_compress.serving.app import create_app, run  # deferred: the serve extra (fastapi...) is optional
    from h2o_compress.serving.engine import Engine  # deferred: the serve extra (prometheus-client) is optional
    from h2o_compress.serving.metrics import Metrics  # deferred: the serve extra (prometheus-client) is optional

    if threads is not None:
        torch.set_num_threads(threads)
    peak = PeakMemory(whole_process=True)
    lm, tokenizer = models.load_model(model, trust_remote_code=trust_remote_code, **(load or {}))
    held = peak.held(lm) if memory_limit is not None else None
    engine = Engine(lm, tokenizer, Metrics(), batch_size=batch_size, max_queue=max_queue, memory_limit=memory_limit,
                    compile=compile, held=held, prefix_cache_bytes=prefix_cache_bytes)
    run(create_app(engine, config, name or model, max_tokens, temperature), host, port, log_level)


def __getattr__(name: str):
    """``create_app``, ``Engine`` and ``Metrics``, imported on first use (they need the serve extra).

    Raises:
        AttributeError: no such name.
    """
    homes = {"create_app": "h2o_compress.serving.app", "Engine": "h2o_compress.serving.engine",
             "Metrics": "h2o_compress.serving.metrics"}
    if name not in homes:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(homes[name]), name)


__all__ = ["Engine", "Metrics", "check_installed", "check_ray", "create_app", "serve"]
