"""``h2o-compress serve`` as one Python call: `serve` loads a model and serves it over
HTTP with the OpenAI API, many requests decoded at once through compressed KV caches.

- `h2o_compress.serving.engine`: the thread that owns the model and runs the continuous-batching engine.
- `h2o_compress.serving.app`: the FastAPI app (`create_app`): the endpoints, validation, streaming.
- `h2o_compress.serving.metrics`: the Prometheus metrics of ``/metrics``.

Needs the ``serve`` extra (``pip install 'h2o-compress[serve]'``: FastAPI, uvicorn, sse-starlette,
prometheus-client). This layer sits beside ``jobs``, above the planner and below the CLI.
"""

from __future__ import annotations

import importlib.util

import torch

from h2o_compress import models
from h2o_compress.config import CompressionConfig
from h2o_compress.models import DEFAULT_MODEL
from h2o_compress.planner import parse_memory
from h2o_compress.runtime.batch import check_batch_size
from h2o_compress.runtime.generation import check_config, check_generation_args
from h2o_compress.utils.checks import check_threads
from h2o_compress.utils.errors import ConfigError
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
        raise ConfigError(f"host={host!r} is invalid; allowed: an address or name such as 127.0.0.1 or 0.0.0.0")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ConfigError(f"port={port!r} is invalid; allowed: an integer from 0 to {MAX_PORT}")
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
        raise ConfigError(f"max_queue={max_queue!r} is invalid; allowed: an integer >= 1")


def serve(model: str = DEFAULT_MODEL, config: CompressionConfig | None = None, host: str = "127.0.0.1",
          port: int = 8000, max_queue: int = 64, batch_size: int = 8, memory_limit: str | int | None = None,
          max_tokens: int = 128, temperature: float = 0.0, name: str | None = None, compile: bool | None = None,
          load: dict | None = None, threads: int | None = None, trust_remote_code: bool = False,
          log_level: str = "info") -> None:
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

    Raises:
        ConfigError: the serve extra missing, or a bad setting (checked before the model is loaded).
        ModelLoadError: the model cannot be loaded.
    """
    check_installed()
    check_server_settings(host, port, max_queue)
    config = check_config(config)
    check_batch_size(batch_size)
    check_generation_args(max_tokens, temperature, None)
    if memory_limit is not None:
        parse_memory(memory_limit)
    check_threads(threads)
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"log_level={log_level!r} is invalid; allowed: {', '.join(LOG_LEVELS)}")
    from h2o_compress.serving.app import create_app, run  # deferred: the serve extra (fastapi...) is optional
    from h2o_compress.serving.engine import Engine  # deferred: the serve extra (prometheus-client) is optional
    from h2o_compress.serving.metrics import Metrics  # deferred: the serve extra (prometheus-client) is optional

    if threads is not None:
        torch.set_num_threads(threads)
    peak = PeakMemory(whole_process=True)
    lm, tokenizer = models.load_model(model, trust_remote_code=trust_remote_code, **(load or {}))
    held = peak.held(lm) if memory_limit is not None else None
    engine = Engine(lm, tokenizer, Metrics(), batch_size=batch_size, max_queue=max_queue, memory_limit=memory_limit,
                    compile=compile, held=held)
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


__all__ = ["Engine", "Metrics", "check_installed", "create_app", "serve"]
