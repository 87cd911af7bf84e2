"""Cache files written by an earlier version (commit 6c2bbe0, before the package was split into layers) still load
and continue: the file format did not change when persistence/ was split into file_format and cache_state.

The files (tests/data/saved_caches/) hold a tiny LLaMA's cache after a 20-token prompt, saved with
``CompressionConfig(budget=12, kv_bits=4)`` (+ ``head_budgets="adaptive"``, + ``high_bits_fraction=0.5``),
``max_length=40``; next_logits.json holds the logits that version gave for token 5 after it.

What is exact on every machine: the cache loaded from the old file, saved again by this version, holds the same
tensors bit for bit. The logits are compared with a float32 rounding tolerance: they were stored on a machine with
AVX-512, and an AVX2 machine's matrix products sum in another order (largest difference measured: 1.5e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import load_file

from h2o_compress import load_cache, save_cache

DATA = Path(__file__).resolve().parents[1] / "data" / "saved_caches"


@pytest.mark.parametrize("name", ["bounded", "adaptive", "mixed"])
@torch.no_grad()
def test_a_file_saved_by_an_earlier_version_loads_and_continues(name, tmp_path):
    model = tiny_llama(seed=0)
    cache = load_cache(DATA / f"{name}.safetensors", model)
    assert cache.get_seq_length() == 20
    earlier, again = load_file(DATA / f"{name}.safetensors"), load_file(save_cache(cache, tmp_path / "again", model))
    assert sorted(earlier) == sorted(again)
    assert all(torch.equal(earlier[key], again[key]) for key in earlier)
    logits = model(input_ids=torch.tensor([[5]]), past_key_values=cache).logits[0, -1]
    expected = torch.tensor(json.loads((DATA / "next_logits.json").read_text())[name])
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(logits, torch.zeros_like(logits), atol=1e-3)
