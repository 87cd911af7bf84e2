"""Head-adaptive budgets (``head_budgets="adaptive"``, Ada-KV): one layer's budget shared by its KV heads in one
slot pool that really frees what it evicts."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import TINY_MODELS, save_tiny_model_dir, tiny_llama
from helpers.decode_steps import PROMPT, STEPS, eager_and_compiled, run
from helpers.measured_caches import llama128, predicted, run_cache
from transformers import DynamicCache
from typer.testing import CliRunner

from h2o_compress.persistence import load_cache, save_cache
from h2o_compress import CompressionConfig, ConfigError, make_cache
from h2o_compress.cache import CompressedLayer
from h2o_compress.cli import app
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes


def adaptive(**fields) -> CompressionConfig:
    return CompressionConfig(head_budgets="adaptive", **fields)


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_budget_at_the_length_equals_dynamic_cache(arch):
    """16 bits, a capacity of the whole sequence: the pooled layer gives DynamicCache's logits (prefill + decode)."""
    model = TINY_MODELS[arch]()
    with torch.inference_mode():
        reference, _, _, _ = run(model, None, decode_step, cache=DynamicCache(config=model.config))
        ours, cache, _, _ = run(model, adaptive(budget=PROMPT + STEPS, attention_kernel="torch"), decode_step)
    assert all(layer.setting.head_adaptive for layer in cache.layers)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


# -- the allocation on a hand-made attention pattern ---------------------------------------------------------
N, C = 40, 10  # prompt tokens, capacity per head (heavy ratio 0.5: 5 heavy + 5 recent per head)


def pattern() -> torch.Tensor:
    """fp32 ``[1, 2, N]`` scores: head 0 spreads its attention over 12 old tokens, head 1 attends to 2."""
    scores = torch.full((1, 2, N), 0.01)
    scores[0, 0, :12] = torch.linspace(1.0, 0.5, 12)  # positions 0..11, decreasing
    scores[0, 1, 20] = 2.0
    scores[0, 1, 25] = 1.5
    scores[0, 1, :20] += torch.arange(20) * 1e-4  # distinct small scores elsewhere
    return scores


def prefill_with_pattern(head_budgets: str, bits: int = 16):
    """A kvzip cache whose prefill ranks by :func:`pattern` (kvzip takes given context scores as the prefill's)."""
    model = tiny_llama(layers=1)
    config = CompressionConfig(policy="kvzip", budget=C, kv_bits=bits, head_budgets=head_budgets)
    cache = make_cache(model, config, max_length=N + 8)
    cache.layers[0].setting.policy.context_scores = pattern()
    ids = torch.randint(0, 128, (1, N), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)
    return model, cache


def flat_top_reference() -> list[list[int]]:
    """By hand: each head keeps its 5 recent tokens (35..39); the 10 heavy places go to the 10 highest scores among
    the older tokens of both heads together (Ada-KV §3)."""
    scores = pattern()[0, :, : N - 5]
    order = sorted(((float(scores[h, p]), -p, h) for h in range(2) for p in range(N - 5)), reverse=True)[: 2 * C - 10]
    kept = [sorted({p for _, neg, h in order if h == head for p in [-neg]} | set(range(N - 5, N))) for head in range(2)]
    return kept


@pytest.mark.parametrize("bits", [16, 4])
def test_adaptive_gives_the_spread_head_more_tokens_and_keeps_the_flat_top(bits):
    _, uniform = prefill_with_pattern("uniform", bits)
    _, ours = prefill_with_pattern("adaptive", bits)
    kept = ours.layers[0].kept_per_head()[0].tolist()
    assert uniform.layers[0].kept_per_head()[0].tolist() == [C, C]
    assert kept[0] > C > kept[1] and sum(kept) == 2 * C  # head 0 (spread attention) got head 1's spare places
    reference = flat_top_reference()
    assert [len(r) for r in reference] == kept == [13, 7]
    positions = ours.layers[0].positions()[0]
    for head in range(2):
        held = positions[head][positions[head] >= 0].tolist()
        assert held == reference[head]


