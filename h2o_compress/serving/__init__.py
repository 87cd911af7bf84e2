"""``h2o-compress serve`` as one Python call: `serve` loads a model and serves it over
HTTP with the OpenAI API, many requests decoded at once through compressed KV caches.

- `h2o_compress.serving.engine`: the thread that owns the model and runs the continuous-batching engine.
- `h2o_compress.serving.app`: the FastAPI app (`create_app`): the endpoints, validation, streaming.
- `h2o_compress.serving.metrics`: the Prometheus metrics of ``/metrics``.
- `h2o_compress.serving.prefix_cache`: the compressed caches of finished chat turns, kept for the next turn.
- `h2o_compress.serving.ray_serve`: ``serve --ray``, the app as a Ray Serve deployment of N replicas.

Needs the ``serve`` extra (``pip install 'h2o-compress[serve]'``: FastAPI, uvicorn, sse-starlette,
prometheus-client; ``serve --ray`` the ``serve-ray`` extra, Ray Serve). This layer sits beside ``jobs``, above
the planner and below the CLI.
"""

from __future__ import annotations

import importlib.util
import inspect
import math

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
#: What installs Ray Serve for ``serve --ray``.
RAY_SERVE_EXTRA = "'h2o-compress[serve-ray]'"
#: Modules ``serve --ray`` needs (without importing Ray): Ray, and grpc, which ``ray.serve`` imports and only the
#: ``ray[serve]`` extra installs.
RAY_SERVE_NEEDS = ("ray", "grpc")
#: uvicorn's log levels.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def check_installed() -> None:
    """Raise ConfigError naming the missing packages when the ``serve`` extra is not installed."""
    missing = [package for module, package in NEEDED.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"serving needs {', '.join(missing)}; allowed: pip install 'h2o-compress[serve]'")


def check_server_settings(host: str, port: int, max_queue: int, log_level: str = "info") -> None:
    """Raise ConfigError for a bad ``host`` (not a non-empty text), ``port`` (not in [0, 65535]), ``max_queue``
    (not an integer >= 1) or ``log_level`` (not one of `LOG_LEVELS`)."""
    if not isinstance(host, str) or not host.strip():
        raise ConfigError(f"host={short(host)} is invalid; allowed: an address or name such as 127.0.0.1 or 0.0.0.0")
    check_count("port", port, minimum=0, maximum=MAX_PORT, allowed=f"an integer from 0 to {MAX_PORT}")
    check_count("max_queue", max_queue, maximum=None, allowed="an integer >= 1")
    if not isinstance(log_level, str) or log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level={short(log_level)} is invalid; allowed: {', '.join(LOG_LEVELS)}")


def check_grace_period(grace_period) -> float:
    """``grace_period`` (seconds a shutdown lets the open requests run on) as a float.

    Raises:
        ConfigError: not a finite number >= 0.
    """
    if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)) or not (
            0 <= grace_period < math.inf):
        raise ConfigError(f"grace_period={short(grace_period)} is invalid; allowed: a number of seconds >= 0 "
                          "(0: cancel the open requests at once)")
    return float(grace_period)


