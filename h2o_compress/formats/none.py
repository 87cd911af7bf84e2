"""Identity "quantizer": stores keys/values in the model dtype (16 bits, or 32 for fp32 models)."""

from __future__ import annotations

import torch

from h2o_compress.formats.base import KVQuantizer, StoredTensor


class NoQuantizer(KVQuantizer):
    """Keeps the tensor as it is: ``parts = {"x": [batch, kv_heads, seq, head_dim]}``."""

    bits = 16

    def quantize(self, x: torch.Tensor) -> StoredTensor:
        return StoredTensor({"x": x})

    def dequantize(self, stored: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
        return stored.parts["x"].to(dtype)
