"""An 8-bit integer code stored as two 4-bit planes, so a token can drop to 4 bits without re-quantization.

``q8 = 16 x hi + lo`` with the 8-bit code's own scale ``s`` and zero ``z`` (fp16). The high plane is stored in the
plain int4 layout of [`IntQuantizer`][h2o_compress.formats.IntQuantizer] with the scale/zero pair
``(16 s, z + 7.5 s)``, so the ordinary int4 dequantizer reads it as ``(16 hi + 7.5) s + z``: the centre of the
16 codes ``hi`` stands for. That is within ``8 s = 8 (max - min) / 255`` of the input, below plain
round-to-nearest int4's ``(max - min) / 30``. Adding the low plane's correction ``(lo - 7.5) s`` gives the 8-bit
reconstruction ``q8 s + z`` back. Used by the mixed-precision cache (`h2o_compress.cache.refinement`).
"""

from __future__ import annotations

import torch

from h2o_compress.formats.base import StoredTensor
from h2o_compress.formats.integer import IntQuantizer

CENTRE = 7.5  # the middle of the 16 low-plane codes


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 16 ``[..., head_dim]`` -> two per byte ``[..., head_dim / 2]`` (even element in the low nibble,
    [`IntQuantizer`][h2o_compress.formats.IntQuantizer]'s int4 layout)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


class SplitIntQuantizer(IntQuantizer):
    """4-bit integers that are the high plane of an 8-bit code (see the module docstring).

    `quantize` stores what [`IntQuantizer`][h2o_compress.formats.IntQuantizer] with ``bits=4`` stores (same parts, shapes and dtypes:
    ``data`` uint8 ``[batch, kv_heads, seq, head_dim / 2]``, ``scale_zero`` fp16 ``[..., head_dim / group_size,
    2]``), so every int4 reader dequantizes it; `quantize_split` also returns the low plane, and
    `correction` turns a low plane into what restores the 8-bit value.

    Raises:
        ConfigError: ``group_size`` not dividing ``head_dim``.
    """

    def __init__(self, group_size: int, head_dim: int, rotate: bool = True):
        super().__init__(4, group_size, head_dim, rotate)

    def quantize(self, x: torch.Tensor) -> StoredTensor:
        """The high plane of ``x`` ``[batch, kv_heads, seq, head_dim]`` (in `rotation`'s basis)."""
        return self.quantize_split(x)[0]

    def quantize_split(self, x: torch.Tensor) -> tuple[StoredTensor, torch.Tensor]:
        """``x`` ``[batch, kv_heads, seq, head_dim]`` -> (the high plane as a [`StoredTensor`][h2o_compress.formats.StoredTensor], the low plane
        uint8 ``[batch, kv_heads, seq, head_dim / 2]``, packed two codes per byte like int4 data).

        The 8-bit code is round-to-nearest against the scale and zero as stored (fp16), as [`IntQuantizer`][h2o_compress.formats.IntQuantizer]
        does: ``s = fp16((max - min) / 255)``, ``z' = fp16(min + 7.5 s)``, ``q8 = round((x - z' + 7.5 s) / s)``.
        """
        x = x.float()
        groups = x.unflatten(-1, (self.head_dim // self.group_size, self.group_size))
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low).div_(255).clamp_(min=1e-6).half().float()
        centre_zero = (low + CENTRE * scale).half()
        zero = centre_zero.float() - CENTRE * scale  # the 8-bit code's zero, exactly what dequantization uses
        q = (groups - zero).div_(scale).round_().clamp_(0, 255).to(torch.uint8).flatten(-2)
        scale_zero = torch.cat(((scale * 16).half(), centre_zero), -1)
        return StoredTensor({"data": _pack(q >> 4), "scale_zero": scale_zero}), _pack(q & 15)

    def correction(self, low: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
        """What a low plane adds to its token's int4 reading: ``(lo - 7.5) x scale / 16``, fp32
        ``[..., head_dim]``, from ``low`` uint8 ``[..., head_dim / 2]`` and the token's stored ``scale_zero`` fp16
        ``[..., head_dim / group_size, 2]``."""
        codes = self._codes(low) - CENTRE
        return (codes * (scale_zero[..., :1].float() / 16)).flatten(-2)
