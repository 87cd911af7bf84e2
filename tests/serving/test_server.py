"""``h2o-compress serve``: the app on the tiny model, run in-process by uvicorn on a free loopback port, driven
with the ``openai`` client (and httpx where the client hides the HTTP)."""

from __future__ import annotations

import copy
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")


from helpers.serving import serve_in_thread  # noqa: E402
from helpers.tiny_lm import tiny_lm  # noqa: E402
from h2o_compress import CompressionConfig, generate  # noqa: E402
from h2o_compress.serving import ServeRequest, create_app  # noqa: E402
from h2o_compress.serving.engine import Engine, Job  # noqa: E402
from h2o_compress.serving.metrics import Metrics  # noqa: E402

CONFIG = CompressionConfig(budget=12, kv_bits=8)  # tokens: the prompts below evict
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = "The history of the heavy hitter oracle begins with a cache"
MAX_TOKENS = 12


class GatedEngine(Engine):
    """An engine whose batches start only while ``gate`` is set (so a test can hold requests in the queue)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def _run_batch(self, first):
        self.gate.wait()
        super()._run_batch(first)


def _tokenizer():
    tokenizer = copy.deepcopy(tiny_lm()[1])  # the helper's tokenizer is shared: give this one a chat template
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def served():
    """``(base_url, engine)`` of a running server (2 rows, at most 2 requests waiting)."""
    request = ServeRequest("tiny", CONFIG, batch_size=2, max_queue=2, max_tokens=MAX_TOKENS)
    engine = GatedEngine(tiny_lm()[0], _tokenizer(), Metrics(), request)
    with serve_in_thread(create_app(engine)) as url:
        yield url, engine
    assert not engine.alive  # the app's shutdown stopped the engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference():
    """``generate()`` alone (a model of its own) for a prompt, with the server's setting."""
    model, tokenizer = tiny_lm()[0], _tokenizer()

    def text(prompt: str, chat: bool = False, max_new_tokens: int = MAX_TOKENS) -> str:
        return generate(model, tokenizer, prompt, CONFIG, max_new_tokens=max_new_tokens, chat=chat).text

    return text


def test_completion_equals_generate_alone(client, reference):
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].text == reference(PROMPT)
    assert answer.usage.prompt_tokens > CONFIG.budget  # the cache evicted while it read the prompt
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streamed_pieces_join_to_the_same_text(client, reference):
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)]
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == reference(PROMPT)


def test_stream_options_include_usage_ends_with_the_counts(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None


def test_concurrent_requests_each_equal_generate_alone(served, reference):
    # a queue of 2: the third request may meet a full queue (429) on a busy machine and retries, as clients do
    client = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=10, timeout=120)
    prompts = [PROMPT, "A cache of keys and values grows with every token of the answer",
               "Eviction keeps the heavy hitters and the newest tokens of the window"]
    answers = [None] * len(prompts)

    def ask(i):
        answers[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=MAX_TOKENS).choices[0].text

    workers = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(180)  # generous: CI shares 2 cores with another worker
    assert answers == [reference(p) for p in prompts]


def test_chat_completion_uses_the_chat_template(client, reference):
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=MAX_TOKENS)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == reference(PROMPT, chat=True)
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=MAX_TOKENS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == reference(PROMPT, chat=True)


def test_stop_string_cuts_the_text(client, reference):
    full = reference(PROMPT, max_new_tokens=MAX_TOKENS)
    stop = full.strip()[2:4]
    assert stop and stop in full
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, stop=[stop])
    assert answer.choices[0].text == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_bad_h2o_budget_is_a_one_line_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"h2o": {"budget": 2.5}})
    message = caught.value.body["message"]
    assert caught.value.status_code == 400 and "budget" in message and "\n" not in message


