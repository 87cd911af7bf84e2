"""``h2o-compress serve`` under a bounded load on loopback: 64 clients send 500 requests to a server process on the
tiny model, retrying each 429 until it is answered; then a SIGTERM while requests run. Checks that no request is
lost or answered twice, that 429 comes only with the queue full, that the process's peak resident set stays under
``--memory-limit``, and that the SIGTERM ends the process with 0, every admitted request finished or cancelled."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers.serving import start_serve  # noqa: E402

CLIENTS = 64
REQUESTS = 500
MAX_QUEUE = 16
MEMORY_LIMIT = 2 << 30  # bytes: the Python runtime, torch and transformers take most of it
FLAGS = ["--batch-size", "8", "--max-queue", str(MAX_QUEUE), "--memory-limit", "2GiB", "--max-tokens", "4",
         "--budget", "16", "--kv-bits", "4", "--log-level", "warning"]  # start_serve adds --threads 1
RETRY_S = 0.05  # a client's wait after a 429 (the server says Retry-After: 1; the test keeps the load on)


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def _prompt(index: int) -> str:
    return " ".join(f"w{(index * 13 + k) % 120}" for k in range(4 + index % 9))


async def _ask(http: httpx.AsyncClient, index: int, refusals: list[str]) -> dict:
    """One request, sent again after each 429 until it is answered."""
    while True:
        response = await http.post("/v1/completions", json={"model": "tiny", "prompt": _prompt(index)})
        if response.status_code != 429:
            return {"index": index, "status": response.status_code, "body": response.json()}
        assert response.headers["retry-after"] == "1"
        refusals.append(response.json()["error"]["message"])
        await asyncio.sleep(RETRY_S)


async def _load(url: str) -> tuple[list[dict], list[str]]:
    refusals, todo = [], asyncio.Queue()
    for index in range(REQUESTS):
        todo.put_nowait(index)
    results = []

    async def client(http):
        while not todo.empty():
            results.append(await _ask(http, todo.get_nowait(), refusals))

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
    return results, refusals


async def _whole(http: httpx.AsyncClient, index: int) -> str:
    """A request of 32 tokens, not streamed: ``done`` (answered), ``429`` or ``refused`` (the server no longer
    took connections)."""
    try:
        response = await http.post("/v1/completions", json={"model": "tiny", "prompt": _prompt(index),
                                                            "max_tokens": 32})
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return "refused"
    if response.status_code == 200:
        return "done" if response.json()["choices"][0]["finish_reason"] in ("stop", "length") else "bad"
    return str(response.status_code)


async def _stream(http: httpx.AsyncClient, index: int, admitted: asyncio.Event) -> str:
    """A streamed request of 200 tokens: ``done`` ([DONE] after a finish_reason), ``cut`` (admitted, its stream
    ended early: cancelled), ``429`` or ``refused`` (the server no longer took connections)."""
    body = {"model": "tiny", "prompt": _prompt(index), "max_tokens": 200, "stream": True}
    started = False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return str(response.status_code)
            started = True
            admitted.set()
            finished = False
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    finished = json.loads(line[6:])["choices"][0]["finish_reason"] is not None
                elif line == "data: [DONE]":
                    return "done" if finished else "cut"
            return "cut"
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return "cut" if started else "refused"


async def _sigterm_midway(url: str, server: subprocess.Popen) -> list[str]:
    admitted = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=CLIENTS)) as http:
        tasks = [asyncio.ensure_future(_stream(http, index, admitted) if index % 2 else _whole(http, index))
                 for index in range(CLIENTS)]
        await asyncio.wait_for(admitted.wait(), 30)
        server.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)


@pytest.mark.slow
def test_bounded_load_loses_nothing_and_sigterm_exits_0(tiny_model_dir):
    server, url = start_serve(tiny_model_dir, "--served-name", "tiny", *FLAGS)
    try:
        assert server.poll() is None, server.stderr.read()[-2000:]
        results, refusals = asyncio.run(_load(url))
        assert sorted(r["index"] for r in results) == list(range(REQUESTS))  # each answered, once
        assert all(r["status"] == 200 and r["body"]["choices"][0]["finish_reason"] in ("stop", "length")
                   for r in results)
        assert len({r["body"]["id"] for r in results}) == REQUESTS
        assert refusals and all(f"{MAX_QUEUE} requests are waiting already" in m for m in refusals)
        metrics = httpx.get(url + "/metrics").text
        finished = sum(float(line.split()[1]) for line in metrics.splitlines()
                       if line.startswith("h2o_requests_total{"))
        assert finished == REQUESTS  # the server ran each request once: none twice, none lost
        assert _peak_rss(server.pid) < MEMORY_LIMIT
        outcomes = asyncio.run(_sigterm_midway(url, server))
        assert server.wait(timeout=60) == 0, server.stderr.read()[-2000:]
        assert set(outcomes) <= {"done", "cut", "429", "503", "refused"}  # 503: sent once admission had stopped
        assert set(outcomes[::2]) <= {"done", "429", "503", "refused"} and "done" in outcomes[::2]  # answered whole
        assert "cut" in outcomes[1::2] or "done" in outcomes[1::2]  # a stream running at the SIGTERM
    finally:
        if server.poll() is None:
            server.kill()