def check_ray(ray: str | None, replicas: int, port: int = 8000) -> str | None:
    """``ray`` (a Ray address, or ``None``: no Ray) checked with ``replicas`` before anything loads, as ``batch
    --ray`` checks its address (`check_address`: ``local`` as it is; ``auto``, ``HOST:PORT`` and
    ``ray://HOST:PORT`` must answer); returns it stripped.

    Raises:
        ConfigError: ``replicas`` not an integer >= 1, or other than 1 without ``ray``; with ``ray``: Ray Serve not
            installed (naming the extra), ``port`` 0 (Ray Serve's proxy needs a fixed port), or an address that is
            empty, malformed or not answering.
    """
    check_count("replicas", replicas, maximum=None, allowed="an integer >= 1 (with --ray)")
    if ray is None:
        if replicas != 1:
            raise ConfigError(f"--replicas {short(replicas)} needs --ray; allowed: --replicas 1 without --ray")
        return None
    from h2o_compress.integrations.ray_sweep import check_address  # deferred: imports nothing of Ray

    address = check_address(ray, reach=True)
    if any(importlib.util.find_spec(m) is None for m in RAY_SERVE_NEEDS):
        raise ConfigError(f"--ray needs Ray Serve, which is not installed; allowed: pip install {RAY_SERVE_EXTRA}, "
                          "or run without --ray")
    if port == 0:
        raise ConfigError("--port 0 with --ray is invalid: Ray Serve's proxy listens on a fixed port; allowed: a "
                          f"port from 1 to {MAX_PORT}")
    return address


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
          prefix_cache_bytes: str | int | None = None, grace_period: float = 30.0) -> None:
    """Load ``model`` and serve it until SIGINT or SIGTERM (on SIGTERM: new requests get 503, the open ones run on
    for up to ``grace_period`` seconds, then what is left is cancelled; the call returns).

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
        ray: a Ray address (``local``: a Ray instance for this call, ``auto``, ``HOST:PORT``, ``ray://HOST:PORT``)
            to serve on as a Ray Serve deployment of ``replicas`` replicas, each loading the model once and running
            one engine, Ray Serve's proxy listening on ``host``:``port`` (`h2o_compress.serving.ray_serve`).
        replicas: Ray Serve replicas (1 without ``ray``).
        prefix_cache_bytes: bytes or a text such as ``"64MiB"`` for the compressed caches of finished chat turns
            (``None`` or 0: off), below ``memory_limit`` (`h2o_compress.serving.prefix_cache`).
        grace_period: seconds a SIGTERM lets the open requests run on (0: cancelled at once; with ``ray``: Ray
            Serve's graceful shutdown timeout of each replica).

    Raises:
        ConfigError: the serve extra missing (or Ray Serve, with ``ray``), or a bad setting (checked before the
            model is loaded: `check_ray`, `check_grace_period`, `check_loading`, `check_prefix_budget`...).
        ModelLoadError: ``model`` not a non-empty text (before loading), or the model cannot be loaded.
    """
    check_installed()
    check_server_settings(host, port, max_queue, log_level)
    config = check_config(config)
    grace_period = check_grace_period(grace_period)
    ray = check_ray(ray, replicas, port)
    check_batch_size(batch_size)
    check_generation_args(max_tokens, temperature, None)
    check_prefix_policy(config, check_prefix_budget(prefix_cache_bytes, memory_limit))  # memory_limit checked too
    check_threads(threads)
    check_loading(model, name, compile, config, load, trust_remote_code)
    settings = dict(model=model, config=config, max_queue=max_queue, batch_size=batch_size,
                    memory_limit=memory_limit, max_tokens=max_tokens, temperature=temperature, name=name or model,
                    compile=compile, load=load, threads=threads, trust_remote_code=trust_remote_code,
                    prefix_cache_bytes=prefix_cache_bytes)
    if ray is not None:
        from h2o_compress.serving.ray_serve import serve_on_ray  # deferred: Ray Serve is optional
        return serve_on_ray(ray, replicas, settings, host, port, grace_period, log_level)
    from h2o_compress.serving.app import run  # deferred: the serve extra (fastapi...) is optional

    run(build_app(**settings), host, port, log_level, grace_period)


def build_app(model: str, config: CompressionConfig, max_queue: int, batch_size: int, memory_limit, max_tokens: int,
              temperature: float, name: str, compile, load: dict | None, threads: int | None,
              trust_remote_code: bool, prefix_cache_bytes):
    """Load ``model`` and return the app serving it (its `Engine` starts with the app): what `serve` runs, in its
    own process or in each Ray Serve replica. The arguments are `serve`'s, checked already.

    Raises:
        ModelLoadError: the model cannot be loaded.
    """
    from h2o_compress.serving.app import create_app  # deferred: the serve extra (fastapi...) is optional
    from h2o_compress.serving.engine import Engine  # deferred: the serve extra (prometheus-client) is optional
    from h2o_compress.serving.metrics import Metrics  # deferred: the serve extra (prometheus-client) is optional

    if threads is not None:
        torch.set_num_threads(threads)
    peak = PeakMemory(whole_process=True)
    lm, tokenizer = models.load_model(model, trust_remote_code=trust_remote_code, **(load or {}))
    held = peak.held(lm) if memory_limit is not None else None
    engine = Engine(lm, tokenizer, Metrics(), batch_size=batch_size, max_queue=max_queue, memory_limit=memory_limit,
                    compile=compile, held=held, prefix_cache_bytes=prefix_cache_bytes)
    return create_app(engine, config, name, max_tokens, temperature)


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


__all__ = ["Engine", "Metrics", "build_app", "check_grace_period", "check_installed", "check_ray", "create_app",
           "serve"]
