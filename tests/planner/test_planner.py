"""Memory planner: predicted cache bytes equal measured ``cache.nbytes()``; known-model figures by hand; CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_llama, tiny_neox, tiny_opt
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers.measured_caches import llama128, predicted, run_cache
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, ConfigError, ModelLoadError, generate, make_cache
from h2o_compress.cli import app
from h2o_compress.policies import POLICIES
from h2o_compress.planner.known_models import _key, known_models, resolve_model
from h2o_compress.models import model_dims
from h2o_compress.planner import (
    cache_bytes, candidates, choose, choose_for_prompt, describe, load_quality, parse_memory, plan, weight_bytes,
)

GiB, KiB = 2**30, 2**10


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- measured == predicted on tiny random models ------------------------------------------------------------------

CASES = [  # policy, budget, k_bits, v_bits, group, residual, batch, prompt, new
    ("full", 1.0, 16, 16, 32, 4, 1, 20, 6),
    ("h2o", 1.0, 16, 16, 32, 4, 2, 20, 6),  # no eviction but scores are held
    ("h2o", 0.5, 16, 16, 32, 4, 2, 30, 10),
    ("h2o", 0.3, 4, 4, 32, 4, 1, 30, 12),
    ("h2o", 0.3, 4, 4, 128, 8, 3, 33, 17),
    ("h2o", 12, 8, 8, 64, 2, 2, 25, 20),
    ("h2o", 0.5, 8, 4, 64, 4, 2, 21, 9),
    ("h2o", 0.5, 16, 4, 32, 4, 1, 21, 9),  # 16-bit keys stored in the residual dtype
    ("local", 7, 4, 4, 32, 4, 1, 9, 15),  # window = whole capacity, never quantized
    ("local", 0.25, 4, 4, 32, 0, 2, 40, 8),  # residual 0: everything quantized
    ("sink", 16, 4, 4, 64, 4, 2, 12, 25),
    ("sink", 0.5, 8, 8, 32, 16, 1, 10, 30),  # prompt shorter than the window
    ("full", 1.0, 4, 4, 128, 8, 2, 3, 40),
    ("full", 1.0, 8, 8, 32, 8, 1, 50, 1),  # prefill only
    ("h2o-mean", 0.3, 4, 4, 32, 4, 2, 30, 12),
    ("snapkv", 0.3, 4, 4, 64, 4, 1, 40, 10),
    ("tova", 0.4, 8, 4, 32, 2, 2, 25, 15),
    ("strided", 0.3, 4, 4, 32, 4, 1, 40, 10),
    ("kvzip", 0.5, 16, 16, 32, 4, 2, 30, 8),
    ("lookahead", 0.4, 4, 4, 32, 4, 2, 30, 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_predicted_cache_bytes_equal_measured_llama(case):
    policy, budget, kb, vb, group, residual, batch, prompt, new = case
    config = CompressionConfig(policy=policy, budget=budget, kv_bits=kb, k_bits=kb, v_bits=vb,
                               group_size=group, residual=residual)
    model = llama128()
    cache = run_cache(model, config, batch, prompt, new)
    guess = predicted(model, config, batch, prompt, new)
    assert guess.total == cache.nbytes()
    assert guess.kept == cache.kept_length()
    assert guess.residual == cache.layers[0].setting.residual
    assert guess.slots == cache.layers[0].store.slots


@pytest.mark.parametrize("arch", ["opt", "neox"])
@pytest.mark.parametrize("budget,bits", [(1.0, 16), (0.4, 4), (0.4, 8)])
def test_predicted_cache_bytes_equal_measured_other_architectures(arch, budget, bits):
    model = {"opt": tiny_opt, "neox": tiny_neox}[arch]()
    config = CompressionConfig(policy="h2o", budget=budget, kv_bits=bits, group_size=32, residual=3)
    cache = run_cache(model, config, 2, 17, 11)
    assert predicted(model, config, 2, 17, 11).total == cache.nbytes()


def test_predicted_bytes_in_bfloat16_and_nf4():
    model = tiny_llama(head_dim=64).to(torch.bfloat16)
    for config in (CompressionConfig(policy="h2o", budget=0.5, kv_bits=16),
                   CompressionConfig(policy="h2o", budget=0.5, kv_bits=4, group_size=64),
                   CompressionConfig(policy="local", budget=0.5, kv_bits=4, quant="nf4", group_size=64)):
        cache = run_cache(model, config, 2, 19, 7)
        assert predicted(model, config, 2, 19, 7).total == cache.nbytes(), config


TINY = {}


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    budget=st.one_of(st.sampled_from([0.2, 0.5, 1.0]), st.integers(1, 24)),
    bits=st.sampled_from([(16, 16), (4, 4), (8, 4)]),
    residual=st.integers(0, 6),
    prompt=st.integers(1, 30),
    new=st.integers(1, 20),
)
def test_prediction_matches_random_runs(policy, budget, bits, residual, prompt, new):
    model = TINY.setdefault("llama", tiny_llama())
    config = CompressionConfig(policy=policy, budget=budget, k_bits=bits[0], v_bits=bits[1], residual=residual)
    cache = run_cache(model, config, 1, prompt, new)
    assert predicted(model, config, 1, prompt, new).total == cache.nbytes()


def test_early_stop_uses_tokens_fed_and_capacity_from_max_new_tokens():
    model = llama128()
    config = CompressionConfig(policy="h2o", budget=0.5, kv_bits=4)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = make_cache(model, config, max_length=20 + 30)  # generate asked for 30, stopped after 5
    with torch.inference_mode():
        token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(4):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert predicted(model, config, 1, 20, 5, max_new_tokens=30).total == cache.nbytes()


# -- known models: figures by hand ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,per_token", [
    ("llama-2-7b", 512 * KiB),  # 2 x 32 layers x 32 heads x 128 x 2 bytes
    ("llama-2-70b", 320 * KiB),  # 2 x 80 x 8 KV heads x 128 x 2
    ("llama-3-8b", 128 * KiB),  # 2 x 32 x 8 x 128 x 2
    ("mistral-7b", 128 * KiB),
    ("opt-66b", 2 * 64 * 9216 * 2),
    ("gpt-neox-20b", 2 * 44 * 6144 * 2),
    ("pythia-70m", 12 * KiB),  # 2 x 6 x 512 x 2
])
def test_known_model_fp16_bytes_per_token(name, per_token):
    dims = resolve_model(name).dims
    config = CompressionConfig(policy="full")
    # keys and values; the slot positions (int32) and per-layer counters come on top
    assert cache_bytes(dims, config, 1, 4096, 0, 4096, torch.float16).packed == 4096 * per_token
    assert cache_bytes(dims, config, 3, 100, 28, 129, torch.float32).packed == 3 * 129 * per_token * 2


@pytest.mark.parametrize("name,params", [
    ("llama-2-7b", 6_738_415_616), ("llama-2-70b", 68_976_648_192), ("llama-3-8b", 8_030_261_248),
    ("mistral-7b", 7_241_732_096), ("gpt-neox-20b", 20_554_567_680), ("opt-125m", 125_239_296),
    ("pythia-70m", 70_426_624), ("pythia-1b", 1_011_781_632), ("pythia-6.9b", 6_857_302_016),
    ("pythia-12b", 11_846_072_320), ("smollm2-135m", 134_515_008),
])
def test_known_model_parameter_counts(name, params):
    """Published totals (model cards: Pythia's table, Llama-2 / Llama-3 / Mistral / GPT-NeoX safetensors)."""
    assert resolve_model(name).num_parameters == params


def test_llama2_7b_hand_computed_compressed_bytes_and_weights():
    spec = resolve_model("Llama-2-7B")
    # int4, group 32: 64 data bytes + 4 groups x (fp16 scale + fp16 zero) = 80 bytes per head and tensor
    int4 = CompressionConfig(policy="full", kv_bits=4, group_size=32, residual=0)
    int4_bytes = cache_bytes(spec.dims, int4, 1, 1000, 0, 1000)
    assert int4_bytes.packed + int4_bytes.scales == 1000 * 2 * 32 * 32 * 80
    assert int4_bytes.positions == 1000 * 32 * 32 * 4  # one int32 position per slot, layer and head
    # h2o 16-bit at 0.5 of 4097 tokens: capacity 2049 tokens, a buffer of 2050 slots (room for the step's new
    # token) of K/V plus one fp32 score and one int32 position per slot, layer and head
    h2o = CompressionConfig(policy="h2o", budget=0.5)
    got = cache_bytes(spec.dims, h2o, 1, 4096, 0, 4097)
    assert (got.capacity, got.kept, got.slots) == (2049, 2049, 2050)
    assert got.total == 2050 * (512 * KiB + (4 + 4) * 32 * 32) + got.counters
    assert got.counters == 32 * (8 + 8 + 1 + 1)  # seen, first real token, two flags per layer
    assert weight_bytes(spec, 16, torch.float16) == 6_738_415_616 * 2
    rest = 6_738_415_616 - spec.linear_parameters
    assert rest == 2 * 32000 * 4096 + (2 * 32 + 1) * 4096  # embeddings, lm_head, RMSNorm weights
    assert weight_bytes(spec, 8, torch.float16) == rest * 2 + spec.linear_parameters + 4 * spec.linear_rows
    assert weight_bytes(spec, 4, torch.float16) == rest * 2 + spec.linear_parameters // 2 + \
        4 * math.ceil(spec.linear_parameters / 64)


def test_known_model_names_are_unambiguous_and_normalised():
    keys = [_key(a) for n, e in known_models().items() for a in {n, e["hf_id"], *e["aliases"]}]
    owners = {}
    for name, entry in known_models().items():
        for alias in {name, entry["hf_id"], *entry["aliases"]}:
            assert owners.setdefault(_key(alias), name) == name, alias
    assert len(set(keys)) == len(owners)
    for alias in ("meta-llama/Llama-2-7b-hf", "LLAMA2-7B", "llama_2_7b", "Llama-2-7B"):
        assert resolve_model(alias).dims.head_dim == 128
    assert resolve_model("Meta-Llama-3-8B").dims.kv_heads == 8


def test_unknown_model_lists_known_ones():
    with pytest.raises(ModelLoadError, match=r"unknown model 'gpt-17'.*llama-2-7b.*pythia-70m"):
        resolve_model("gpt-17")


def test_local_directory_config(tmp_path):
    model = tiny_llama(head_dim=64)
    model.config.save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    assert spec.dims.head_dim == 64 and spec.num_parameters == sum(p.numel() for p in model.parameters())


# -- memory strings ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("24GiB", 24 * GiB), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 GiB", 3 * 2**29), ("64kb", 64000),
    (1234, 1234),
])
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("bad", ["24", "24G", "-1GiB", "0GiB", "0.1B", "GiB", "", "1e3MiB", None, True, 0, 2.5])
def test_parse_memory_rejects(bad):
    with pytest.raises(ConfigError, match="memory .* is invalid; allowed"):
        parse_memory(bad)


