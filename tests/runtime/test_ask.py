"""Compress-then-ask: a context compressed once, then asked several times from the same compressed state."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tiny_lm import save_tiny_lm, tiny_lm
from typer.testing import CliRunner

from h2o_compress import ASK_DEFAULTS, CompressionConfig, ConfigError, InputError, ask, compress, make_cache
from h2o_compress.runtime.ask import SEPARATOR, CompressedContext
from h2o_compress.cache.container import frozen_layer
from h2o_compress.cli import app
from h2o_compress.runtime.generation import encode_prompt
from h2o_compress.evaluation import default_corpus

CONTEXT = default_corpus()[:1500]


def snapshot(cache) -> dict:
    return {(i, k): v.clone() for i, layer in enumerate(cache.layers) for k, v in layer.tensors().items()}


def test_frozen_copy_holds_the_same_tokens_and_evicts_nothing_more():
    model, tokenizer = tiny_lm()
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    cache = make_cache(model, CompressionConfig(budget=0.25, kv_bits=4), max_length=60)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)
        before = snapshot(cache)
        copy = cache.frozen_copy(60 + 30)
        for layer, mine in zip(copy.layers, cache.layers):
            assert torch.equal(layer.positions(), mine.positions())
            assert layer.setting.capacity is None and layer.store.slots >= mine.store.slots
        extra = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(1))
        model(input_ids=extra[:, :10], past_key_values=copy)
        for token in range(10, 30):
            model(input_ids=extra[:, token : token + 1], past_key_values=copy)
    assert copy.kept_length() == cache.kept_length() + 30  # nothing evicted while answering
    assert all(torch.equal(v, snapshot(cache)[k]) for k, v in before.items())  # the original is untouched
    assert cache.kept_length() == 15


def test_each_question_starts_from_the_same_compressed_context():
    model, tokenizer = tiny_lm()
    context = compress(model, tokenizer, CONTEXT, chat=False)
    assert context.cache.capacity == ASK_DEFAULTS.capacity(context.tokens)
    layers = range(len(context.cache.layers))  # the defaults size each layer by the scores: the same total
    kept = [int(layer.kept_per_head().sum()) for layer in context.cache.layers]  # adaptive heads: per layer
    assert kept == [c * context.cache.layers[0].kept_per_head().shape[1] for c in context.cache.capacities]
    assert sum(context.cache.capacities) == context.cache.capacity * len(layers)
    before = snapshot(context.cache)
    first = ask(model, tokenizer, context, "Who is the detective?", max_new_tokens=6)
    ask(model, tokenizer, context, "What is the pass key?", max_new_tokens=6)
    again = ask(model, tokenizer, context, "Who is the detective?", max_new_tokens=6)
    assert first.token_ids == again.token_ids
    after = snapshot(context.cache)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert first.prompt_tokens == encode_prompt(tokenizer, CONTEXT + SEPARATOR + "Who is the detective?", False).shape[1]


def test_ask_with_budget_one_answers_as_the_full_prompt_does():
    """Nothing evicted, 16 bits: asking a compressed context equals generating from the whole prompt."""
    from h2o_compress import generate

    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="full", kv_bits=16)
    context = compress(model, tokenizer, CONTEXT, config, chat=False)
    answer = ask(model, tokenizer, context, "Who is the detective?", max_new_tokens=8)
    whole = generate(model, tokenizer, CONTEXT + SEPARATOR + "Who is the detective?", config, max_new_tokens=8,
                     chat=False)
    assert answer.token_ids == whole.token_ids


def test_saved_context_answers_as_the_live_one(tmp_path):
    model, tokenizer = tiny_lm()
    context = compress(model, tokenizer, CONTEXT, chat=False)
    context.save(tmp_path / "ctx.safetensors")
    loaded = CompressedContext.load(tmp_path / "ctx.safetensors", model, tokenizer, CONTEXT, chat=False)
    live = ask(model, tokenizer, context, "Who is it?", max_new_tokens=6)
    again = ask(model, tokenizer, loaded, "Who is it?", max_new_tokens=6)
    assert live.token_ids == again.token_ids
    with pytest.raises(InputError, match="not the start of the context"):
        CompressedContext.load(tmp_path / "ctx.safetensors", model, tokenizer, "Another document entirely.", False)


def test_cli_ask_answers_every_question_and_saves_the_context(tmp_path):
    model_dir = save_tiny_lm(tmp_path / "model")
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT)
    saved = tmp_path / "ctx.safetensors"
    runner = CliRunner()
    base = ["ask", "--model", model_dir, "--no-chat", "--context-file", str(document), "--max-new-tokens", "4",
            "--json"]
    result = runner.invoke(app, [*base, "--question", "Who?", "--question", "Where?", "--save-cache", str(saved)])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert [a["question"] for a in figures["answers"]] == ["Who?", "Where?"]
    assert figures["config"]["heavy_ratio"] == 1.0 and figures["config"]["kv_bits"] == 4  # ask's own defaults
    assert figures["config"]["sink_tokens"] == 4
    assert figures["context_kv_bytes"] < figures["context_kv_bytes_full_fp16"]
    loaded = runner.invoke(app, [*base, "--question", "Who?", "--load-cache", str(saved)])
    assert loaded.exit_code == 0, loaded.output
    assert json.loads(loaded.stdout)["answers"][0]["text"] == figures["answers"][0]["text"]


def test_cli_ask_passes_the_lookahead_request_to_the_scoring_pass(tmp_path, monkeypatch):
    """``--lookahead-request`` reaches the pass that scores the document (and the default request otherwise)."""
    from h2o_compress.runtime import context_scores

    asked = []
    real = context_scores.lookahead_scores

    def spy(model, tokenizer, ids, request, *args):
        asked.append(request)
        return real(model, tokenizer, ids, request, *args)

    monkeypatch.setattr(context_scores, "lookahead_scores", spy)
    model_dir = save_tiny_lm(tmp_path / "model")
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT[:600])
    base = ["ask", "--model", model_dir, "--no-chat", "--context-file", str(document), "--max-new-tokens", "2",
            "--question", "Who?", "--json"]
    result = CliRunner().invoke(app, [*base, "--policy", "lookahead", "--lookahead-request", "Which names and places?"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"]["lookahead_request"] == "Which names and places?"
    assert CliRunner().invoke(app, [*base, "--policy", "lookahead"]).exit_code == 0
    assert asked == ["Which names and places?", "List the important facts and numbers in the text above."]


def test_cli_ask_defaults_give_way_to_a_policy_they_do_not_fit(tmp_path):
    """``ask``'s defaults are KVzip's (kvzip, global layers, adaptive heads); ``--policy h2o`` gets uniform layers
    and ``--policy local`` uniform heads instead of an error, while the same flags given by hand are refused."""
    model_dir = save_tiny_lm(tmp_path / "model")
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT[:600])
    base = ["ask", "--model", model_dir, "--no-chat", "--context-file", str(document), "--max-new-tokens", "2",
            "--question", "Who?", "--json"]
    configs = {}
    for policy in (None, "h2o", "local"):
        result = CliRunner().invoke(app, base + (["--policy", policy] if policy else []))
        assert result.exit_code == 0, result.output
        configs[policy] = json.loads(result.stdout)["config"]
    pick = lambda c: (c["policy"], c["layer_budgets"], c["head_budgets"])  # noqa: E731
    assert pick(configs[None]) == ("kvzip", "global", "adaptive") == pick(ASK_DEFAULTS.to_dict())
    assert pick(configs["h2o"]) == ("h2o", "uniform", "uniform")
    assert pick(configs["local"]) == ("local", "uniform", "uniform")
    refused = CliRunner().invoke(app, base + ["--policy", "h2o", "--layer-budgets", "global"])
    assert refused.exit_code != 0 and "allowed policies: snapkv, kvzip, lookahead" in refused.output


@pytest.mark.parametrize("args,message", [
    (["--question", ""], "empty"),
    (["--question", "Q", "--budget", "0"], "budget"),
    (["--question", "Q", "--save-cache", "{d}/a.safetensors", "--load-cache", "{d}/b.safetensors"], "cannot be combined"),
])
def test_cli_ask_refuses_bad_input_before_loading(tmp_path, args, message):
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT)
    result = CliRunner().invoke(
        app, ["ask", "--model", str(tmp_path / "missing"), "--context-file", str(document),
              *[a.format(d=tmp_path) for a in args]],
    )
    assert result.exit_code == 2
    assert message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]


def test_cli_ask_refuses_a_missing_context_file(tmp_path):
    result = CliRunner().invoke(app, ["ask", "--context-file", str(tmp_path / "none.txt"), "--question", "Q"])
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_kvzip_keeps_what_the_reconstruction_attends_most():
    from h2o_compress.runtime.context_scores import reconstruction_scores

    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="kvzip", budget=0.25, heavy_ratio=0.9, kv_bits=16)
    context = compress(model, tokenizer, CONTEXT[:400], config, chat=False)
    ids = encode_prompt(tokenizer, CONTEXT[:400], False)
    assert model.config._attn_implementation == "h2o_compress"  # restored after the eager reconstruction pass
    scores = reconstruction_scores(model, tokenizer, ids)
    assert len(scores) == len(context.cache.layers) and scores[0].shape == (1, 2, ids.shape[1])
    assert bool((scores[0] > 0).all()) and bool((scores[0] <= 1).all())
    capacity = context.cache.capacity
    heavy = context.cache.layers[0].setting.policy.heavy(capacity)
    for layer, layer_scores in zip(context.cache.layers, scores):
        kept = layer.positions()[0]  # [kv_heads, kept]
        recent = set(range(ids.shape[1] - (capacity - heavy), ids.shape[1]))
        for head in range(2):
            ranked = [p for p in layer_scores[0, head].argsort(descending=True, stable=True).tolist()
                      if p not in recent][:heavy]
            assert set(kept[head].tolist()) == set(ranked) | recent
    assert ask(model, tokenizer, context, "Who?", max_new_tokens=4).new_tokens >= 1


def test_lookahead_keeps_what_the_answer_to_its_request_attends_most():
    """``lookahead``: the prefill keeps, per KV head, the top of the attention the model's own answer to the fixed
    request gives the context (pooled), plus the recent window; the compressed context then answers as usual."""
    from h2o_compress.runtime.context_scores import lookahead_scores

    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="lookahead", budget=0.25, heavy_ratio=0.9, kv_bits=16)
    context = compress(model, tokenizer, CONTEXT[:400], config, chat=False)
    ids = encode_prompt(tokenizer, CONTEXT[:400], False)
    assert model.config._attn_implementation == "h2o_compress"  # restored after the eager lookahead pass
    policy = context.cache.layers[0].setting.policy
    assert (policy.request, policy.new_tokens, policy.pool, policy.segment) == (None, 32, 7, 1024)
    assert policy.request_for(question_in_prompt=False) == "List the important facts and numbers in the text above."
    scores = lookahead_scores(model, tokenizer, ids, policy.request_for(False), policy.new_tokens, policy.pool,
                              policy.segment)
    assert len(scores) == len(context.cache.layers) and scores[0].shape == (1, 2, ids.shape[1])
    capacity = context.cache.capacity
    heavy = context.cache.layers[0].setting.policy.heavy(capacity)
    recent = set(range(ids.shape[1] - (capacity - heavy), ids.shape[1]))
    for layer, layer_scores in zip(context.cache.layers, scores):
        kept = layer.positions()[0]  # [kv_heads, kept]
        for head in range(2):
            ranked = [p for p in layer_scores[0, head].argsort(descending=True, stable=True).tolist()
                      if p not in recent][:heavy]
            assert set(kept[head].tolist()) == set(ranked) | recent
    assert ask(model, tokenizer, context, "Who?", max_new_tokens=4).new_tokens >= 1


def test_lookahead_scores_sum_the_answers_attention_and_pool_it(monkeypatch):
    """A hand-made attention pattern: every query of the request and answer gives key 5 of layer 0 all its
    weight (head 0) and key 2 half of it (head 1); unpooled, the scores are those sums; pooled over 3, the
    neighbours take the maximum."""
    from types import SimpleNamespace

    from transformers import DynamicCache

    from h2o_compress.runtime import context_scores

    model, tokenizer = tiny_lm()
    ids = encode_prompt(tokenizer, CONTEXT[:120], False)
    tokens = ids.shape[1]
    calls = []

    def fake_forward(input_ids, past_key_values, use_cache, output_attentions=False, logits_to_keep=1):
        queries = input_ids.shape[1]
        logits = torch.zeros(1, 1, 128)
        if not output_attentions:
            return SimpleNamespace(logits=logits)
        calls.append(queries)
        probs = torch.zeros(1, 4, queries, tokens + 40)  # 4 query heads, 2 KV heads (keys beyond: the request's)
        probs[:, 0:2, :, 5] = 1.0
        probs[:, 2:4, :, 2] = 0.5
        return SimpleNamespace(logits=logits, attentions=(probs, probs * 0))

    monkeypatch.setattr(type(model), "__call__", lambda self, **kw: fake_forward(**kw))
    monkeypatch.setattr(context_scores, "model_dims",
                        lambda config: SimpleNamespace(kv_heads=2, num_heads=4, num_layers=2))
    monkeypatch.setattr(DynamicCache, "crop", lambda self, count: None)
    monkeypatch.setattr(DynamicCache, "get_seq_length", lambda self, layer_idx=0: 0)
    raw = context_scores.lookahead_scores(model, tokenizer, ids, "List it.", new_tokens=3, pool=1)
    asked = calls[0]
    assert calls == [asked, 1, 1]  # the request, then one query per answer token after the first
    votes = asked + 2
    assert raw[0][0, 0, 5] == 2 * votes and raw[0][0, 1, 2] == 2 * 0.5 * votes
    assert float(raw[0].sum()) == 2 * votes + votes and float(raw[1].abs().sum()) == 0
    pooled = context_scores.lookahead_scores(model, tokenizer, ids, "List it.", new_tokens=3, pool=3)
    assert pooled[0][0, 0, 4:7].tolist() == [2 * votes] * 3 and pooled[0][0, 1, 1:4].tolist() == [votes] * 3


def test_lookahead_without_a_request_answers_the_prompt_itself(monkeypatch):
    """The question is in the prompt (``request=None``): the prompt is read up to its last token, which opens the
    answer; that token and the answer's vote, once, whatever the segment length."""
    from types import SimpleNamespace

    from transformers import DynamicCache

    from h2o_compress.runtime import context_scores

    model, tokenizer = tiny_lm()
    ids = encode_prompt(tokenizer, CONTEXT[:120], False)
    tokens = ids.shape[1]
    calls = []

    def fake_forward(input_ids, past_key_values, use_cache, output_attentions=False, logits_to_keep=1):
        calls.append((input_ids.shape[1], output_attentions))
        probs = torch.zeros(1, 4, input_ids.shape[1], tokens + 40)
        probs[:, 0:2, :, tokens - 1] = 1.0  # head 0: the prompt's last token
        probs[:, 2:4, :, 7] = 0.5
        return SimpleNamespace(logits=torch.zeros(1, 1, 128), attentions=(probs, probs * 0))

    monkeypatch.setattr(type(model), "__call__", lambda self, **kw: fake_forward(**kw))
    monkeypatch.setattr(context_scores, "model_dims",
                        lambda config: SimpleNamespace(kv_heads=2, num_heads=4, num_layers=2))
    monkeypatch.setattr(DynamicCache, "crop", lambda self, count: None)
    monkeypatch.setattr(DynamicCache, "get_seq_length", lambda self, layer_idx=0: 0)
    raw = context_scores.lookahead_scores(model, tokenizer, ids, None, new_tokens=3, pool=1, segment=50)
    assert calls == [(tokens - 1, False), (1, True), (1, True), (1, True)]  # read, then 3 single-token queries
    assert raw[0][0, 0, tokens - 1] == 2 * 3 and raw[0][0, 1, 7] == 2 * 0.5 * 3
    assert float(raw[0].sum()) == 2 * 3 + 3 and float(raw[1].abs().sum()) == 0


