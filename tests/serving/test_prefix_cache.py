"""The server's prefix cache: a chat's compressed cache kept between turns under a byte budget of its own, so a
long chat prefills only each turn's new tokens. On a tiny model with a word-level tokenizer (its answers come back
in the next turn as the very token ids generated), run in-process by uvicorn and driven by the ``openai`` client."""

from __future__ import annotations


import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from transformers import AutoTokenizer  # noqa: E402

from conftest import save_tiny_model_dir, tiny_llama  # noqa: E402
from helpers.serving import serve_in_thread  # noqa: E402
from h2o_compress import CompressionConfig, ConfigError, generate  # noqa: E402
from h2o_compress.serving import ServeRequest, create_app  # noqa: E402
from h2o_compress.serving.engine import Engine, Job  # noqa: E402
from h2o_compress.serving.metrics import Metrics  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
CONFIG = CompressionConfig(budget=16, kv_bits=4)  # tokens: the history is evicted down to 16 per layer and head
FULL = {"budget": 1.0, "kv_bits": 16}  # nothing evicted, nothing quantized
BUDGET = 64 * 1024  # the prefix cache's bytes: a conversation of CONFIG holds about 4 KiB, one of FULL 14 KiB a turn
MAX_TOKENS = 4


def _engine(model, tokenizer, held: int | None = None, **settings) -> Engine:
    """An engine of the tiny model serving `CONFIG` as ``tiny`` with `ServeRequest` ``settings``."""
    return Engine(model, tokenizer, Metrics(), ServeRequest("tiny", CONFIG, max_tokens=MAX_TOKENS, **settings),
                  held=held)


def _user(turn: int) -> dict:
    return {"role": "user", "content": " ".join(f"w{(turn * 7 + i) % 120}" for i in range(5))}


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """``(model, tokenizer)``: the tiny LLaMA and a word-level tokenizer with a chat template."""
    path = save_tiny_model_dir(tmp_path_factory.mktemp("tiny-chat"), chat_template=CHAT_TEMPLATE)
    return tiny_llama(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def served(tiny_chat):
    """``(base_url, engine)`` of a running server with a prefix cache of `BUDGET` bytes."""
    engine = _engine(*tiny_chat, batch_size=2, max_queue=4, prefix_cache_bytes=BUDGET)
    with serve_in_thread(create_app(engine)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url: str) -> dict[str, float]:
    """The server's metrics without labels, by name."""
    lines = [line.split() for line in httpx.get(url + "/metrics").text.splitlines() if not line.startswith("#")]
    return {parts[0]: float(parts[1]) for parts in lines if len(parts) == 2}


def test_fifty_turn_chat_holds_bounded_bytes_and_prefills_only_new_tokens(served, client):
    url, _ = served
    messages, prefilled, held, prompts = [], [], [], []
    before = _metrics(url)["h2o_prefill_tokens_total"]
    for turn in range(50):
        messages.append(_user(turn))
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS)
        metrics = _metrics(url)
        prefilled.append(metrics["h2o_prefill_tokens_total"] - before)
        before = metrics["h2o_prefill_tokens_total"]
        held.append(metrics["h2o_prefix_cache_bytes"])
        usage = answer.usage
        prompts.append(usage.prompt_tokens)
        assert prefilled[-1] == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    assert prompts[-1] > 600 and prefilled[0] == prompts[0]  # the history grew; the first turn had nothing kept
    assert max(prefilled[1:]) <= 5 + 3 + MAX_TOKENS  # a turn's new message, its template and the last answer token
    assert max(prefilled[-10:]) <= max(prefilled[1:11])  # flat: not growing with the history
    assert 0 < max(held) <= BUDGET and held[-1] == held[10]  # one conversation of CONFIG: the same bytes each turn
    assert metrics["h2o_prefix_cache_entries"] == 1  # each turn replaced the one before it