# -- plan / choose -------------------------------------------------------------------------------------------------

def test_plan_recommends_best_measured_quality_that_fits_and_searches_exactly():
    """``h2o 50% 16-bit`` keeps more cache bytes, but ``full int4`` is measured better: the ranking picks it."""
    report = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128)
    assert report.fp16_cache_bytes == 8 * 4095 * 512 * KiB
    fitting = {r.label: r for r in report.rows if r.fits}
    assert fitting["h2o 50% 16-bit"].cache.total > fitting["full int4 g32 r3"].cache.total
    # full int8 keeps at least what the measured full int4 keeps: ranked at most its ratio, before it (more bytes)
    assert report.recommended is fitting["full int8 g32 r3"] and report.order == "measured"
    assert report.recommended.quality == min(r.quality for r in fitting.values() if r.quality is not None)
    assert report.reason.startswith("best measured quality that fits: at most 1.036x perplexity")
    room = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128, headroom="10%")  # int8 no longer fits
    assert room.recommended.label == "full int4 g32 r3" and room.recommended.quality_from == "full int4 g32 r3"
    assert room.reason.startswith("best measured quality that fits: 1.036x perplexity")
    assert all(r.fits == (r.total_bytes <= 24 * GiB) for r in report.rows)
    assert not report.rows[0].fits  # uncompressed fp16: 12.55 GiB weights + 16 GiB cache
    best = report.recommended

    def total(batch=8, prompt=3968):
        one = plan("llama-2-7b", "24GiB", batch=batch, prompt_len=prompt, gen_len=128, policies=(best.config.policy,),
                   budgets=(best.config.budget,), bits=(best.config.kv_bits,), group_sizes=(best.config.group_size,),
                   residuals=(best.config.residual,))
        assert len(one.rows) == 1
        return one.rows[0].total_bytes

    assert total(batch=best.max_batch) <= 24 * GiB < total(batch=best.max_batch + 1)
    prompt = best.max_context - 128
    assert total(prompt=prompt) <= 24 * GiB < total(prompt=prompt + 1)