@pytest.mark.parametrize("entry", ["generate", "generate, a fresh cache given", "needle"])
@pytest.mark.parametrize("request_text", [None, "Which names?"])
def test_question_in_prompt_lookahead_ranks_by_the_prompts_own_answer(monkeypatch, entry, request_text):
    """``generate`` (and ``eval needle``'s question-in-prompt protocol) with ``lookahead``: the pass over the whole
    prompt answers the prompt itself (or the request given), and the prefill keeps the top of those scores plus the
    recent window."""
    from h2o_compress import generate
    from h2o_compress.runtime import context_scores
    from h2o_compress.runtime.generation import make_scored_cache
    from h2o_compress.evaluation.needle import answer_prompt

    asked, computed = [], []
    real = context_scores.lookahead_scores

    def spy(model, tokenizer, ids, request, *args):
        asked.append(request)
        computed.append(real(model, tokenizer, ids, request, *args))
        return computed[-1]

    def read_spy(model, ids, **kwargs):  # a prompt that holds its question is read once, its answer voting
        read = context_scores.read_prompt(model, ids, **kwargs)
        asked.append(None)
        computed.append(read.scores)
        return read

    monkeypatch.setattr(context_scores, "lookahead_scores", spy)
    monkeypatch.setattr("h2o_compress.runtime.generation.read_prompt", read_spy)
    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="lookahead", budget=0.25, heavy_ratio=0.9, kv_bits=16,
                               lookahead_request=request_text)
    ids = encode_prompt(tokenizer, CONTEXT[:400], False)
    made = []
    module = "h2o_compress.evaluation.needle" if entry == "needle" else "h2o_compress.runtime.generation"
    real_make = make_scored_cache
    monkeypatch.setattr(f"{module}.make_scored_cache",
                        lambda *args, **kwargs: made.append(real_make(*args, **kwargs)) or made[-1])
    if entry == "generate":
        generate(model, tokenizer, CONTEXT[:400], config, max_new_tokens=1, chat=False)
    elif entry == "generate, a fresh cache given":
        made.append(make_cache(model, config, max_length=ids.shape[1] + 1))
        generate(model, tokenizer, CONTEXT[:400], config, max_new_tokens=1, chat=False, cache=made[0])
    else:
        answer_prompt(model, tokenizer, ids, config, max_new_tokens=1)
    (cache,) = made
    assert asked == [request_text]
    assert model.config._attn_implementation == "h2o_compress"
    heavy = cache.layers[0].setting.policy.heavy(cache.capacity)
    recent = set(range(ids.shape[1] - (cache.capacity - heavy), ids.shape[1]))
    for layer, layer_scores in zip(cache.layers, computed[0]):
        kept = layer.positions()[0]
        for head in range(2):
            ranked = [p for p in layer_scores[0, head].argsort(descending=True, stable=True).tolist()
                      if p not in recent][:heavy]
            assert set(kept[head].tolist()) == set(ranked) | recent


