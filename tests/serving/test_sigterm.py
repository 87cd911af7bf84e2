"""``h2o-compress serve`` stopped by SIGTERM shuts down gracefully and exits 0 (uvicorn re-raises the signal it
stopped on once it has shut down: under the default handler the process would end with 143)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_stops_the_server_with_exit_code_0(tiny_model_dir):
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "h2o_compress", "serve", "--model", tiny_model_dir, "--port", str(port),
         "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert server.poll() is None, server.stderr.read()[-2000:]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, server.stderr.read()[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
