"""Hybrids through the commands: every hybrid class of the model matrix (tests/helpers/architectures.py: a linear-
attention / SSM / convolution layer, then attention; Falcon-H1 holds both in one layer) is planned, calibrated on its
attention layers only, and refused by compress-then-ask in one line before any pass; RecurrentGemma, whose states
live in its own modules, runs the batch job (its states held in the cache's rows while the job runs)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.architectures import hand_made_causal_lm, tiny_causal_lm
from helpers.tiny_lm import english_tokenizer

import h2o_compress
from h2o_compress import CompressionConfig, UnsupportedModelError, compress, generate
from h2o_compress.calibration import calibrate
from h2o_compress.calibration.eviction_fit import h2o_weights
from h2o_compress.models import model_dims
from h2o_compress.persistence.calibration_file import EVICTION_WEIGHTS, load_calibration

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HYBRIDS = ["bailing_hybrid", "bamba", "falcon_h1", "granitemoehybrid", "jamba", "kimi_linear", "lfm3", "minimax",
           "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma"]
HAND_MADE_HYBRIDS = ["lfm2_moe", "nemotron_h", "zamba", "zamba2"]
TEXT = "the cache keeps heavy hitters and the recent window of tokens while the rest is evicted\n" * 12


@pytest.fixture(scope="module")
def tokenizer():
    return english_tokenizer()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid-text") / "text.txt"
    path.write_text(TEXT)
    return str(path)


def _hybrid(model_type: str):
    model = hand_made_causal_lm(model_type) if model_type in HAND_MADE_HYBRIDS else tiny_causal_lm(model_type)
    assert not isinstance(model, str), model
    for module in model.modules():  # Mamba-2's torch scan pads every pass to its chunk (256): 16 is faster
        if hasattr(module, "ssm_state_size") and isinstance(getattr(module, "chunk_size", None), int):
            module.chunk_size = 16
    return model


@pytest.mark.parametrize("model_type", HYBRIDS + HAND_MADE_HYBRIDS)
@torch.inference_mode()
def test_hybrid_plans_calibrates_its_attention_layers_and_ask_refuses_it(model_type, tokenizer, text_file,
                                                                         tmp_path):
    """plan: a row per candidate, the states counted; calibrate: a file that fits the model, one row per layer, the
    state layers H2O's ranking (nothing fitted: they evict nothing), the attention layers fitted; compress (the ask
    command's first step): UnsupportedModelError naming the model type, in one line."""
    model = _hybrid(model_type)
    spans = model_dims(model.config).spans
    states = sum(span.stateful for span in spans)
    report = h2o_compress.plan(model.config, "1GiB", prompt_len=64, gen_len=8, budgets=(0.5,), bits=(4,),
                               group_sizes=(32,))
    assert report.rows and all(row.cache.total > 0 for row in report.rows)

    fitted = calibrate(model, tokenizer, text_file, tokens=64, segments=2, out=str(tmp_path / "c.safetensors"))
    weights = load_calibration(fitted.details["path"], model).tensors[EVICTION_WEIGHTS]
    assert weights.shape[0] == len(spans) and torch.isfinite(weights).all()
    assert fitted.details.get("state_layers", 0) == states
    for layer, span in enumerate(spans):
        h2o = h2o_weights(weights.shape[1], weights.shape[2] - 4)
        assert torch.equal(weights[layer], h2o) == span.stateful, layer  # a fitted layer differs from H2O's

    with pytest.raises(UnsupportedModelError, match=f"model type {model_type!r}") as refused:
        compress(model, tokenizer, "the cache keeps heavy hitters", chat=False)
    assert "\n" not in str(refused.value)


@torch.inference_mode()
def test_a_hybrid_generates_with_its_attention_layers_calibration(tokenizer, text_file, tmp_path):
    """The file calibrate writes for a hybrid runs policy ``calibrated``: generate evicts on its attention layer."""
    model = _hybrid("bamba")
    path = str(tmp_path / "bamba.safetensors")
    calibrate(model, tokenizer, text_file, tokens=64, segments=2, out=path)
    config = CompressionConfig(policy="calibrated", budget=8, kv_bits=4, calibration=path)
    result = generate(model, tokenizer, TEXT[:200], config, max_new_tokens=4, chat=False)
    assert len(result.token_ids) == 4


@torch.inference_mode()
def test_batch_job_answers_recurrent_gemma_as_generate_does(tokenizer, tmp_path, monkeypatch):
    """RecurrentGemma keeps its states in its own modules; the batch job holds them in the cache's rows while it
    runs (`cache.module_states`): three prompts of different lengths in 2 rows, each answer generate's alone."""
    import h2o_compress.jobs.batch as batch_job

    model = _hybrid("recurrent_gemma")
    prompts = ["the cache keeps", TEXT[:150], "heavy hitters and the recent window"]
    config = CompressionConfig(budget=10, kv_bits=4, residual=2)
    expected = [generate(model, tokenizer, p, config, max_new_tokens=6, chat=False).text for p in prompts]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                                               for i, p in enumerate(prompts)))
    monkeypatch.setattr(batch_job.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    job = batch_job.BatchJob(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), model="tiny", config=config,
                             chat=False, max_new_tokens=6, batch_size=2)
    job.run()
    answers = {a["id"]: a for a in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [answers[str(i)].get("error") for i in range(3)] == [None] * 3
    assert [answers[str(i)]["text"] for i in range(3)] == expected