def test_generate_runs_kvzips_reconstruction_over_the_prompt(monkeypatch):
    """``kvzip`` in ``generate``: its reconstruction pass scores the prompt once; a prompt continuing a cache
    that already holds tokens is not scored again."""
    from h2o_compress import generate
    from h2o_compress.runtime import context_scores
    from h2o_compress.runtime.prefill import prefill

    calls = []
    real = context_scores.reconstruction_scores
    monkeypatch.setattr(context_scores, "reconstruction_scores",
                        lambda model, tokenizer, ids: calls.append(ids.shape[1]) or real(model, tokenizer, ids))
    model, tokenizer = tiny_lm()
    config = CompressionConfig(policy="kvzip", budget=0.5, kv_bits=16)
    first = generate(model, tokenizer, CONTEXT[:200], config, max_new_tokens=2, chat=False)
    assert calls == [first.prompt_tokens]
    cache = make_cache(model, config, max_length=400)
    with torch.inference_mode():
        prefill(model, encode_prompt(tokenizer, CONTEXT[:260], False)[:, :100], cache)
    generate(model, tokenizer, CONTEXT[:260], max_new_tokens=2, chat=False, cache=cache)
    assert calls == [first.prompt_tokens]


def test_lookahead_asks_again_after_every_segment_and_keeps_the_largest_score():
    """A context read in segments: the request (and its answer) is dropped from the cache after each ask, so the
    last segment's tokens get exactly the scores of one request after the whole context, and every earlier
    token at least the score its own segment's request gave it."""
    from h2o_compress.runtime.context_scores import lookahead_scores, segment_ends

    assert segment_ends(4096, 1024) == [1024, 2048, 3072, 4096]
    assert segment_ends(1500, 1024) == [1500] and segment_ends(1536, 1024) == [1024, 1536]
    assert segment_ends(100, 1024) == [100] and segment_ends(90, 40) == [40, 90]
    model, tokenizer = tiny_lm()
    ids = encode_prompt(tokenizer, CONTEXT[:400], False)
    tokens, cut = ids.shape[1], 120
    whole = lookahead_scores(model, tokenizer, ids, "List it.", new_tokens=6, pool=3, segment=tokens)
    first = lookahead_scores(model, tokenizer, ids[:, :cut], "List it.", new_tokens=6, pool=3, segment=cut)
    pieces = lookahead_scores(model, tokenizer, ids, "List it.", new_tokens=6, pool=3, segment=cut)
    assert segment_ends(tokens, cut)[0] == cut
    last = segment_ends(tokens, cut)[-2]
    for layer_whole, layer_first, layer_pieces in zip(whole, first, pieces):
        assert layer_pieces.shape == (1, 2, tokens)
        torch.testing.assert_close(layer_pieces[..., last + 2 :], layer_whole[..., last + 2 :], rtol=1e-4, atol=1e-6)
        assert bool((layer_pieces[..., : cut - 1] >= layer_first[..., : cut - 1] - 1e-6).all())
        assert bool((layer_pieces >= layer_whole - 1e-6).all())
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("policy", ["lookahead", "kvzip"])
def test_question_agnostic_scoring_runs_on_every_architecture(tiny_model, policy):
    """LLaMA, OPT and GPT-NeoX: the scoring pass (lookahead in two segments) leaves the model's attention as it was,
    the prefill keeps the capacity, and its kept set follows the scores (a token the scores put first is kept)."""
    from types import SimpleNamespace

    from h2o_compress.runtime.context_scores import hand_context_scores
    from h2o_compress.runtime.prefill import prefill
    from h2o_compress.runtime.context_scores import score_context

    class CharTokenizer:  # no chat template: the request follows as plain text
        chat_template = None

        def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
            return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 100 for c in text]]))

    ids = torch.randint(0, 100, (1, 90), generator=torch.Generator().manual_seed(0))
    config = CompressionConfig(policy=policy, budget=0.3, heavy_ratio=0.9, kv_bits=4)
    cache = make_cache(tiny_model, config, max_length=90)
    cache.layers[0].setting.policy.segment = 40  # lookahead: requests after 40 and 90 tokens (ignored by kvzip)
    scores = score_context(tiny_model, CharTokenizer(), ids, cache.layers[0].setting.policy)
    implementation = tiny_model.config._attn_implementation
    with torch.inference_mode():
        hand_context_scores(tiny_model, CharTokenizer(), ids, cache)
        prefill(tiny_model, ids, cache)
    assert tiny_model.config._attn_implementation == implementation == "h2o_compress"
    assert cache.kept_length() == cache.capacity == 27
    recent = 27 - cache.layers[0].setting.policy.heavy(27)
    for layer, layer_scores in zip(cache.layers, scores):
        kept = layer.positions()[0]
        for head in range(kept.shape[0]):
            top = int(layer_scores[0, head, : 90 - recent].argmax())
            assert top in kept[head].tolist()


