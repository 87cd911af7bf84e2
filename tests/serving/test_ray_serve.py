"""``serve --ray local --replicas 2``: the app as a Ray Serve deployment (a local Ray instance started for the
run), driven by the official ``openai`` client through Ray Serve's proxy, then stopped by SIGTERM: exit 0 and the
Ray instance gone. Slow (starting Ray and its replicas takes tens of seconds on 2 cores)."""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("grpc")  # ray[serve]
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from conftest import save_tiny_model_dir  # noqa: E402
from helpers.serving import start_serve  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.mark.slow
def test_ray_serve_two_replicas_answer_the_openai_client_and_stop_on_sigterm(tmp_path):
    model = save_tiny_model_dir(tmp_path / "chat-model", chat_template=CHAT_TEMPLATE)
    server, url = start_serve(model, "--ray", "local", "--replicas", "2", "--grace-period", "5", timeout=300)
    try:
        assert server.poll() is None, server.stderr.read()[-3000:]
        ray_processes = psutil.Process(server.pid).children(recursive=True)
        assert len(ray_processes) > 2  # the local Ray instance: GCS, raylet, workers (the replicas)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [model]
        done = client.completions.create(model=model, prompt="w1 w2 w3", max_tokens=6)
        assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w5 w6"}],
                                              max_tokens=4)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
        pieces = [c.choices[0].text for c in client.completions.create(
            model=model, prompt="w1 w2 w3", max_tokens=6, stream=True) if c.choices]
        assert "".join(pieces) == done.choices[0].text  # greedy: the same answer, streamed
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, server.stderr.read()[-3000:]
        gone, alive = psutil.wait_procs(ray_processes, timeout=30)
        assert not alive, [p.info if hasattr(p, "info") else p for p in alive]  # Ray shut down with the server
    finally:
        if server.poll() is None:
            server.kill()