def test_decode_eviction_takes_the_lowest_over_every_head():
    """One decode step over a full layer: kv_heads tokens enter (one per head), so the two lowest-priority tokens of
    the layer leave, whichever heads hold them (ties: the newer), never a recent one."""
    model, cache = prefill_with_pattern("adaptive")
    layer = cache.layers[0]
    seen_before_eviction = {}
    evict = layer.evict

    def spy():
        positions = layer.store.head_positions().long()
        priority = layer.setting.policy.priority(layer.store.head_scores(), positions, layer.counters.seen, layer.counters.first_real, C)
        seen_before_eviction["held"] = [(float(priority[0, h, s]), -int(positions[0, h, s]), h, int(positions[0, h, s]))
                                        for h in range(2) for s in range(positions.shape[2]) if positions[0, h, s] >= 0]
        evict()

    layer.evict = spy
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), past_key_values=cache)
    layer.run_deferred_eviction()  # the step's eviction runs when the layer is read next (or at its next step)
    held = seen_before_eviction["held"]
    assert len(held) == 2 * C + 2
    expected = {(h, p) for _, _, h, p in sorted(held)[:2]}
    after = {(h, p) for h in range(2) for p in layer.positions()[0, h].tolist() if p >= 0}
    assert {(h, p) for *_, h, p in held} - after == expected
    assert {(0, N), (1, N)} <= after and len(after) == 2 * C
    assert all(p < N + 1 - 5 for _, p in expected)  # never the recent window (5 newest of N + 1 seen)


def test_memory_is_really_freed_and_counted_by_the_planner():
    """Per-head counts differ, yet the bytes are uniform's plus one int8 tag per pool slot, the planner's figure to
    the byte, and no tensor pins a larger storage."""
    _, uniform = prefill_with_pattern("uniform", 4)
    model, ours = prefill_with_pattern("adaptive", 4)
    layer = ours.layers[0]
    assert layer.store.slots == 2 * (C - layer.setting.residual + 1) and layer.store.owner.dtype == torch.int8
    assert ours.nbytes() == uniform.nbytes() + layer.store.slots
    assert ours.storage_nbytes() == ours.nbytes()
    config = ours.config
    planned = cache_bytes(model_dims(model.config), config, batch=1, prompt_len=N, max_length=N + 8,
                          kv_dtype=torch.float32)
    assert planned.total == ours.nbytes()
    full = cache_bytes(model_dims(model.config), CompressionConfig(policy="full"), batch=1, prompt_len=N,
                       max_length=N + 8, kv_dtype=torch.float32)
    assert planned.total < full.total / 3


@pytest.mark.parametrize("policy,bits,kernel", [("h2o", 4, "torch"), ("tova", 16, "torch"), ("h2o-mean", 8, "torch"),
                                                ("h2o", 4, "auto"), ("tova", 16, "auto"), ("vatp", 4, "auto")])
def test_compiled_decode_matches_eager(policy, bits, kernel):
    """``torch.compile(fullgraph=True)`` over the decode step (no graph break, no host read), buffers written in
    place, the eager logits, the layer at its budget on every step; the torch form and (``auto`` on the CPU) the
    native kernel."""
    from h2o_compress.attention import cpu

    model = tiny_llama()
    config = adaptive(policy=policy, budget=12, kv_bits=bits, residual=2, attention_kernel=kernel)
    eager, ours, cache, before, after, graphs = eager_and_compiled(model, config, "eager")
    assert graphs <= 2 and after == before
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)
    for layer in cache.layers:
        native = kernel == "auto" and cpu.library() is not None
        assert layer.setting.head_adaptive and (layer.backend.name == "cpu") == native
        assert layer.kept_per_head().sum(-1).tolist() == [2 * 12, 2 * 12]
    cache.check()


def test_batch_rows_keep_their_own_choice():
    """Each row of a left-padded batch keeps what it keeps alone (the padded row shifted by its 3 pads): no
    sequence keeps another's choice, and padding is never kept."""
    model = tiny_llama()
    config = adaptive(budget=12, kv_bits=4, residual=2)
    ids = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(7))  # run()'s prompt
    with torch.inference_mode():
        _, batched, _, _ = run(model, config, decode_step, batch=2, pads=(3, 0))
        for row, pad in ((0, 3), (1, 0)):
            alone = make_cache(model, config, max_length=PROMPT - pad + STEPS)
            logits = model(input_ids=ids[row : row + 1, pad:], past_key_values=alone).logits[:, -1]
            for _ in range(STEPS):
                logits = model(input_ids=logits.argmax(-1, keepdim=True), past_key_values=alone).logits[:, -1]
            for mine, theirs in zip(batched.layers, alone.layers):
                assert torch.equal(mine.kept_per_head()[row], theirs.kept_per_head()[0])
                kept = mine.positions()[row]
                assert torch.equal(torch.where(kept >= 0, kept - pad, -1), theirs.positions()[0])