def test_bad_inputs_of_compress_then_ask_are_refused():
    from h2o_compress import CacheStateError, ConfigError
    from h2o_compress.evaluation.needle import check_needle_args

    model, tokenizer = tiny_lm()
    empty = make_cache(model, CompressionConfig(budget=0.25, kv_bits=4), max_length=40)
    with pytest.raises(CacheStateError, match="initialised layer"):
        frozen_layer(empty.layers[0], 10)
    context = compress(model, tokenizer, CONTEXT[:300], chat=False)
    with pytest.raises(CacheStateError, match="below the"):
        context.cache.frozen_copy(context.tokens - 1)
    with pytest.raises(CacheStateError, match="needs a CompressedContext"):
        ask(model, tokenizer, context.cache, "Who?")
    with pytest.raises(InputError, match="empty"):
        ask(model, tokenizer, context, "  ")
    with pytest.raises(ConfigError, match="protocol='other' is not supported"):
        check_needle_args((512,), (0.5,), protocol="other")


@pytest.mark.integration
def test_kvzip_reconstruction_is_asked_as_the_assistant_turn(smollm2):
    """KVzip's prompt (arXiv 2505.23416 §3.1, as kvpress builds it): the request closes the user turn, and the
    context is repeated as the assistant's answer, without the template's system/user header."""
    from h2o_compress.runtime.context_scores import _reconstruction_prompt
    from h2o_compress.runtime.generation import encode_prompt

    _, tokenizer = smollm2
    context = encode_prompt(tokenizer, "The pass key is 48213. Some more prose follows here.")
    request, body = _reconstruction_prompt(tokenizer, context)
    assert tokenizer.decode(request[0]).endswith("Repeat the previous context exactly.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(body[0]).startswith("The pass key is 48213.")
    assert torch.equal(body, context[:, context.shape[1] - body.shape[1] :])
    plain = tokenizer("The pass key is 48213.", return_tensors="pt").input_ids  # no chat header: plain text
    request, body = _reconstruction_prompt(tokenizer, plain)
    assert torch.equal(body, plain) and "<|im_start|>" not in tokenizer.decode(request[0])


def test_evict_chat_header_scores_the_template_header_zero(tmp_path, monkeypatch):
    """``evict_chat_header``: after the scoring pass the chat template's header (what the context opens with
    before the document) scores 0 in every layer, so beyond the sinks it is evicted first; without it the header
    is scored like the rest; a context without the header is left alone."""
    from conftest import save_tiny_model_dir

    from h2o_compress import load_model
    from h2o_compress.runtime.context_scores import chat_header_length, score_context
    from h2o_compress.runtime.generation import encode_prompt

    template = ("{% for m in messages %}w120 w119 w118 {{ m['content'] }} w121{% endfor %}"
                "{% if add_generation_prompt %} w122 w123{% endif %}")
    model, tokenizer = load_model(save_tiny_model_dir(tmp_path / "tiny", chat_template=template), device="cpu")
    ids = encode_prompt(tokenizer, " ".join(f"w{i}" for i in range(1, 40)), chat=True)
    header = chat_header_length(tokenizer, ids)
    assert header == 3 and tokenizer.decode(ids[0, :header]).split() == ["w120", "w119", "w118"]
    plain = score_context(model, tokenizer, ids, CompressionConfig(policy="kvzip", budget=0.3).eviction_policy())
    zeroed = score_context(model, tokenizer, ids, CompressionConfig(
        policy="kvzip", budget=0.3, evict_chat_header=True).eviction_policy())
    assert all(bool((layer[..., :header] > 0).all()) for layer in plain)
    for a, b in zip(plain, zeroed):
        assert bool((b[..., :header] == 0).all()) and torch.equal(a[..., header:], b[..., header:])
    no_chat = encode_prompt(tokenizer, " ".join(f"w{i}" for i in range(1, 40)), chat=False)
    assert chat_header_length(tokenizer, no_chat) == 0
    config = CompressionConfig(policy="kvzip", budget=0.3, heavy_ratio=1.0, sink_tokens=1, evict_chat_header=True)
    context = compress(model, tokenizer, " ".join(f"w{i}" for i in range(1, 40)), config, chat=True)
    kept = {int(p) for layer in context.cache.layers for p in layer.positions().flatten() if p >= 0}
    assert 0 in kept and not kept & {1, 2}  # the sink stays, the rest of the header goes first


def test_evict_chat_header_is_refused_where_nothing_scores_the_context():
    with pytest.raises(ConfigError, match="evict_chat_header is set but policy='h2o'.*kvzip, lookahead"):
        CompressionConfig(policy="h2o", evict_chat_header=True)
    with pytest.raises(ConfigError, match="evict_chat_header='yes' is invalid; allowed: True or False"):
        CompressionConfig(policy="kvzip", evict_chat_header="yes")


def test_cli_ask_config_file_goes_over_asks_defaults(tmp_path):
    """A ``--config`` file that sets only some fields keeps ``ask``'s own defaults for the rest (it used to fall
    back to the library's: h2o at budget 1.0, nothing compressed); the defaults still give way to a policy from the
    file that they do not fit, and the flags given still win over the file."""
    model_dir = save_tiny_lm(tmp_path / "model")
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT[:600])
    base = ["ask", "--model", model_dir, "--no-chat", "--context-file", str(document), "--max-new-tokens", "2",
            "--question", "Who?", "--json"]
    bits_only, h2o = tmp_path / "bits.json", tmp_path / "h2o.toml"
    bits_only.write_text('{"kv_bits": 8}')
    h2o.write_text('policy = "h2o"\nkv_bits = 8\n')
    configs = {}
    for name, extra in (("bits", ["--config", str(bits_only)]), ("h2o", ["--config", str(h2o)]),
                        ("flag", ["--config", str(bits_only), "--kv-bits", "16", "--budget", "0.5"])):
        result = CliRunner().invoke(app, base + extra)
        assert result.exit_code == 0, result.output
        configs[name] = json.loads(result.stdout)["config"]
    pick = lambda c: (c["policy"], c["budget"], c["kv_bits"], c["layer_budgets"], c["head_budgets"])  # noqa: E731
    assert pick(configs["bits"]) == ("kvzip", ASK_DEFAULTS.budget, 8, "global", "adaptive")
    assert pick(configs["h2o"]) == ("h2o", ASK_DEFAULTS.budget, 8, "uniform", "uniform")
    assert pick(configs["flag"]) == ("kvzip", 0.5, 16, "global", "adaptive")