def test_choose_error_names_the_smallest_memory_that_fits():
    with pytest.raises(ConfigError, match=r"no setting fits in 8.00 GiB .* needs [\d.]+ GiB \((\d+) bytes") as info:
        choose("llama-2-7b", "8GiB", batch=1, prompt_len=1024, gen_len=64)
    need = int(info.value.args[0].split("needs ")[1].split("(")[1].split(" bytes")[0])
    row = choose("llama-2-7b", need, batch=1, prompt_len=1024, gen_len=64)
    assert row.total_bytes == need
    with pytest.raises(ConfigError):
        choose("llama-2-7b", need - 1, batch=1, prompt_len=1024, gen_len=64)


def test_weights_bits_change_the_plan():
    four = plan("llama-2-13b", "12GiB", prompt_len=2048, gen_len=64, weights_bits=4)
    sixteen = plan("llama-2-13b", "12GiB", prompt_len=2048, gen_len=64)
    assert four.weight_bytes < sixteen.weight_bytes / 3
    assert four.recommended is not None and sixteen.recommended is None
    with pytest.raises(ConfigError, match="weights_bits=3"):
        plan("llama-2-13b", "12GiB", weights_bits=3)


def test_profile_report_orders_by_quality(tmp_path):
    report = tmp_path / "report.json"
    rows = [  # the more compressed h2o 25% int8 is rated better than everything else that fits
        {"config": CompressionConfig(policy="h2o", budget=0.25, kv_bits=8, group_size=32).to_dict(), "ppl_ratio": 1.01},
        {"config": CompressionConfig(policy="full", kv_bits=4, group_size=32).to_dict(), "ppl_ratio": 1.05},
        {"policy": "h2o", "budget": 0.5, "kv_bits": 4, "group_size": 128, "metrics": {"ppl_ratio": 1.02}},
    ]
    report.write_text(json.dumps({"rows": rows}))
    result = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128, profile=str(report))
    assert result.recommended.label == "h2o 25% int8 g32 r3"
    assert [r.quality for r in result.rows[:3]] == [1.01, 1.02, 1.05]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"policy": "h2o"}]))
    with pytest.raises(ConfigError, match="no row with a setting and a quality metric"):
        plan("llama-2-7b", "24GiB", profile=str(bad))