def test_h2o_override_runs_with_its_own_setting(client):
    model, tokenizer = tiny_lm()[0], _tokenizer()
    own = CompressionConfig(budget=8, kv_bits=4, policy="sink")
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       extra_body={"h2o": {"budget": 8, "kv_bits": 4, "policy": "sink"}})
    assert answer.choices[0].text == generate(model, tokenizer, PROMPT, own, max_new_tokens=MAX_TOKENS,
                                              chat=False).text


def test_unknown_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={"logit_bias_x": 1})
    assert "logit_bias_x" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, top_p=0.5)
    assert "top_p" in caught.value.body["message"]


def test_prompt_beyond_the_window_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5000)
    assert "context" in caught.value.body["message"]


def test_queue_full_is_429_with_retry_after(served, client):
    url, engine = served
    engine.gate.clear()  # batches wait: requests stay in the queue (at most 2)
    waiting = [threading.Thread(target=client.completions.create, kwargs={"model": "tiny", "prompt": PROMPT,
                                                                          "max_tokens": 2}) for _ in range(2)]
    try:
        for worker in waiting:
            worker.start()
        deadline = time.monotonic() + 10
        while len(engine._waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT}, timeout=10)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_error"
    finally:
        engine.gate.set()
        for worker in waiting:
            worker.join(30)


def test_a_crash_in_one_request_fails_it_alone(served, client, monkeypatch):
    receive = Job.receive

    def crash(self, piece):
        if "boom" in (self.prepared.request.prompt or ""):
            raise RuntimeError("decode failed")
        receive(self, piece)

    monkeypatch.setattr(Job, "receive", crash)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="tiny", prompt="boom " + PROMPT, max_tokens=4)
    assert "decode failed" in caught.value.body["message"]
    assert httpx.get(served[0] + "/health").json() == {"status": "ok"}
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_row(served, stream):
    url, engine = served
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3000, "stream": stream}
    if stream:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            next(response.iter_lines())
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=1)
    deadline = time.monotonic() + 10
    while engine.jobs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.jobs
    assert 'h2o_requests_total{outcome="cancelled"}' in httpx.get(url + "/metrics").text


def test_models_health_and_metrics(served, client):
    url, _ = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    metrics = httpx.get(url + "/metrics").text
    for name in ("h2o_running_sequences", "h2o_waiting_sequences", "h2o_kv_cache_bytes", "h2o_evicted_tokens_total",
                 "h2o_prefill_tokens_total", "h2o_decode_tokens_total", "h2o_time_to_first_token_seconds_bucket",
                 "h2o_request_latency_seconds_count"):
        assert name in metrics
    value = lambda name: float(next(l for l in metrics.splitlines() if l.startswith(name + " ")).split()[1])  # noqa: E731
    assert value("h2o_prefill_tokens_total") > 0 and value("h2o_evicted_tokens_total") > 0
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)


def test_a_request_beyond_the_memory_limit_is_a_400():
    from fastapi.testclient import TestClient

    request = ServeRequest("tiny", CONFIG, batch_size=2, memory_limit="1KiB", max_tokens=4)
    with TestClient(create_app(Engine(tiny_lm()[0], _tokenizer(), Metrics(), request))) as http:
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT})
    assert response.status_code == 400
    assert "does not fit --memory-limit" in response.json()["error"]["message"]


@pytest.mark.parametrize("setting, named", [({"port": 99999}, "port=99999"), ({"max_queue": 0}, "max_queue=0"),
                                            ({"log_level": "loud"}, "log_level='loud'")])
def test_bad_server_settings_are_refused_before_loading(setting, named):
    from h2o_compress import ConfigError, serve

    with pytest.raises(ConfigError, match=named):
        serve(model="no-such-model-is-loaded", **setting)


def test_cli_refuses_a_bad_port_in_one_line():
    from typer.testing import CliRunner

    from h2o_compress.cli import app

    result = CliRunner().invoke(app, ["serve", "--port", "99999"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: port=99999 is invalid; allowed: an integer from 0 to 65535"