def test_a_context_saved_by_ask_is_refused_by_generate(tmp_path):
    """A compressed context saved by ``ask`` (KVzip's setting: no recent window) used to load in ``generate``, which
    then evicted with no recent window and degenerated ("the the the"); now it is refused, naming ``ask``."""
    model_dir = save_tiny_lm(tmp_path / "model")
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT[:600])
    saved = tmp_path / "ctx.safetensors"
    runner = CliRunner()
    result = runner.invoke(app, ["ask", "--model", model_dir, "--no-chat", "--context-file", str(document),
                                 "--max-new-tokens", "2", "--question", "Who?", "--save-cache", str(saved)])
    assert result.exit_code == 0, result.output
    refused = runner.invoke(app, ["generate", "--model", model_dir, "--no-chat", "--max-new-tokens", "4",
                                  "--load-cache", str(saved), CONTEXT[:600] + " Summarize."])
    assert refused.exit_code == 2
    assert "cannot keep generating with eviction" in refused.output and "leaves no recent window" in refused.output
    assert "ask --load-cache" in refused.output


def test_cli_ask_refuses_an_empty_or_too_long_context_before_compressing(tmp_path, monkeypatch):
    """An empty context file is named; a context + question + new tokens beyond the window is refused before the
    (long) compression, with the most --max-new-tokens that fits."""
    import sys

    ask_module = sys.modules["h2o_compress.runtime.ask"]  # the package's ``ask`` attribute is the function

    def never(*args, **kwargs):
        raise AssertionError("compress() ran")

    monkeypatch.setattr(ask_module, "compress", never)
    model_dir = save_tiny_lm(tmp_path / "model")
    empty, long = tmp_path / "empty.txt", tmp_path / "long.txt"
    empty.write_text(" \n")
    long.write_text(CONTEXT)
    base = ["ask", "--model", model_dir, "--no-chat", "--question", "Who?"]
    result = CliRunner().invoke(app, [*base, "--context-file", str(empty)])
    assert result.exit_code == 2 and f"context file '{empty}' is empty" in result.output
    from transformers import AutoConfig

    window = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    result = CliRunner().invoke(app, [*base, "--context-file", str(long), "--max-new-tokens", str(window)])
    assert result.exit_code == 2, result.output
    assert "context + question 'Who?': prompt of" in result.output and "allowed: max_new_tokens at most" in result.output