def test_candidates_skip_group_sizes_not_dividing_head_dim():
    grid = candidates(80, budgets=(1.0, 0.5), bits=(16, 4), group_sizes=(32, 64, 128))
    assert [c.kv_bits for c in grid] == [16, 16]  # pythia-2.8b / opt-2.7b: head_dim 80
    report = plan("pythia-2.8b", "80GiB", prompt_len=512, gen_len=16)
    assert all(not r.config.quantized for r in report.rows) and report.notes


def test_loaded_model_uses_its_exact_weights_and_dtype():
    model = tiny_llama()
    report = plan(model, "1MiB", prompt_len=16, gen_len=4, budgets=(1.0,), bits=(16,))
    assert report.weight_bytes == model.get_memory_footprint() and report.dtype == "float32"
    cache = run_cache(model, report.rows[0].config, 1, 16, 4)
    assert report.rows[0].cache.total == cache.nbytes()


class CharTokenizer:
    """Minimal tokenizer for tiny models: one id per byte (mod 128)."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text, return_tensors="pt"):
        return type("Encoded", (), {"input_ids": torch.tensor([[b % 128 for b in text.encode()]])})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_choose_for_prompt_then_generate_fits():
    model, tok = tiny_llama(), CharTokenizer()
    full = choose_for_prompt(model, tok, "x" * 40, "10MiB", max_new_tokens=8, chat=False)
    assert full.label == "full 32-bit"  # the tiny model runs in fp32, so its cache does too
    limit = full.total_bytes - 1  # the uncompressed setting no longer fits
    row = choose_for_prompt(model, tok, "x" * 40, limit, max_new_tokens=8, chat=False,
                            base=CompressionConfig(policy="local", residual=2))
    assert row.config.policy in ("local", "full") and row.config.residual == 2 and row.total_bytes <= limit
    result = generate(model, tok, "x" * 40, row.config, max_new_tokens=8, chat=False)
    assert result.kv_bytes == row.cache.total
    with pytest.raises(ConfigError, match="no setting fits in"):
        choose_for_prompt(model, tok, "x" * 40, 1000, max_new_tokens=8, chat=False)


def test_choose_for_prompt_keeps_every_field_it_does_not_pick():
    """Only budget, bits and group size are the planner's to pick: head and layer budgets, the kernel and the
    policy's own options come from ``base`` (they used to be dropped: adaptive heads became uniform)."""
    model, tok = tiny_llama(), CharTokenizer()
    base = CompressionConfig(policy="a2sf", forgetting_factor=0.9, head_budgets="adaptive", layer_budgets="pyramid",
                             attention_kernel="torch", rotate=False, score_chunk_size=16, prefill_chunk_size=128)
    full = choose_for_prompt(model, tok, "x" * 40, "10MiB", max_new_tokens=8, chat=False, base=base)
    assert full.config.policy == "full" and full.config.attention_kernel == "torch" and not full.config.rotate
    row = choose_for_prompt(model, tok, "x" * 40, "10MiB", max_new_tokens=8, chat=False, base=base,
                            budgets=(0.25,))  # evicting rows only (on a tiny model the workspace outweighs the cache)
    assert row.config.budget == 0.25
    for name in ("policy", "policy_options", "head_budgets", "layer_budgets", "attention_kernel", "rotate",
                 "score_chunk_size", "prefill_chunk_size"):
        assert getattr(row.config, name) == getattr(base, name), name
    result = generate(model, tok, "x" * 40, row.config, max_new_tokens=8, chat=False)
    assert result.kv_bytes <= row.cache.total


