"""Mixed precision by importance (``high_bits_fraction``): the top-ranked stored tokens at 8 bits, the rest at 4.

The split 8-bit code (:class:`~h2o_compress.formats.split.SplitIntQuantizer`) and its error bounds; the side buffer
of low planes (:class:`~h2o_compress.cache.refinement.RefinedPlanes`) on hand-made rankings; a tiny model's logits
between int4's and int8's; bytes equal to the planner's; the compiled decode step, save/load, frozen copies, batch
selection; the config's and the CLI's errors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import tiny_llama
from typer.testing import CliRunner

from h2o_compress.persistence import save_cache, load_cache
from h2o_compress import CompressedCache, CompressionConfig, ConfigError, make_cache
from h2o_compress.cache import CompressedLayer
from h2o_compress.cache.refinement import RefinedPlanes
from h2o_compress.cli import app
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.formats import IntQuantizer
from h2o_compress.formats.split import SplitIntQuantizer
from h2o_compress.models import model_dims
from h2o_compress.planner import cache_bytes

PROMPT, STEPS, CAPACITY = 20, 24, 12


def setting(fraction: float, bits: int = 4, policy: str = "h2o", **kw) -> CompressionConfig:
    return CompressionConfig(policy=policy, budget=CAPACITY, kv_bits=bits, residual=2, high_bits_fraction=fraction, **kw)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@torch.inference_mode()
def run(model, config, step=decode_step, batch=2, pads=(3, 0), steps=STEPS, cache=None):
    """Prefill a left-padded prompt, then ``steps`` teacher-forced decode steps (the same tokens for every
    config). Returns (logits ``[steps + 1, batch, vocab]``, cache)."""
    ids = torch.randint(0, 128, (batch, PROMPT + steps), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(batch, PROMPT, dtype=torch.long)
    for row, pad in enumerate(pads[:batch]):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = make_cache(model, config, max_length=PROMPT + steps) if cache is None else cache
    out = [model(input_ids=ids[:, :PROMPT], attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]]
    position = positions[:, -1:]
    for t in range(PROMPT, PROMPT + steps):
        mask = torch.cat((mask, torch.ones(batch, 1, dtype=torch.long)), 1)
        position = position + 1
        out.append(step(model, ids[:, t : t + 1], cache, position, mask))
    return torch.stack(out), cache


# -- the split code ------------------------------------------------------------------------------------------
def test_split_code_error_bounds():
    """High plane alone: within 8 x s of the input (the bucket centre; s = (max - min) / 255 per group), below
    plain int4's (max - min) / 30. With the low plane: int8's bound, s / 2 (plus fp16 rounding)."""
    x = torch.randn(2, 3, 50, 64) * torch.linspace(0.1, 5, 64)
    split, plain4 = SplitIntQuantizer(32, 64, rotate=False), IntQuantizer(4, 32, 64, rotate=False)
    stored, low = split.quantize_split(x)
    assert {k: (v.shape, v.dtype) for k, v in stored.parts.items()} == \
        {k: (v.shape, v.dtype) for k, v in plain4.quantize(x).parts.items()}  # the int4 layout, byte for byte
    groups = x.unflatten(-1, (2, 32))
    s = ((groups.amax(-1) - groups.amin(-1)) / 255).repeat_interleave(32, -1)
    high_only = split.dequantize(stored, torch.float32)
    tolerance = 1e-3 * x.abs().amax()
    assert bool(((high_only - x).abs() <= 8 * s + tolerance).all())
    assert bool(((high_only - x).abs() <= 255 * s / 30 + tolerance).all())
    full = high_only + split.correction(low, stored.parts["scale_zero"])
    assert bool(((full - x).abs() <= s / 2 + tolerance).all())
    int8 = IntQuantizer(8, 32, 64, rotate=False)
    err8 = (int8.dequantize(int8.quantize(x), torch.float32) - x).abs().mean()
    assert (full - x).abs().mean() <= 1.05 * err8
    assert (high_only - x).abs().mean() > 8 * err8  # the low plane matters


# -- the side buffer on hand-made rankings --------------------------------------------------------------------
def test_prefill_refines_the_top_ranked_and_decode_demotes_the_lowest():
    split = SplitIntQuantizer(32, 32, rotate=False)
    x = torch.randn(1, 1, 6, 32)
    stored, low = split.quantize_split(x)
    planes = RefinedPlanes(2, 1, 1, 32, ("keys",), "cpu")
    positions = torch.tensor([[[0, 1, 2, 3, -1, -1]]], dtype=torch.int32)
    rank = torch.tensor([[[0.1, 0.9, 0.5, 0.7, 0.0, 0.0]]])
    placed = tuple(t.flatten() for t in (torch.zeros(4, dtype=torch.long),) * 2) + (torch.arange(4), torch.arange(4))
    planes.admit_many(torch.zeros(1, 1, 2, dtype=torch.bool), placed, {"keys": low}, rank, positions)
    assert sorted(planes.slots.flatten().tolist()) == [1, 3]  # the two highest ranks

    def read():
        out = split.dequantize(stored, torch.float32)
        planes.correct(out, "keys", split, stored.parts["scale_zero"], positions)
        return out

    high_only = split.dequantize(stored, torch.float32)
    eight = high_only + split.correction(low, stored.parts["scale_zero"])
    out = read()
    assert torch.equal(out[..., [1, 3], :], eight[..., [1, 3], :])
    assert torch.equal(out[..., [0, 2], :], high_only[..., [0, 2], :])
    # decode: slot 4 enters ranked 0.8: the lowest refined (slot 3, 0.7) loses its low plane
    positions[..., 4] = 4
    rank[..., 4] = 0.8
    planes.admit_one(torch.tensor([[[4]]]), {"keys": low[:, :, 4:5]}, rank, positions)
    assert sorted(planes.slots.flatten().tolist()) == [1, 4]
    out = read()
    assert torch.equal(out[..., 3, :], high_only[..., 3, :])  # demoted: its high plane's reading, nothing else
    assert torch.equal(out[..., [1, 4], :], eight[..., [1, 4], :])
    # a lower-ranked newcomer (slot 5, 0.2) stays at 4 bits; evicting slot 1 frees its row for the next one
    positions[..., 5], rank[..., 5] = 5, 0.2
    planes.admit_one(torch.tensor([[[5]]]), {"keys": low[:, :, 5:6]}, rank, positions)
    assert sorted(planes.slots.flatten().tolist()) == [1, 4]
    positions[..., 1] = -1
    assert planes.in_use(positions).tolist() == [[[True, False]]] or planes.in_use(positions).tolist() == [[[False, True]]]
    positions[..., 1], rank[..., 1] = 6, 0.05  # slot 1 reused by a new, low-ranked token: it takes the free row
    planes.admit_one(torch.tensor([[[1]]]), {"keys": low[:, :, 1:2]}, rank, positions)
    assert sorted(planes.slots.flatten().tolist()) == [1, 4] and bool(planes.in_use(positions).all())


def test_refined_tokens_after_prefill_are_the_policy_top(model):
    config = CompressionConfig(policy="h2o", budget=30, kv_bits=4, residual=2, high_bits_fraction=0.25)
    cache = make_cache(model, config, max_length=40)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1)), past_key_values=cache)
    for layer in cache.layers:
        assert layer.setting.high_bits_fraction > 0
        rows = layer.store.refine.slots.shape[2]
        assert rows == math.ceil(0.25 * layer.store.slots)
        scores = layer.store.scores.masked_fill(layer.store.positions < 0, float("-inf"))
        top = scores.topk(rows, -1).indices.sort(-1).values
        assert torch.equal(layer.store.refine.slots.long().sort(-1).values, top)


# -- quality ------------------------------------------------------------------------------------------------
def logit_error(model, config, reference):
    logits, _ = run(model, config)
    return (logits - reference).abs().mean().item()


def test_fraction_zero_is_todays_int4_and_one_is_int8_quality(model):
    reference, _ = run(model, CompressionConfig(policy="h2o", budget=CAPACITY, residual=2))
    int4, plain = run(model, setting(0.0))
    off, cache = run(model, CompressionConfig(policy="h2o", budget=CAPACITY, kv_bits=4, residual=2))
    assert type(plain.layers[0]) is CompressedLayer and torch.equal(int4, off)
    err = {f: logit_error(model, setting(f), reference) for f in (0.0, 0.25, 0.5, 1.0)}
    err8 = logit_error(model, setting(0.0, bits=8), reference)
    assert err[1.0] <= 1.5 * err8 and err[1.0] < 0.3 * err[0.0]
    assert err[0.5] < err[0.0] and err[0.25] <= 1.1 * err[0.0]  # bounded, and better as f grows


# -- bytes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction,bits", [(0.25, (4, 4)), (0.5, (4, 8)), (1.0, (4, 4)), (0.5, (16, 4))])
def test_nbytes_equal_the_planner_and_grow_as_the_formula(model, fraction, bits):
    kb, vb = bits
    config = CompressionConfig(policy="tova", budget=CAPACITY, k_bits=kb, v_bits=vb, residual=2, high_bits_fraction=fraction)
    _, cache = run(model, config)
    dims = model_dims(model.config)
    assert cache_bytes(dims, config, 2, PROMPT, STEPS, max_length=PROMPT + STEPS, kv_dtype=torch.float32).total == cache.nbytes()
    _, plain = run(model, CompressionConfig(policy="tova", budget=CAPACITY, k_bits=kb, v_bits=vb, residual=2))
    layer = cache.layers[0]
    rows = math.ceil(fraction * layer.store.slots)
    split = (kb == 4) + (vb == 4)
    per_row = 4 + split * layer.geometry.head_dim // 2  # int32 slot index + the low planes (two 4-bit codes a byte)
    assert cache.nbytes() - plain.nbytes() == dims.num_layers * 2 * dims.kv_heads * rows * per_row


# -- the decode step, persistence, copies, batches --------------------------------------------------------------
@pytest.mark.parametrize("policy,heads", [("h2o", "uniform"), ("tova", "uniform"), ("sink", "uniform"),
                                          ("h2o", "adaptive"), ("tova", "adaptive")])
def test_compiled_decode_matches_eager(model, policy, heads):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(decode_step, fullgraph=True, backend=counter)
    config = setting(0.5, policy=policy, head_budgets=heads)
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        eager, _ = run(model, config)
        ours, cache = run(model, config, step=compiled)
    assert counter.frame_count <= 2
    assert not any((layer.backend.name == "cpu") or (layer.backend.name == "triton") for layer in cache.layers)
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)
    assert cache.kept_length() == CAPACITY


def test_save_load_round_trip_continues_identically(model, tmp_path):
    config = setting(0.5)
    _, cache = run(model, config, steps=6)
    path = save_cache(cache, tmp_path / "mixed.safetensors", model=model)
    loaded = load_cache(path, model)
    assert loaded.config == config and loaded.nbytes() == cache.nbytes()
    for a, b in zip(cache.layers, loaded.layers):
        assert a.tensors().keys() == b.tensors().keys()
        assert all(torch.equal(t, b.tensors()[k]) for k, t in a.tensors().items())
    token = torch.randint(0, 128, (2, 1))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=token, past_key_values=cache).logits,
                           model(input_ids=token, past_key_values=loaded).logits)


def test_frozen_copy_keeps_the_refined_tokens_and_leaves_the_context_alone(model):
    _, cache = run(model, setting(0.5), steps=6, batch=1)
    before = {(i, k): t.clone() for i, layer in enumerate(cache.layers) for k, t in layer.tensors().items()}
    frozen = cache.frozen_copy(PROMPT + 6 + 5)
    for layer, copy in zip(cache.layers, frozen.layers):
        rows = layer.store.refine.slots.shape[2]
        assert copy.setting.high_bits_fraction > 0
        assert torch.equal(copy.store.refine.slots[..., :rows], layer.store.refine.slots)
        assert torch.equal(copy.store.refine.low["keys"][..., :rows, :], layer.store.refine.low["keys"])
    with torch.inference_mode():
        for t in range(5):
            model(input_ids=torch.tensor([[t + 1]]), past_key_values=frozen)
    assert all(torch.equal(t, before[(i, k)]) for i, layer in enumerate(cache.layers) for k, t in layer.tensors().items())
    assert frozen.kept_length() == cache.kept_length() + 5


@torch.inference_mode()
def test_batch_selection_moves_the_side_buffer(model):
    _, cache = run(model, setting(0.5), steps=4)
    slots = [layer.store.refine.slots[1].clone() for layer in cache.layers]
    low = [layer.store.refine.low["values"][1].clone() for layer in cache.layers]
    cache.reorder_cache(torch.tensor([1, 0]))  # in place (same batch)
    assert all(torch.equal(layer.store.refine.slots[0], s) for layer, s in zip(cache.layers, slots))
    cache.batch_select_indices(torch.tensor([0]))
    assert all(torch.equal(layer.store.refine.slots[0], s) for layer, s in zip(cache.layers, slots))
    assert all(torch.equal(layer.store.refine.low["values"][0], v) for layer, v in zip(cache.layers, low))
    assert cache.layers[0].store.refine.slots.shape[0] == 1


# -- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"high_bits_fraction": 1.5, "kv_bits": 4}, "high_bits_fraction=1.5 is out of range; allowed: [0, 1]"),
    ({"high_bits_fraction": -0.1, "kv_bits": 4}, "high_bits_fraction=-0.1 is out of range"),
    ({"high_bits_fraction": "half", "kv_bits": 4}, "high_bits_fraction='half' is not a number"),
    ({"high_bits_fraction": float("nan"), "kv_bits": 4}, "is not finite"),
    ({"high_bits_fraction": 0.5, "kv_bits": 8}, "keys are 8-bit and values 8-bit"),
    ({"high_bits_fraction": 0.5, "kv_bits": 4, "quant": "nf4"}, "quant='nf4'"),
    ({"high_bits_fraction": 0.5, "kv_bits": 4, "attention_kernel": "triton"}, "attention_kernel 'auto' or 'torch'"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        CompressionConfig(**kwargs)


def test_an_unbounded_cache_of_unknown_length_is_refused(model):
    with pytest.raises(ConfigError, match="needs a cache of known length"):
        make_cache(model, CompressionConfig(kv_bits=4, high_bits_fraction=0.5))


runner = CliRunner()


@pytest.mark.parametrize("args,message", [
    (["--kv-bits", "4", "--high-bits-fraction", "2"], "error: high_bits_fraction=2.0 is out of range"),
    (["--high-bits-fraction", "0.5"], "error: high_bits_fraction=0.5 keeps some 4-bit tokens at 8 bits"),
])
def test_cli_errors_are_one_line(args, message):
    result = runner.invoke(app, ["generate", *args, "hello"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_damaged_slot_index_is_refused_on_load(model, tmp_path):
    from safetensors.torch import load_file

    from h2o_compress.utils.errors import CacheFileError
    from h2o_compress.persistence.cache_state import _check_layer_values

    _, cache = run(model, setting(0.5), steps=3)
    path = save_cache(cache, tmp_path / "mixed.safetensors", model=model)
    saved = {k.removeprefix("layers.0."): v for k, v in load_file(path).items() if k.startswith("layers.0.")}
    seen = int(cache.layers[0].counters.seen)
    _check_layer_values(saved, 0, seen, cache.layers[0])  # as saved: fine
    for rows, message in (([cache.layers[0].store.slots, -1], "refine.slots outside"), ([0, 0], "name the same slot")):
        damaged = dict(saved, **{"refine.slots": saved["refine.slots"].clone()})
        damaged["refine.slots"][0, 0, :2] = torch.tensor(rows)
        with pytest.raises(CacheFileError, match=message):
            _check_layer_values(damaged, 0, seen, cache.layers[0])


def test_cli_plan_counts_the_8bit_tokens():
    import json

    args = ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--bits", "4", "--budgets", "0.25", "--json"]
    rows = {}
    for fraction in ("0", "0.5"):
        result = runner.invoke(app, [*args, "--high-bits-fraction", fraction])
        assert result.exit_code == 0, result.output
        rows[fraction] = json.loads(result.output)["rows"][0]
    assert "hi8 50%" in rows["0.5"]["label"] and "hi8" not in rows["0"]["label"]
    assert rows["0.5"]["cache"]["packed"] > rows["0"]["cache"]["packed"]
    bad = runner.invoke(app, ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--high-bits-fraction", "7"])
    assert bad.exit_code == 2 and "error: high_bits_fraction=7.0 is out of range" in bad.output


def test_cli_generate_flag_reaches_the_cache(tmp_path):
    import json

    from conftest import save_tiny_model_dir
    from h2o_compress.planner import cache_bytes

    directory = save_tiny_model_dir(tmp_path / "tiny")
    args = ["generate", "--model", directory, "--no-chat", "--budget", "0.5", "--kv-bits", "4", "--max-new-tokens",
            "6", "--json", " ".join(f"w{i}" for i in range(20))]
    figures = {}
    for fraction in ("0", "0.5"):
        result = runner.invoke(app, [*args, "--high-bits-fraction", fraction])
        assert result.exit_code == 0, result.output
        figures[fraction] = json.loads(result.stdout)
    dims = model_dims(tiny_llama().config)
    config = CompressionConfig(budget=0.5, kv_bits=4, high_bits_fraction=0.5)
    assert figures["0.5"]["kv_bytes"] == cache_bytes(dims, config, 1, 20, 5, kv_dtype=torch.float32).total
    assert figures["0.5"]["kv_bytes"] > figures["0"]["kv_bytes"]


@torch.inference_mode()
def chunked_logits(model, config, chunk=4, length=44):
    """Read ``length`` tokens in chunks of ``chunk`` (held tokens dequantized at each chunk: the eager path);
    checks after every chunk that the 8-bit rows name distinct held slots. Returns the logits of every token."""
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(5))
    cache = make_cache(model, config, max_length=length)
    out = []
    for start in range(0, length, chunk):
        out.append(model(input_ids=ids[:, start : start + chunk], past_key_values=cache).logits)
        for layer in cache.layers if isinstance(cache, CompressedCache) else ():
            if layer.setting.high_bits_fraction > 0:
                used = layer.store.refine.in_use(layer.store.positions)
                slots = layer.store.refine.slots.long().masked_fill(~used, -1).sort(-1).values
                assert not bool(((slots[..., 1:] == slots[..., :-1]) & (slots[..., 1:] >= 0)).any())
                assert int(used.sum(-1).max()) <= layer.store.refine.slots.shape[2]
    return torch.cat(out, 1)


def test_chunked_reads_get_the_8bit_values_back(model):
    """Chunks after the first read the held tokens through the eager path: with every token refined (F = 1) the
    logits are as close to 16-bit as an 8-bit cache's, far closer than int4's."""
    reference = chunked_logits(model, CompressionConfig(policy="h2o", budget=16, residual=2))
    err = {name: (chunked_logits(model, CompressionConfig(policy="h2o", budget=16, residual=2, **kw)) - reference)
           .abs().mean().item()
           for name, kw in {"int8": {"kv_bits": 8}, "int4": {"kv_bits": 4},
                            "mixed1": {"kv_bits": 4, "high_bits_fraction": 1.0},
                            "mixed05": {"kv_bits": 4, "high_bits_fraction": 0.5}}.items()}
    assert err["mixed1"] <= 1.5 * err["int8"] and err["mixed1"] < 0.3 * err["int4"]
    assert err["mixed05"] < err["int4"]


def test_pyramid_layer_budgets_count_each_layer(model):
    config = CompressionConfig(policy="h2o", budget=0.5, kv_bits=4, residual=2, high_bits_fraction=0.5,
                               layer_budgets="pyramid")
    _, cache = run(model, config)
    assert len({layer.store.refine.slots.shape[2] for layer in cache.layers}) == 2  # each layer its share of its slots
    dims = model_dims(model.config)
    assert cache_bytes(dims, config, 2, PROMPT, STEPS, max_length=PROMPT + STEPS, kv_dtype=torch.float32).total == cache.nbytes()


@pytest.mark.parametrize("policy,heads", [("h2o", "uniform"), ("tova", "uniform"), ("h2o", "adaptive")])
@torch.inference_mode()
def test_fraction_one_keeps_every_held_token_at_8_bits(model, policy, heads):
    """Token by token from the first token (every step a decode step), with evictions: at F = 1 each held token
    keeps its low plane at every step (a row per slot; an evicted token's row is free for the next; a head-adaptive
    pool admits its kv_heads entering tokens one after the other)."""
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = make_cache(model, CompressionConfig(policy=policy, budget=0.25, kv_bits=4, high_bits_fraction=1.0,
                                                head_budgets=heads), max_length=40)
    for t in range(40):
        model(input_ids=ids[:, t : t + 1], past_key_values=cache)
        for layer in cache.layers:
            held = (layer.store.positions >= 0).sum(-1)
            assert torch.equal(layer.store.refine.in_use(layer.store.positions).sum(-1), held)
    assert int(cache.layers[0].counters.seen) == 40 and cache.kept_length() == 10


@pytest.mark.parametrize("policy,heads", [("h2o-mean", "uniform"), ("kvzip", "uniform"), ("kvzip", "adaptive")])
def test_compress_then_ask_twice_gives_the_same_answer(tmp_path, policy, heads):
    from conftest import save_tiny_model_dir

    from h2o_compress import load_model
    from h2o_compress.runtime.ask import ask, compress

    model, tokenizer = load_model(save_tiny_model_dir(tmp_path / "tiny"), device="cpu")
    config = CompressionConfig(policy=policy, budget=0.3, kv_bits=4, high_bits_fraction=0.5, head_budgets=heads)
    context = compress(model, tokenizer, " ".join(f"w{i % 100}" for i in range(80)), config, chat=False)
    assert all(layer.setting.high_bits_fraction > 0 for layer in context.cache.layers)
    before = {k: t.clone() for k, t in context.cache.layers[0].tensors().items()}
    first, second = (ask(model, tokenizer, context, "w1 w2", max_new_tokens=5) for _ in range(2))
    assert first.text == second.text
    assert all(torch.equal(t, before[k]) for k, t in context.cache.layers[0].tensors().items())


# -- on a head-adaptive layer (head_budgets="adaptive") ----------------------------------------------------------
def test_head_adaptive_layers_share_the_8bit_rows_and_the_planner_counts_them(model):
    """One row table per sequence over the whole pool: kv_heads x ceil(F x slots per head) rows (uniform's count),
    each an int32 slot index plus the low planes; the bytes equal the planner's."""
    config = setting(0.5, head_budgets="adaptive")
    _, cache = run(model, config)
    _, plain = run(model, CompressionConfig(policy="h2o", budget=CAPACITY, kv_bits=4, residual=2, head_budgets="adaptive"))
    layer, dims = cache.layers[0], model_dims(model.config)
    assert (layer.setting.head_adaptive and layer.store.refine is not None) and layer.store.refine.slots.shape[1] == 1
    assert layer.store.slots == dims.kv_heads * (CAPACITY - 2 + 1)  # the pool: kv_heads x the uniform slots
    rows = dims.kv_heads * math.ceil(0.5 * (CAPACITY - 2 + 1))
    assert layer.store.refine.slots.shape[2] == rows
    assert cache.nbytes() - plain.nbytes() == dims.num_layers * 2 * rows * (4 + 2 * layer.geometry.head_dim // 2)
    assert cache_bytes(dims, config, 2, PROMPT, STEPS, max_length=PROMPT + STEPS, kv_dtype=torch.float32).total == cache.nbytes()
    held = layer.store.refine.in_use(layer.store.positions)
    assert int(held.sum()) > 0 and bool((layer.store.owner.gather(2, layer.store.refine.slots.long().clamp(min=0))[held]
                                          < dims.kv_heads).all())


def test_head_adaptive_quality_sits_between_int4_and_int8(model):
    reference, _ = run(model, CompressionConfig(policy="h2o", budget=CAPACITY, residual=2, head_budgets="adaptive"))
    err = {f: logit_error(model, setting(f, head_budgets="adaptive"), reference) for f in (0.0, 0.5, 1.0)}
    err8 = logit_error(model, setting(0.0, bits=8, head_budgets="adaptive"), reference)
    assert err[1.0] <= 1.5 * err8 and err[1.0] < 0.3 * err[0.0]
    assert err[0.5] < err[0.0]


def test_spread_rows_keep_the_uniform_total_within_each_layer():
    """Global layer budgets: each layer's 8-bit rows near its share, never above its slots, summing to the uniform
    layers' count (what the planner counts)."""
    import random

    from h2o_compress.cache.refinement import spread_refined_rows

    rng = random.Random(0)
    for _ in range(300):
        layers, uniform = rng.randint(1, 8), rng.randint(1, 60)
        fraction = rng.choice([0.1, 0.25, 0.3, 0.5, 0.9, 1.0])
        slots = [rng.randint(1, 2 * uniform) for _ in range(layers - 1)]
        slots.append(layers * uniform - sum(slots))
        if slots[-1] < 1:
            continue
        rows = spread_refined_rows(slots, fraction, uniform)
        assert sum(rows) == layers * math.ceil(fraction * uniform), (slots, fraction, rows)
        assert all(0 <= r <= s and abs(r - fraction * s) < 2 + layers for r, s in zip(rows, slots))
    assert spread_refined_rows([10, 30, 20], 0.5, 20) == [5, 15, 10]