@pytest.mark.parametrize("policy", [None, "h2o"])  # None: ask's defaults (kvzip, whose scoring pass ran first)
def test_compress_then_ask_refuses_a_hybrid_in_one_line_before_any_pass(policy, monkeypatch, tmp_path):
    """A hybrid's states move on with every token, so its context cannot be shared between questions: compress()
    refuses it before the scoring pass or the prefill runs, as does the ask command (one error line, exit 2)."""
    import sys

    from helpers.architectures import tiny_causal_lm
    from helpers.tiny_lm import english_tokenizer

    from h2o_compress import UnsupportedModelError

    ask_module = sys.modules["h2o_compress.runtime.ask"]

    def never(*args, **kwargs):
        raise AssertionError("a pass ran")

    monkeypatch.setattr(ask_module, "make_scored_cache", never)
    monkeypatch.setattr(ask_module, "extend_prompt", never)
    model, tokenizer = tiny_causal_lm("bamba"), english_tokenizer()
    config = None if policy is None else CompressionConfig(policy=policy, budget=0.5, kv_bits=4)
    with pytest.raises(UnsupportedModelError, match="compress-then-ask does not support model type 'bamba'") as error:
        compress(model, tokenizer, CONTEXT[:300], config, chat=False)
    assert "\n" not in str(error.value)
    import functools

    import h2o_compress.models

    @functools.wraps(h2o_compress.models.load_model)  # its signature: the CLI reads its defaults
    def loaded(*args, **kwargs):
        return model, tokenizer

    monkeypatch.setattr(h2o_compress.models, "load_model", loaded)
    flags = [] if policy is None else ["--policy", policy]
    document = tmp_path / "doc.txt"
    document.write_text(CONTEXT[:300])
    result = CliRunner().invoke(app, ["ask", "--no-chat", "--context-file", str(document), "--question", "Who?", *flags])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: compress-then-ask does not support model type 'bamba'")
    assert result.output.count("\n") == 1
