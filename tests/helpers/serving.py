"""Running ``h2o-compress serve`` in tests: a free loopback port, the app in-process under uvicorn, or the command
as a process answering ``/health``."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app):
    """Serve ``app`` with uvicorn in a thread on a free port, torch at one thread; yields the base URL and stops
    the server (and restores torch's threads) after."""
    import torch
    import uvicorn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(20)
        torch.set_num_threads(threads)


def start_serve(model_dir: str, *options: str, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """``h2o-compress serve --model model_dir`` with ``options`` on a free port, one torch thread, waited for until
    ``/health`` answers 200 (at most ``timeout`` seconds); returns the process and its base URL. Fails the test with
    the process's last stderr if it ended first."""
    import httpx

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "h2o_compress", "serve", "--model", model_dir, "--port", str(port), "--threads", "1",
         *options], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    if server.poll() is not None:
        pytest.fail(server.stderr.read()[-3000:])
    return server, url