def test_resumed_turns_at_full_budget_equal_a_fresh_prefill(served, client, tiny_chat):
    model, tokenizer = tiny_chat
    messages = []
    for turn in range(4):
        messages.append(_user(100 + turn))
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                extra_body={"h2o": FULL})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        fresh = generate(model, tokenizer, text, CompressionConfig(**FULL), max_new_tokens=MAX_TOKENS, chat=False)
        assert answer.choices[0].message.content == fresh.text
        assert (answer.usage.prompt_tokens_details.cached_tokens > 0) == (turn > 0)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})


def test_completions_and_other_settings_are_not_resumed(served, client):
    messages = [_user(200)]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, _user(201)]
    other = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                           extra_body={"h2o": {"budget": 12}})
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # kept for another setting
    plain = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=MAX_TOKENS)
    assert plain.usage.prompt_tokens_details.cached_tokens == 0


def test_least_recently_used_conversation_is_dropped_at_the_budget(tiny_chat):
    from fastapi.testclient import TestClient

    engine = _engine(*tiny_chat, batch_size=1, prefix_cache_bytes=5000)  # one conversation fits
    chats = [[_user(300)], [_user(400)]]
    with TestClient(create_app(engine)) as http:
        for turn in range(2):
            for chat in chats:
                body = http.post("/v1/chat/completions", json={"model": "tiny", "messages": chat}).json()
                chat += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         _user(500 + turn)]
                assert engine.prefix.held <= 5000 and len(engine.prefix.entries) == 1
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the other one was dropped


def test_the_planner_leaves_the_prefix_budget_out_of_the_batch(tiny_chat):
    import asyncio

    from h2o_compress.runtime.batch_requests import prepare

    model, tokenizer = tiny_chat
    prepared = prepare(model, tokenizer, {"id": "0", "prompt": "w1 w2 w3 w4"}, 0, False, MAX_TOKENS, 0.0, None)
    job = Job(prepared, CONFIG, asyncio.new_event_loop())
    rows = [_engine(model, tokenizer, batch_size=4096, memory_limit="4MiB", held=0,
                    prefix_cache_bytes=prefix)._rows(CONFIG, [job])[0] for prefix in (None, "1MiB", "2MiB")]
    assert rows[0] > rows[1] > rows[2] >= 1  # each MiB given to the prefix cache is a MiB fewer for the rows


def test_the_request_keeps_the_prefix_budget_in_bytes():
    budget = lambda value, limit=None: ServeRequest("tiny", CONFIG, memory_limit=limit,  # noqa: E731
                                                    prefix_cache_bytes=value).prefix_cache_bytes
    assert budget(None, "1GiB") == budget("0") == budget(0) == 0
    assert budget("64MiB", "1GiB") == 64 << 20 and budget(4096) == 4096
    with pytest.raises(ConfigError, match="not below --memory-limit"):
        budget("1GiB", "1GiB")
    with pytest.raises(ConfigError, match="prefix_cache_bytes='lots' is invalid"):
        budget("lots")
    with pytest.raises(ConfigError, match="prefix_cache_bytes=True is invalid"):
        budget(True)


@pytest.mark.parametrize("flags, message", [
    (["--policy", "h2o", "--memory-limit", "1GiB", "--prefix-cache-bytes", "2GiB"],
     "error: prefix_cache_bytes='2GiB' is not below --memory-limit"),
    (["--prefix-cache-bytes", "64MiB"], "error: --prefix-cache-bytes needs a policy without a scoring pass of its "
                                        "own: policy 'lookahead'"),
])
def test_cli_refuses_a_bad_prefix_cache_in_one_line(flags, message):
    from typer.testing import CliRunner

    from h2o_compress.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", "no-such-model-is-loaded", *flags])
    assert result.exit_code == 2
    assert result.output.startswith(message) and len(result.output.strip().splitlines()) == 1


def test_a_request_refuses_a_prefix_cache_under_a_scoring_policy():
    with pytest.raises(ConfigError, match="policy 'snapkv' scores each whole prompt"):
        ServeRequest("tiny", CompressionConfig(policy="snapkv", budget=16), prefix_cache_bytes="1MiB")
    assert ServeRequest("tiny", CompressionConfig(policy="snapkv", budget=16)).prefix_cache_bytes == 0
