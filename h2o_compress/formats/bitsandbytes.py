"""bitsandbytes formats for keys/values: NF4 / FP4 (QLoRA, Dettmers et al. 2023, arXiv 2305.14314 §3)
and blockwise dynamic 8-bit (Dettmers et al. 2022, arXiv 2110.02861).

Blocks of ``block_size`` run along ``head_dim`` of one token, so tokens stay independent and eviction can
gather their packed data and absmax scales.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from h2o_compress.utils.errors import ConfigError
from h2o_compress.formats.base import KVQuantizer, StoredTensor, check_group_size


def _functional():
    try:
        import bitsandbytes.functional as F
    except ImportError as exc:  # pragma: no cover - bitsandbytes is a dependency
        raise ConfigError("the nf4/fp4/int8-blockwise formats need bitsandbytes: pip install bitsandbytes") from exc
    return F


class BitsAndBytesQuantizer(KVQuantizer):
    """``fmt`` is ``nf4``, ``fp4`` (4 bits, packed two per byte) or ``int8`` (blockwise dynamic 8-bit).

    Stored parts: ``data`` uint8 ``[batch, kv_heads, seq, head_dim * bits / 8]`` and ``absmax`` fp32
    ``[batch, kv_heads, seq, head_dim / block_size]`` (bitsandbytes' own scale format).

    Raises:
        ConfigError: unknown format or ``block_size`` not dividing ``head_dim``.
    """

    supported_bits: ClassVar[tuple[int, ...]] = (4, 8)
    compilable: ClassVar[bool] = False
    #: The bitsandbytes format of this family's 4-bit tensors (8-bit ones are blockwise ``int8``).
    format_4bit: ClassVar[str] = "nf4"

    @classmethod
    def create(cls, bits: int, group_size: int, head_dim: int, rotate: bool = True) -> "BitsAndBytesQuantizer":
        return cls(cls.format_4bit if bits == 4 else "int8", group_size, head_dim)

    @classmethod
    def label(cls, bits: int) -> str:
        """`format_4bit` (``nf4``, ``fp4``) for 4 bits, ``bw8`` (blockwise 8-bit) for 8."""
        return cls.format_4bit if bits == 4 else "bw8"

    def __init__(self, fmt: str, block_size: int, head_dim: int):
        if fmt not in ("nf4", "fp4", "int8"):
            raise ConfigError(f"unknown bitsandbytes format {fmt!r}; allowed: nf4, fp4, int8")
        check_group_size(block_size, head_dim)
        self.fmt, self.block_size, self.head_dim = fmt, block_size, head_dim
        self.bits = 8 if fmt == "int8" else 4
        self._F = _functional()

    def quantize(self, x: torch.Tensor) -> StoredTensor:
        shape = x.shape
        flat = x.float().contiguous().view(-1)
        if self.bits == 4:
            data, state = self._F.quantize_4bit(flat, blocksize=self.block_size, quant_type=self.fmt)
        else:
            data, state = self._F.quantize_blockwise(flat, blocksize=self.block_size)
        return StoredTensor(
            {
                "data": data.view(*shape[:-1], self.head_dim * self.bits // 8),
                "absmax": state.absmax.view(*shape[:-1], self.head_dim // self.block_size),
            }
        )

    def dequantize(self, stored: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
        data, absmax = stored.parts["data"], stored.parts["absmax"]
        shape = (*data.shape[:-1], self.head_dim)
        if data.numel() == 0:
            return torch.empty(shape, dtype=dtype, device=data.device)
        state = self._F.QuantState(
            absmax=absmax.reshape(-1).contiguous(),
            shape=torch.Size(shape),
            blocksize=self.block_size,
            quant_type=self.fmt,
            code=None if self.bits == 4 else self._code(data.device),
            dtype=torch.float32,
        )
        if self.bits == 4:
            out = self._F.dequantize_4bit(data.reshape(-1, 1), quant_state=state)
        else:
            out = self._F.dequantize_blockwise(data.reshape(-1), quant_state=state).view(shape)
        return out.to(dtype)

    def _code(self, device):
        if not hasattr(self, "_dynamic_code"):
            self._dynamic_code = self._F.create_dynamic_map().to(device)
        return self._dynamic_code


class NF4Quantizer(BitsAndBytesQuantizer):
    """``nf4``: 4-bit NormalFloat (QLoRA, Dettmers et al. 2023, arXiv 2305.14314 §3); 8-bit tensors blockwise int8."""


class FP4Quantizer(BitsAndBytesQuantizer):
    """``fp4``: bitsandbytes' 4-bit float; 8-bit tensors blockwise int8."""

    format_4bit: ClassVar[str] = "fp4"


class Int8BlockwiseQuantizer(BitsAndBytesQuantizer):
    """``int8-blockwise``: bitsandbytes' blockwise dynamic 8-bit (Dettmers et al. 2022, arXiv 2110.02861); 8 bits only."""

    supported_bits: ClassVar[tuple[int, ...]] = (8,)