def test_choose_for_prompt_keeps_the_calibration_and_key_offsets():
    """``--memory-limit`` used to drop ``calibration`` and ``key_offsets``: the row's cache had plain int keys."""
    model, tok = tiny_llama(), CharTokenizer()
    base = CompressionConfig(kv_bits=4, key_offsets="calibrated", calibration="/no/such/file.safetensors")
    row = choose_for_prompt(model, tok, "x" * 40, "10MiB", max_new_tokens=8, chat=False, base=base,
                            budgets=(0.25,), bits=(4,))
    assert row.config.kv_bits == 4 and row.config.key_offsets == "calibrated"
    assert row.config.calibration == base.calibration
    row16 = choose_for_prompt(model, tok, "x" * 40, "10MiB", max_new_tokens=8, chat=False, base=base,
                              budgets=(0.25,), bits=(16,))
    assert row16.config.key_offsets == "none"  # 16-bit keys have no offsets to calibrate


# -- CLI -----------------------------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_plan_table_and_json():
    args = ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--batch", "8", "--prompt-len", "3968",
            "--gen-len", "128"]
    data = json.loads(runner.invoke(app, [*args, "--json"]).output)
    best = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128, headroom="10%").recommended
    assert data["recommended"]["label"] == best.label and data["memory_limit"] == 24 * GiB
    assert data["headroom_bytes"] == int(24 * GiB * 0.1) and best.total_bytes <= 24 * GiB - data["headroom_bytes"]
    assert len(data["rows"]) == 20 and data["rows"][0]["cache"]["packed"] == 8 * 4096 * 512 * KiB
    out = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert f"recommended: {best.label} (best measured quality that fits: 1.036x perplexity" in out.output
    assert "quality ranking: h2o_compress/data/quality_ranking.json" in out.output
    assert data["reason"].startswith("best measured quality that fits") and data["order"] == "measured"
    assert "headroom: 2.40 GiB of the limit left free" in out.output
    assert "full 16-bit" in out.output and "h2o 10% int4 g128 r3" in out.output