def test_frozen_copy_and_save_load_roundtrip(tmp_path):
    model = tiny_llama()
    config = adaptive(budget=10, kv_bits=4)
    cache = make_cache(model, config, max_length=40)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(input_ids=ids[:, :30], past_key_values=cache)
        frozen = cache.frozen_copy(40)
        mine = {k: v.clone() for k, v in cache.layers[0].tensors().items()}
        out = model(input_ids=ids[:, 30:], past_key_values=frozen).logits
    assert torch.isfinite(out).all()
    assert all(layer.setting.head_adaptive and layer.setting.capacity is None for layer in frozen.layers)
    assert all(torch.equal(mine[k], v) for k, v in cache.layers[0].tensors().items())  # context not mutated
    assert torch.equal(frozen.layers[0].kept_per_head(), cache.layers[0].kept_per_head() + 10)
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors", model)
    assert loaded.layers[0].setting.head_adaptive and loaded.config.head_budgets == "adaptive"
    for a, b in zip(cache.layers, loaded.layers):
        assert torch.equal(a.positions(), b.positions())
        assert all(torch.equal(t, b.tensors()[k]) for k, t in a.tensors().items())
    with torch.inference_mode():
        token = ids[:, 30:31]
        torch.testing.assert_close(model(input_ids=token, past_key_values=loaded).logits,
                                   model(input_ids=token, past_key_values=cache).logits, atol=0, rtol=0)


def test_config_refuses_what_cannot_share():
    with pytest.raises(ConfigError, match="head_budgets='per-token' is not supported; allowed: uniform, adaptive"):
        CompressionConfig(head_budgets="per-token")
    with pytest.raises(ConfigError, match="policy='local'.*allowed policies: h2o, h2o-mean, snapkv, tova, a2sf, kvzip"):
        CompressionConfig(policy="local", budget=0.2, head_budgets="adaptive")
    with pytest.raises(ConfigError, match="attention_kernel='triton'"):
        CompressionConfig(budget=0.2, head_budgets="adaptive", attention_kernel="triton")
    assert CompressionConfig(policy="full", head_budgets="adaptive").capacity(10) is None  # nothing to share
    pyramid = CompressionConfig(budget=20, head_budgets="adaptive", layer_budgets="pyramid")
    layers = make_cache(tiny_llama(layers=4), pyramid, max_length=80).layers
    assert all(layer.setting.head_adaptive for layer in layers)
    assert [layer.setting.capacity for layer in layers] == pyramid.layer_capacities(20, 4)
    unbounded = make_cache(tiny_llama(), adaptive(budget=1.0), max_length=80).layers
    assert all(type(layer) is CompressedLayer for layer in unbounded)


runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def test_cli_flag_and_config_file_reach_the_cache(tiny_dir, tmp_path):
    figures = {}
    for mode in ("uniform", "adaptive"):
        result = runner.invoke(app, [
            "generate", "--model", tiny_dir, "--no-chat", "--budget", "0.5", "--kv-bits", "4", "--max-new-tokens",
            "12", "--head-budgets", mode, "--json", " ".join(f"w{i}" for i in range(20)),
        ])
        assert result.exit_code == 0, result.output
        figures[mode] = json.loads(result.stdout)
    # capacity 16, residual 3: a pool of 2 x 14 slots per layer, one int8 tag each, 2 layers
    assert figures["adaptive"]["kv_bytes"] - figures["uniform"]["kv_bytes"] == 2 * 2 * 14
    settings = tmp_path / "adaptive.json"
    settings.write_text(json.dumps({"head_budgets": "adaptive", "budget": 0.5, "kv_bits": 4}))
    from_file = runner.invoke(app, ["generate", "--model", tiny_dir, "--no-chat", "--max-new-tokens", "12", "--config",
                                    str(settings), "--json", " ".join(f"w{i}" for i in range(20))])
    assert from_file.exit_code == 0, from_file.output
    assert json.loads(from_file.stdout)["kv_bytes"] == figures["adaptive"]["kv_bytes"]
    bad = runner.invoke(app, ["generate", "--head-budgets", "fancy", "hello"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert bad.output.strip() == "error: head_budgets='fancy' is not supported; allowed: uniform, adaptive"


ADAPTIVE_CASES = [  # policy, budget, k_bits, v_bits, group, residual, batch, prompt, new (as test_planner.CASES)
    ("h2o", 0.5, 16, 16, 32, 4, 2, 30, 10),
    ("h2o", 0.3, 4, 4, 32, 4, 1, 30, 12),
    ("h2o-mean", 12, 8, 4, 64, 2, 2, 25, 20),
    ("tova", 0.4, 8, 8, 128, 8, 3, 33, 17),
    ("snapkv", 0.3, 4, 4, 64, 0, 1, 40, 10),
    ("kvzip", 0.5, 16, 16, 32, 4, 2, 30, 8),
]


@pytest.mark.parametrize("case", ADAPTIVE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_planner_counts_the_pool_to_the_byte(case):
    policy, budget, kb, vb, group, residual, batch, prompt, new = case
    config = adaptive(policy=policy, budget=budget, k_bits=kb, v_bits=vb, group_size=group, residual=residual)
    model = llama128()
    with torch.inference_mode():
        cache = run_cache(model, config, batch, prompt, new)
    guess = predicted(model, config, batch, prompt, new)
    layer = cache.layers[0]
    assert layer.setting.head_adaptive
    assert guess.total == cache.nbytes() == cache.storage_nbytes()
    assert guess.slots == layer.store.slots == 2 * (layer.setting.capacity - layer.setting.residual + 1)
    held = torch.stack([layer.kept_per_head().sum(-1) for layer in cache.layers])
    assert bool((held == 2 * min(layer.setting.capacity, prompt + new - 1)).all())  # every sequence at its layer budget


def test_compress_then_ask_keeps_the_flat_top_of_the_reconstruction_scores():
    """``h2o_compress.compress`` with kvzip: each layer keeps, over both heads together, the tokens the
    reconstruction attends most (plus each head's recent window); asking twice gives the same answer and leaves the
    compressed context as it was."""
    from helpers.tiny_lm import tiny_lm

    from h2o_compress import ask, compress
    from h2o_compress.runtime.context_scores import reconstruction_scores
    from h2o_compress.runtime.generation import encode_prompt
    from h2o_compress.evaluation import default_corpus

    text = default_corpus()[:400]
    model, tokenizer = tiny_lm()
    config = adaptive(policy="kvzip", budget=0.25, heavy_ratio=0.9, kv_bits=16)
    context = compress(model, tokenizer, text, config, chat=False)
    ids = encode_prompt(tokenizer, text, False)
    scores = reconstruction_scores(model, tokenizer, ids)
    capacity = context.cache.capacity
    heavy = context.cache.layers[0].setting.policy.heavy(capacity)
    recent = set(range(ids.shape[1] - (capacity - heavy), ids.shape[1]))
    spread = []
    for layer, layer_scores in zip(context.cache.layers, scores):
        assert layer.setting.head_adaptive
        ranked = sorted(((float(layer_scores[0, h, p]), -p, -h) for h in range(2) for p in range(ids.shape[1])
                         if p not in recent), reverse=True)[: 2 * heavy]
        kept = layer.positions()[0]
        for head in range(2):
            assert set(kept[head][kept[head] >= 0].tolist()) == {-p for _, p, h in ranked if -h == head} | recent
        spread.append(layer.kept_per_head()[0].tolist())
    assert any(a != b for a, b in spread)  # the heads of some layer really hold different counts
    before = {(i, k): v.clone() for i, layer in enumerate(context.cache.layers) for k, v in layer.tensors().items()}
    first = ask(model, tokenizer, context, "Who?", max_new_tokens=4)
    again = ask(model, tokenizer, context, "Who?", max_new_tokens=4)
    assert first.text == again.text
    after = {(i, k): v for i, layer in enumerate(context.cache.layers) for k, v in layer.tensors().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)



def test_plan_and_profile_sweep_take_the_head_budgets():
    from h2o_compress.planner import candidates, describe
    from h2o_compress.profiling.sweep import ProfileSettings, label

    grid = candidates(64, policies=("h2o",), budgets=(1.0, 0.2), bits=(4,), group_sizes=(32,), head_budgets="adaptive")
    assert [c.head_budgets for c in grid] == ["uniform", "adaptive"]  # budget 1.0 keeps everything: nothing to share
    assert describe(grid[1]) == "h2o 20% adaptive heads int4 g32 r3" and describe(grid[0]) == "full int4 g32 r3"
    configs = ProfileSettings(policies=("tova",), budgets=(1.0, 0.1), kv_bits=(4,), head_budgets="adaptive").configs()
    assert [c.head_budgets for c in configs] == ["uniform", "uniform", "adaptive"]
    assert label(configs[-1]) == "tova 0.1 adaptive heads 4-bit"
    with pytest.raises(ConfigError, match="policy='sink'"):
        ProfileSettings(policies=("sink",), budgets=(0.1,), kv_bits=(4,), head_budgets="adaptive").configs()


def test_reorder_and_select_move_the_head_tags_with_their_tokens():
    model = tiny_llama()
    cache = make_cache(model, adaptive(budget=8, kv_bits=4), max_length=30)
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # buffers reordered outside the forward pass: not inference tensors
        model(input_ids=ids, past_key_values=cache)
    layer = cache.layers[0]
    before = [(layer.positions()[row].clone(), layer.kept_per_head()[row].clone()) for row in range(2)]
    pointers = {k: v.data_ptr() for k, v in layer.tensors().items()}
    cache.reorder_cache(torch.tensor([1, 0]))
    assert {k: v.data_ptr() for k, v in layer.tensors().items()} == pointers  # in place
    for row, (positions, kept) in zip((1, 0), before):
        assert torch.equal(layer.positions()[row], positions) and torch.equal(layer.kept_per_head()[row], kept)
    cache.batch_select_indices(torch.tensor([0]))
    assert layer.store.owner.shape[0] == 1 and torch.equal(layer.positions()[0], before[1][0])
