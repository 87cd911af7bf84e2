"""``h2o-compress serve --ray``: the same FastAPI app (`h2o_compress.serving.build_app`) as a Ray Serve
deployment of N replicas, each loading the model once and running one engine; Ray Serve's proxy listens on the
server's host and port and routes the requests to the replicas (no router of this package's own).

The Ray address is connected to as ``batch --ray`` connects (`h2o_compress.integrations.ray_sweep.connect`:
``local`` starts a Ray instance for this run, ``auto``, ``HOST:PORT`` and ``ray://HOST:PORT`` join a running
cluster, this package shipped to its workers). Needs the ``serve-ray`` extra (``ray[serve]``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from h2o_compress.integrations.ray_sweep import connect, import_ray
from h2o_compress.serving.request import ServeRequest
from h2o_compress.utils.errors import ConfigError, short

#: The Ray Serve application's name (``serve status`` lists it).
APP_NAME = "h2o-compress"
#: Seconds between checks, while serving, that no stop signal came.
WAIT_S = 0.5


def app_builder(request: ServeRequest):
    """A function of no arguments that loads the model and returns the app (`build_app` of ``request``): what
    Ray Serve's ingress calls once in each replica as it starts (so the model is loaded there, not here)."""

    def build():
        from h2o_compress.serving import build_app  # deferred: in the replica, not at import

        return build_app(request)

    return build


def deployment(request: ServeRequest):
    """The Ray Serve deployment of the app: ``request.replicas`` replicas of ``request.threads`` CPUs (1 by
    default), each taking up to ``batch_size + max_queue`` requests at once (its engine queues and refuses past
    that), and given ``request.grace_period`` seconds to finish its open requests when it is shut down."""
    from ray import serve  # deferred: Ray Serve is optional

    ingress = serve.ingress(app_builder(request))()
    return serve.deployment(
        ingress, name=APP_NAME, num_replicas=request.replicas, ray_actor_options={"num_cpus": request.threads or 1},
        max_ongoing_requests=request.batch_size + request.max_queue,
        graceful_shutdown_timeout_s=request.grace_period)


def serve_on_ray(request: ServeRequest) -> None:
    """Run the deployment at ``request.ray`` (an address checked already) until SIGINT or SIGTERM, Ray Serve's
    proxy listening on ``request.host``:``request.port``, then shut Ray Serve down (each replica has
    ``request.grace_period`` seconds to finish its open requests) and, when this call started or joined Ray,
    disconnect (a ``local`` Ray instance ends with it). ``request`` is trusted (validated when it was made);
    ``log_level`` ``info``, ``debug`` or ``trace`` prints where the server listens.

    Raises:
        ConfigError: Ray cannot be started or reached, or the deployment cannot start (a replica failed to load
            the model: Ray's message, the replica's own error in Ray's logs).
    """
    address, host, port, log_level = request.ray, request.host, request.port, request.log_level
    ray = import_ray()
    from ray import serve  # deferred: Ray Serve is optional

    connected = connect(ray, address, verbose=log_level in ("debug", "trace"))
    if log_level not in ("debug", "trace"):
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its start-up lines: the one below says it all
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(deployment(request).bind(), name=APP_NAME, route_prefix="/")
        except Exception as exc:  # noqa: BLE001 - Ray's deployment errors have no common base: shown in one line
            raise ConfigError(f"Ray Serve could not start the deployment: {short(str(exc), 300, repr_=False)}; "
                              "allowed: a model and settings that serve without --ray") from None
        if log_level in ("info", "debug", "trace"):
            print(f"serving {request.name} on http://{host}:{port}/v1 with {request.replicas} Ray Serve replica(s) "
                  f"(Ray at {address}); SIGTERM or Ctrl-C stops", file=sys.stderr, flush=True)
        while not stop.wait(WAIT_S):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if connected:
                ray.shutdown()