def test_cli_plan_takes_layer_budgets(tmp_path):
    """``--layer-budgets pyramid|global|FILE`` reaches the candidates: each row's bytes are the planner's for that
    setting (pyramid and a weights file: every layer counted; global: uniform's total), and the label says it."""
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps([1] * 16 + [3] * 16))
    base = ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--bits", "4", "--budgets", "0.2", "--json"]
    rows = {}
    for layers, policy in (("uniform", "h2o"), ("pyramid", "h2o"), (str(weights), "h2o"), ("global", "kvzip")):
        out = runner.invoke(app, [*base, "--policies", policy, "--layer-budgets", layers])
        assert out.exit_code == 0, out.output
        rows[layers] = json.loads(out.output)["rows"][0]
    spec = resolve_model("llama-2-7b")
    for layers, row in rows.items():
        config = CompressionConfig(policy=row["config"]["policy"], budget=0.2, kv_bits=4,
                                   layer_budgets=str(weights) if layers == str(weights) else layers)
        assert row["cache"]["total"] == cache_bytes(spec.dims, config, 1, 2048, 127, 2176).total
    assert "pyramid layers" in rows["pyramid"]["label"] and "weighted layers" in rows[str(weights)]["label"]
    assert rows["global"]["cache"]["total"] == cache_bytes(
        spec.dims, CompressionConfig(policy="kvzip", budget=0.2, kv_bits=4), 1, 2048, 127, 2176).total
    out = runner.invoke(app, [*base, "--layer-budgets", "global"])
    assert out.exit_code == 2 and "layer_budgets='global' with policy='h2o'" in out.output


@pytest.mark.parametrize("args,message", [
    (["--memory", "24G"], "error: memory '24G' is invalid"),
    (["--model", "gpt-17"], "error: unknown model 'gpt-17'"),
    (["--bits", "16,3"], "error: kv_bits=3 is not supported"),
    (["--budgets", "0.5,x"], "error: budget='x' is not a number"),
    (["--batch", "0"], "error: batch=0 is invalid"),
])
def test_cli_plan_errors(args, message):
    base = {"--model": "llama-2-7b", "--memory": "24GiB"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    out = runner.invoke(app, ["plan", *[x for kv in base.items() for x in kv]])
    assert out.exit_code == 2 and message in out.output and "Traceback" not in out.output


# -- the real model ------------------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("config", [
    CompressionConfig(policy="full"),
    CompressionConfig(policy="h2o", budget=0.5),
    CompressionConfig(policy="h2o", budget=0.3, kv_bits=4, group_size=32, residual=4),
    CompressionConfig(policy="sink", budget=0.5, kv_bits=8, group_size=64, residual=8),
    CompressionConfig(policy="local", budget=0.25, k_bits=8, v_bits=4, group_size=32, residual=2),
], ids=lambda c: f"{c.policy}-{c.budget}-{c.key_bits}/{c.value_bits}")
def test_real_model_generate_matches_prediction(smollm2, config):
    model, tokenizer = smollm2
    result = generate(model, tokenizer, "Explain in detail how a key-value cache speeds up decoding.", config,
                      max_new_tokens=24)
    guess = cache_bytes(model_dims(model.config), config, 1, result.prompt_tokens, result.new_tokens - 1,
                        result.prompt_tokens + 24, torch.float32)
    assert guess.total == result.kv_bytes


