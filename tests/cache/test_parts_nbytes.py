"""A layer's bytes are sized from its setting before anything is allocated (`parts_nbytes`): the figure is the
bytes its parts then hold, for every store layout, format, ring and optional buffer."""

from __future__ import annotations

import pytest
import torch

from h2o_compress import CompressionConfig
from h2o_compress.cache import build_layers
from h2o_compress.cache.store import parts_nbytes

HEAD_DIM = 64


@pytest.mark.parametrize(("options", "heads", "dtype", "value_dim"), [
    ({"budget": 16, "kv_bits": 4}, 2, torch.float32, None),  # int4, fp16 ring of an fp32 model, scores
    ({"budget": 16, "kv_bits": 8, "residual": 0}, 3, torch.float16, None),  # no ring
    ({"budget": 16, "kv_bits": 4, "policy": "vatp"}, 2, torch.float32, None),  # value norms
    ({"budget": 16, "kv_bits": 4, "policy": "local"}, 2, torch.float32, None),  # no scores
    ({"budget": 16, "kv_bits": 4, "head_budgets": "adaptive"}, 2, torch.float32, None),  # pool, int8 tags
    ({"budget": 8, "kv_bits": 4, "head_budgets": "adaptive"}, 130, torch.float32, None),  # int16 tags
    ({"budget": 16, "k_bits": 4, "v_bits": 8, "high_bits_fraction": 0.25}, 2, torch.float32, None),
    ({"budget": 16, "kv_bits": 4, "high_bits_fraction": 0.5, "head_budgets": "adaptive"}, 2, torch.float32, None),
    ({"budget": 16, "kv_bits": 4}, 2, torch.float32, 48),  # values of another head dim (MLA), held padded
    ({"budget": 16, "kv_bits": 16}, 2, torch.bfloat16, 32),
    ({"policy": "full"}, 2, torch.float32, None),  # unbounded
    ({"budget": 16, "kv_bits": 4, "quant": "nf4"}, 2, torch.float32, None),  # bitsandbytes' parts
])
@pytest.mark.parametrize("max_tokens", [40, None])
def test_parts_nbytes_is_what_the_parts_hold(options, heads, dtype, value_dim, max_tokens):
    if options.get("quant") == "nf4":
        pytest.importorskip("bitsandbytes")
    config = CompressionConfig(**options)
    if max_tokens is None and (config.high_bits_fraction or config.head_budgets == "adaptive"):
        pytest.skip("needs a cache of known length")
    capacity = config.kept_tokens(max_tokens)
    layer = build_layers(config, 1, HEAD_DIM, capacity, max_tokens=max_tokens, value_dim=value_dim)[0]
    keys = torch.zeros(2, heads, 5, HEAD_DIM, dtype=dtype)
    layer.lazy_initialization(keys, keys)
    assert layer.nbytes() > 0
    assert parts_nbytes(layer.setting, layer.geometry, keys.shape[2]) == layer.nbytes()
