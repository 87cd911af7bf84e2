"""Calibration of sliding-window and chunked models: every class of the architecture matrix
(tests/helpers/architectures.py) with a sliding or chunked layer calibrates (its windowed layers fitted on the tokens
they hold) and generates with ``policy="calibrated"``, as a tiny random model (window / chunk of 16 tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.architectures import VOCAB, WINDOW, tiny_causal_lm

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.attention import use_h2o_attention
from h2o_compress.calibration import calibrate
from h2o_compress.calibration.eviction_fit import read_segment, training_rows
from h2o_compress.models import model_dims
from h2o_compress.persistence.calibration_file import EVICTION_WEIGHTS, load_calibration
from h2o_compress.runtime.compiled import decode_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The classes of the architecture matrix with a sliding, chunked or held-window layer (all the others are full
#: attention or constant-state layers), each as `tiny_causal_lm` builds it.
WINDOWED = ["afmoe", "beam", "cohere2", "cohere2_moe", "cwm", "exaone4", "exaone_moe", "gemma2", "gemma3_text",
            "gpt_oss", "granite_swa", "granitemoe_swa", "kolibri1", "llama4_text", "mimo_v2_flash", "ministral",
            "ministral3", "mistral", "mixtral", "modernbert-decoder", "moshi", "olmo3", "phi3", "phimoe", "qwen3_moe",
            "starcoder2", "vaultgemma"]
PROMPT, STEPS = 80, 4


class Tokenizer:
    """One token per character, ids 3 .. 102 (below the tiny models' vocabulary, past their special ids)."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=torch.tensor([[3 + ord(c) % 100 for c in text]]))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 4)
    return str(path)


def _generate(model, cache) -> torch.Tensor:
    """Logits of an 80-token prompt's last token and ``STEPS`` greedy steps through ``cache``."""
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    use_h2o_attention(model)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        out = [logits]
        for step in range(STEPS):
            positions = torch.full((1, 1), PROMPT + step, dtype=torch.long)
            logits = decode_step(model, logits.argmax(-1, keepdim=True), cache, positions)
            out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("model_type", WINDOWED)
def test_a_windowed_model_calibrates_and_generates_with_the_calibrated_policy(model_type, text_file, tmp_path):
    model = tiny_causal_lm(model_type)
    assert not isinstance(model, str), model
    dims = model_dims(model.config)
    assert any(span.windowed for span in dims.spans)
    out = tmp_path / "scorer.safetensors"
    calibration = calibrate(model, Tokenizer(), text_file, tokens=64, segments=2, out=out)
    weights = calibration.tensors[EVICTION_WEIGHTS]
    assert weights.shape[0] == dims.num_layers and bool(torch.isfinite(weights).all())
    assert torch.equal(load_calibration(out, model).tensors[EVICTION_WEIGHTS], weights)  # passes the checks
    config = CompressionConfig(policy="calibrated", budget=0.2, calibration=str(out))
    cache = make_cache(model, config, max_length=PROMPT + STEPS + 1)
    assert torch.isfinite(_generate(model, cache)).all()
    for layer in cache.layers:
        if getattr(layer, "setting", None) is not None and layer.setting.span.windowed:
            assert layer.kept_length() <= min(layer.setting.capacity, layer.setting.span.size - 1)


def test_a_sliding_layer_ranks_only_the_tokens_its_window_holds():
    """Mistral (every layer sliding, window 16): the rows at each decision time are the tokens the next query
    sees, outside the recent window (before: every token since the start, against a cache that held 15 values)."""
    model = tiny_causal_lm("mistral")
    read = read_segment(model, torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(2)))
    layer = read[0]
    assert layer.span.kind == "sliding" and layer.values.shape[1] == 48  # every value, not the window's 15
    assert bool((layer.attention[:, 40, : 40 - WINDOW + 1] == 0).all())  # the model masked the window itself
    inputs, labels = training_rows(layer, recent=4, stride=8)
    decisions = range(4 + 8, 48 - 1, 8)
    expected = sum(n - 4 - max(0, n - WINDOW + 1) for n in decisions)
    assert labels.shape == (2, expected) and inputs.shape == (2, expected, 32 + 3)
    n = 28  # the third decision time: tokens 13 .. 23 are held and outside the recent window
    first = sum(m - 4 - max(0, m - WINDOW + 1) for m in decisions if m < n)
    got = labels[:, first : first + 11]
    assert torch.allclose(got, torch.log(layer.attention[:, n:, 13:24].mean(1) + 1e-4), atol=1e-5)


def test_a_window_within_the_recent_one_ranks_as_h2o(tmp_path, text_file):
    """A window that holds no token beyond the recent window gives no row to fit: those layers rank by the
    accumulated score alone (H2O's weights), and the file still holds one row per layer."""
    model = tiny_causal_lm("mistral")
    model.config.sliding_window = 4
    calibration = calibrate(model, Tokenizer(), text_file, tokens=64, segments=2, out=tmp_path / "s.safetensors")
    weights = calibration.tensors[EVICTION_WEIGHTS]
    expected = torch.zeros_like(weights)
    expected[..., 0] = 1.0
    assert torch.equal(weights, expected)