@pytest.mark.integration
def test_real_model_batch_and_cli_memory_limit(smollm2):
    model, _ = smollm2
    config = CompressionConfig(policy="h2o", budget=0.4, kv_bits=4, group_size=64, residual=4)
    cache = run_cache(model, config, 3, 40, 12)
    assert predicted(model, config, 3, 40, 12).total == cache.nbytes()
    out = runner.invoke(app, ["generate", "Say hi.", "--memory-limit", "64GiB", "--max-new-tokens", "4", "--json"])
    assert out.exit_code == 0, out.output
    assert "memory limit 64.00 GiB: picked full 32-bit" in out.output  # fp32 on CPU: labelled by the real dtype
    out = runner.invoke(app, ["generate", "Say hi.", "--memory-limit", "100MiB", "--max-new-tokens", "4"])
    assert out.exit_code == 2 and "no setting fits in 100.00 MiB" in out.output and "needs" in out.output


# -- bounded searches, headroom, strict JSON, labels (issue 15) -----------------------------------------------------
def test_largest_plan_inputs_return_fast():
    import time

    start = time.perf_counter()
    report = plan("llama-2-7b", "24GiB", batch=2**20, prompt_len=2**24, gen_len=2**24, residuals=(4096,),
                  budgets=(1.0, 0.1, 10**6))
    assert report.rows and time.perf_counter() - start < 60


@pytest.mark.parametrize("kwargs,message", [
    (dict(gen_len=2**24 + 1), "gen_len=16777217 is invalid; allowed: an integer >= 1, at most 16777216"),
    (dict(batch=2**20 + 1), "batch=1048577 is invalid"),
    (dict(residuals=(4097,)), "residual 4097 is invalid; allowed: an integer from 0 to 4096"),
    (dict(group_sizes=(7,)), "group size 7 is not supported; allowed: 32, 64, 128"),
    (dict(headroom="91%"), "headroom='91%' is invalid"),
    (dict(headroom="24GiB"), "is not below the memory limit"),
])
def test_plan_inputs_are_bounded(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan("llama-2-7b", "24GiB", **kwargs)


def test_headroom_is_left_free_and_said():
    no_room = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128)
    room = plan("llama-2-7b", "24GiB", batch=8, prompt_len=3968, gen_len=128, headroom="10%")
    assert room.headroom_bytes == int(0.1 * 24 * GiB) and room.usable_bytes == 24 * GiB - room.headroom_bytes
    assert room.recommended.total_bytes <= room.usable_bytes < no_room.recommended.total_bytes
    assert all(r.fits == (r.total_bytes <= room.usable_bytes) for r in room.rows)
    assert plan("llama-2-7b", "24GiB", headroom="1GiB").headroom_bytes == GiB


