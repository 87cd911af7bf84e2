"""``h2o-compress serve`` as one Python call: `serve` loads a model and serves it over
HTTP with the OpenAI API, many requests decoded at once through compressed KV caches.

- `h2o_compress.serving.request`: `ServeRequest`, the server's settings validated once, before anything loads.
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

import importlib

import torch

from h2o_compress import models
from h2o_compress.config import CompressionConfig
from h2o_compress.models import DEFAULT_MODEL
from h2o_compress.serving.request import ServeRequest
from h2o_compress.utils.memory import PeakMemory


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
            model is loaded, as `ServeRequest` says).
        ModelLoadError: ``model`` not a non-empty text (before loading), or the model cannot be loaded.
    """
    request = ServeRequest(model, config, host, port, max_queue, batch_size, memory_limit, max_tokens, temperature,
                           name, compile, load, threads, trust_remote_code, log_level, ray, replicas,
                           prefix_cache_bytes, grace_period)
    if request.ray is not None:
        from h2o_compress.serving.ray_serve import serve_on_ray  # deferred: Ray Serve is optional
        return serve_on_ray(request)
    from h2o_compress.serving.app import run  # deferred: the serve extra (fastapi...) is optional

    run(build_app(request), request.host, request.port, request.log_level, request.grace_period)


def build_app(request: ServeRequest):
    """Load ``request.model`` and return the app serving it (its `Engine` starts with the app): what `serve` runs,
    in its own process or in each Ray Serve replica. ``request`` is trusted (validated when it was made).

    Raises:
        ModelLoadError: the model cannot be loaded.
    """
    from h2o_compress.serving.app import create_app  # deferred: the serve extra (fastapi...) is optional
    from h2o_compress.serving.engine import Engine  # deferred: the serve extra (prometheus-client) is optional
    from h2o_compress.serving.metrics import Metrics  # deferred: the serve extra (prometheus-client) is optional

    if request.threads is not None:
        torch.set_num_threads(request.threads)
    peak = PeakMemory(whole_process=True)
    lm, tokenizer = models.load_model(request.model, trust_remote_code=request.trust_remote_code,
                                      **(request.load or {}))
    held = peak.held(lm) if request.memory_limit is not None else None
    return create_app(Engine(lm, tokenizer, Metrics(), request, held=held))


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


__all__ = ["Engine", "Metrics", "ServeRequest", "build_app", "create_app", "serve"]
