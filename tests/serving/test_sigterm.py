"""``h2o-compress serve`` stopped by SIGTERM shuts down gracefully and exits 0 (uvicorn re-raises the signal it
stopped on once it has shut down: under the default handler the process would end with 143); within
``--grace-period`` a running stream is answered whole while new requests get 503, with ``--grace-period 0`` it is
cancelled at once."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from helpers.serving import start_serve


#: A streamed request of this many tokens (the tiny model does not stop before): a few seconds on one thread.
LONG = {"prompt": "hello world", "max_tokens": 1000, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("grace", ["30", "0"])
def test_sigterm_lets_a_running_stream_finish_within_the_grace_period(tiny_model_dir, grace):
    server, url = start_serve(tiny_model_dir, "--grace-period", grace)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={"model": tiny_model_dir, **LONG},
                          timeout=60) as stream:
            lines = (line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(lines))  # the stream runs
            server.send_signal(signal.SIGTERM)
            if grace != "0":  # admission stops at once: /health and new requests get 503
                deadline = time.monotonic() + 10
                while httpx.get(f"{url}/health", timeout=5).status_code != 503 and time.monotonic() < deadline:
                    time.sleep(0.02)
                refused = httpx.post(f"{url}/v1/completions", json={"model": tiny_model_dir, "prompt": "w1"},
                                     timeout=10)
                assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            rest = list(lines)
        assert server.wait(timeout=60) == 0, server.stderr.read()[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
    if grace == "0":  # cancelled: an error event, no end of the answer
        assert rest[-1:] != ["[DONE]"], rest[-3:]
        assert any("shut down" in line for line in rest), rest[-3:]
    else:  # answered whole
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["usage"]["completion_tokens"] == LONG["max_tokens"]
        assert json.loads(rest[-3])["choices"][0]["finish_reason"] == "length"