def test_nan_metric_is_ignored_with_a_warning_and_json_is_strict(tmp_path):
    report = tmp_path / "report.json"
    report.write_text('[{"config": {"policy": "h2o", "budget": 0.25, "kv_bits": 4, "group_size": 128},'
                      ' "perplexity_ratio": NaN},'
                      ' {"config": {"policy": "h2o", "budget": 0.25, "kv_bits": 8}, "perplexity_ratio": 1.02}]')
    result = runner.invoke(app, ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--profile", str(report),
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert data["recommended"]["label"] == "h2o 25% int8 g32 r3"
    assert "warning:" in result.stderr and "perplexity_ratio=nan" in result.stderr and "is not finite" in result.stderr
    warnings = []
    quality = load_quality(report, warnings)
    assert len(quality) == 1 and len(warnings) == 1


def test_labels_follow_the_real_kv_dtype():
    assert describe(CompressionConfig(), "float32") == "full 32-bit"
    assert describe(CompressionConfig(), "bfloat16") == "full 16-bit"
    assert describe(CompressionConfig(budget=0.5, k_bits=16, v_bits=4), "float32") == "h2o 50% k:32/v:int4 g32 r3"
    rows = plan("llama-2-7b", "24GiB", dtype="float32").rows
    assert any(r.label == "full 32-bit" for r in rows) and not any("16-bit" in r.label for r in rows)


def test_compiled_plans_count_the_cuda_graph_pool_of_the_decode_step():
    """A compiled decode step keeps its buffers in the CUDA graph's private pool, beside the prefill's: the
    workspace grows by ``graph_pool_bytes`` (one decode pass; the Triton op reads the cache in place, the torch form
    of head-adaptive and mixed-precision layers reads every kept token), bitsandbytes rows (eager) by nothing."""
    from h2o_compress.planner import forward_peak_bytes, graph_pool_bytes

    spec = resolve_model("llama-2-7b")
    args = dict(memory="80GiB", batch=16, prompt_len=4000, gen_len=96, budgets=(0.2, 1.0), bits=(16, 4),
                group_sizes=(32,))
    compiled, eager = plan("llama-2-7b", compiled=True, **args), plan("llama-2-7b", compiled=False, **args)
    assert compiled.compiled and not eager.compiled
    for with_pool, without in zip(compiled.rows, eager.rows):
        assert with_pool.config == without.config
        pool = graph_pool_bytes(spec, with_pool.config, 16, with_pool.cache.kept, torch.float16, fused=True)
        assert pool == forward_peak_bytes(spec, with_pool.config, 16, 1, 0, 2) > 16 * spec.vocab_size * 2
        assert with_pool.workspace_bytes - without.workspace_bytes == pool
    nf4 = dict(args, bits=(4,), quant="nf4")
    assert [r.workspace_bytes for r in plan("llama-2-7b", compiled=True, **nf4).rows] == \
        [r.workspace_bytes for r in plan("llama-2-7b", compiled=False, **nf4).rows]
    adaptive = dict(args, budgets=(0.2,), head_budgets="adaptive")
    row = plan("llama-2-7b", compiled=True, **adaptive).rows[0]
    torch_form = graph_pool_bytes(spec, row.config, 16, row.cache.kept * spec.dims.kv_heads, torch.float16, False)
    assert row.workspace_bytes - plan("llama-2-7b", compiled=False, **adaptive).rows[0].workspace_bytes == torch_form
    assert torch_form > 10 * graph_pool_bytes(spec, row.config, 16, row.cache.kept, torch.float16, fused=True)


def test_compiled_by_default_as_generate_compiles():
    """``compiled=None``: a plan for a card counts the pool for 16-bit weights (CUDA compiles by default), not for
    bitsandbytes weights (eager); a loaded model on the CPU decodes eagerly. A bad value is refused."""
    args = dict(memory="80GiB", budgets=(0.2,), bits=(4,), group_sizes=(32,))
    assert plan("llama-2-7b", **args).compiled and not plan("llama-2-7b", weights_bits=4, **args).compiled
    assert not plan(tiny_llama(), **args).compiled
    with pytest.raises(ConfigError, match=r"compiled='yes' is invalid; allowed: True, False or None"):
        plan("llama-2-7b", compiled="yes", **args)
    out = runner.invoke(app, ["plan", "--model", "llama-2-7b", "--memory", "24GiB", "--no-compile", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["compiled"] is False
    out = runner.invoke(app, ["plan", "--model", "llama-2-7b", "--memory", "24GiB"], env={"COLUMNS": "200"})
    assert "with the CUDA-graph pool of the compiled decode step" in out.output


def test_scratch_and_op_only_where_the_triton_op_runs():
    """The op's scratch is counted for a cache that decodes through it, not for ``attention_kernel='torch'`` (the
    torch form), mixed precision or the bitsandbytes formats."""
    from dataclasses import replace as with_

    from h2o_compress.planner import runs_decode_op, workspace_bytes

    spec = resolve_model("llama-2-7b")
    base = CompressionConfig(budget=0.2, kv_bits=4)
    assert runs_decode_op(base, adaptive=False) and not runs_decode_op(base, adaptive=True)
    for other in (with_(base, attention_kernel="torch"), with_(base, high_bits_fraction=0.25),
                  CompressionConfig(budget=0.2, kv_bits=4, quant="nf4", group_size=64)):
        assert not runs_decode_op(other, adaptive=False)
        assert workspace_bytes(spec, other, 4, 1000, 200, torch.float16, 180, 3) == \
            workspace_bytes(spec, other, 4, 1000, 200, torch.float16)
    assert workspace_bytes(spec, base, 4, 1000, 200, torch.float16, 180, 3) > \
        workspace_bytes(spec, base, 4, 1000, 200, torch.float16)
