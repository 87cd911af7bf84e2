"""``h2o-compress serve``: an HTTP server speaking the OpenAI API (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, plus ``/health`` and ``/metrics``) on the continuous-batching engine, every request through a
compressed KV cache (docs/guide/serving.md).

The options go to [`h2o_compress.serving.serve`][h2o_compress.serving.serve], which builds one
[`ServeRequest`][h2o_compress.serving.request.ServeRequest] of them, checked before the model is loaded; the
compression options apply server-wide, a request's ``h2o`` object may override ``budget``, ``kv_bits`` and
``policy`` for itself.
"""

from __future__ import annotations

from typing import Optional

import typer

from h2o_compress.config import COMMAND_POLICY
from h2o_compress.cli.common import load_options, merged_config, user_errors
from h2o_compress.cli.options import (
    CompileOpt, Compression, ConfigFileOpt, DeviceOpt, DtypeOpt, ModelOpt, TemperatureOpt, ThreadsOpt, TrustOpt,
    compression_options, placement_flags,
)
from h2o_compress.serving import serve as serve_model
from h2o_compress.utils.defaults import default_of


@user_errors
@compression_options(defaults={"policy": COMMAND_POLICY})
@placement_flags
def serve(
    ctx: typer.Context,
    model: str = ModelOpt,
    host: str = typer.Option(default_of(serve_model, "host"), "--host", help="Address to listen on (0.0.0.0: every "
                             "interface)."),
    port: int = typer.Option(default_of(serve_model, "port"), "--port", help="TCP port (0: any free one)."),
    max_queue: int = typer.Option(
        default_of(serve_model, "max_queue"), "--max-queue", help="Requests waiting for a row at most; past it a "
        "request gets HTTP 429 with Retry-After."),
    batch_size: int = typer.Option(
        default_of(serve_model, "batch_size"), "--batch-size", help="Rows decoded at once (sequences of one setting "
        "share a batch; a free row takes the next waiting request)."),
    memory_limit: Optional[str] = typer.Option(
        None, "--memory-limit", help="Memory to fit (e.g. 8GiB): each batch takes at most the rows the planner fits "
        "for its longest request."),
    prefix_cache_bytes: Optional[str] = typer.Option(
        None, "--prefix-cache-bytes", help="Memory (e.g. 256MiB) for the compressed caches of finished chat turns, "
        "kept so that a conversation's next turn prefills only its new tokens (default: off); taken out of "
        "--memory-limit."),
    max_tokens: int = typer.Option(
        default_of(serve_model, "max_tokens"), "--max-tokens", help="Default max_tokens of a request without one."),
    temperature: float = TemperatureOpt,
    name: Optional[str] = typer.Option(None, "--served-name", help="Model id of the API (default: --model)."),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    config_file: Optional[str] = ConfigFileOpt,
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level: critical, error, warning, "
                                  "info, debug or trace."),
    ray: Optional[str] = typer.Option(
        None, "--ray", metavar="[ADDRESS]", help="Serve as a Ray Serve deployment (pip install "
        "'h2o-compress\\[serve-ray]'), Ray Serve's proxy on --host/--port routing to --replicas replicas, each "
        "loading the model once: --ray alone starts a local Ray instance for this run, --ray auto joins the cluster "
        "running here (ray start --head), --ray HOST:PORT or ray://HOST:PORT another one."),
    replicas: int = typer.Option(1, "--replicas", help="Ray Serve replicas (with --ray)."),
    grace_period: float = typer.Option(
        default_of(serve_model, "grace_period"), "--grace-period", metavar="SECONDS", help="On SIGTERM: new "
        "requests get HTTP 503, the open ones (streamed or not) run on for up to this long, then what is left is "
        "cancelled (0: at once); the command exits 0."),
    compression: Compression = None,
    placement: dict = None,
):
    """Serve the model over HTTP with the OpenAI API (completions and chat completions, streamed or not), requests
    decoded together through compressed KV caches; /health and Prometheus /metrics. Stops gracefully on SIGTERM
    (--grace-period); with --ray, as a Ray Serve deployment."""
    config, _ = merged_config(compression, config_file)
    serve_model(model, config, host=host, port=port, max_queue=max_queue, batch_size=batch_size,
                memory_limit=memory_limit, max_tokens=max_tokens, temperature=temperature, name=name,
                compile=compile_step, load=load_options(device, dtype, placement, config.attention_kernel),
                threads=threads, trust_remote_code=trust_remote_code, log_level=log_level,
                ray=ray, replicas=replicas, prefix_cache_bytes=prefix_cache_bytes, grace_period=grace_period)
