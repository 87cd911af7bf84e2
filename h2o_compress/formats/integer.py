"""Group-wise asymmetric integer quantization of keys/values (int8, int4 packed two per byte).

Per-token groups of ``group_size`` along ``head_dim``, min-max scale and zero point in fp16 (KIVI,
Liu et al. 2024, arXiv 2402.02750 §3; llama.cpp q4_1-style asymmetric blocks). An optional orthogonal
Hadamard rotation along ``head_dim`` (QuaRot, Ashkboos et al. 2024, arXiv 2404.00456) spreads outlier
channels over all groups before quantization. The rotation is applied by the cache when tokens arrive and
folded into the query and the attention output (``q.k = (qH).(kH)``, ``P.V = (P.(VH)).H``), so dequantized
tokens are never rotated back.
"""

from __future__ import annotations

import functools

import torch

from typing import ClassVar

from h2o_compress.utils.errors import ConfigError
from h2o_compress.formats.base import KVQuantizer, StoredTensor, check_group_size


@functools.lru_cache(maxsize=32)
def hadamard_matrix(dim: int, device: str = "cpu") -> torch.Tensor:
    """Orthonormal, symmetric block-Hadamard matrix ``[dim, dim]`` (fp32).

    Blocks have the largest power-of-two size dividing ``dim`` (Sylvester construction), so ``H @ H = I``.
    Built outside inference mode: the cached matrix must stay usable when the caller later runs with autograd on.
    """
    with torch.inference_mode(False):
        block = dim & -dim  # largest power of two dividing dim
        h = torch.ones(1, 1)
        while h.shape[0] < block:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        h = h / block**0.5
        return torch.block_diag(*([h] * (dim // block))).to(device)


class IntQuantizer(KVQuantizer):
    """Asymmetric ``bits``-bit integers, one fp16 (scale, zero) pair per ``group_size`` elements of a token.

    Stored parts: ``data`` uint8 ``[batch, kv_heads, seq, head_dim * bits / 8]`` and ``scale_zero`` fp16
    ``[batch, kv_heads, seq, head_dim / group_size, 2]``. Inputs are expected in [`rotation`][h2o_compress.formats.IntQuantizer.rotation]'s basis.
    Round-trip error per element is at most ``scale / 2`` plus fp16 rounding of the zero point, ``scale = (max - min) / (2**bits - 1)``.

    Raises:
        ConfigError: ``bits`` not 4 or 8, or ``group_size`` not dividing ``head_dim``.
    """

    supported_bits: ClassVar[tuple[int, ...]] = (4, 8)
    rotates: ClassVar[bool] = True
    mixed_precision: ClassVar[bool] = True

    @classmethod
    def create(cls, bits: int, group_size: int, head_dim: int, rotate: bool = True) -> "IntQuantizer":
        return cls(bits, group_size, head_dim, rotate)

    @classmethod
    def label(cls, bits: int) -> str:
        """``int4``, ``int8``."""
        return f"int{bits}"

    def __init__(self, bits: int, group_size: int, head_dim: int, rotate: bool = True):
        if bits not in (4, 8):
            raise ConfigError(f"integer quantization supports 4 or 8 bits, got {bits}")
        check_group_size(group_size, head_dim)
        self.bits, self.group_size, self.head_dim, self.rotate = bits, group_size, head_dim, rotate
        self.qmax = 2**bits - 1

    def rotation(self, device: torch.device) -> torch.Tensor | None:
        """The Hadamard basis inputs must be in (``x @ H``) when ``rotate``; see [`KVQuantizer.rotation`][h2o_compress.formats.KVQuantizer.rotation]."""
        return hadamard_matrix(self.head_dim, str(device)) if self.rotate else None

    def quantize(self, x: torch.Tensor) -> StoredTensor:
        """Quantize ``x`` ``[batch, kv_heads, seq, head_dim]`` (any float dtype, already in [`rotation`][h2o_compress.formats.IntQuantizer.rotation]'s
        basis)."""
        x = x.float()
        groups = x.unflatten(-1, (self.head_dim // self.group_size, self.group_size))
        low = groups.amin(-1, keepdim=True)
        high = groups.amax(-1, keepdim=True)
        scale_zero = torch.cat(((high - low).div_(self.qmax).clamp_(min=1e-6), low), -1).half()
        scale, zero = scale_zero.float().unbind(-1)
        q = (groups - zero.unsqueeze(-1)).div_(scale.unsqueeze(-1)).round_().clamp_(0, self.qmax)
        q = q.to(torch.uint8).flatten(-2)
        if self.bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        return StoredTensor({"data": q, "scale_zero": scale_zero})

    def _codes(self, data: torch.Tensor) -> torch.Tensor:
        """Integer codes as fp32 ``[..., head_dim / group_size, group_size]`` (int4: low nibble first)."""
        if self.bits == 4:
            codes = torch.stack((data & 15, data >> 4), -1).float()
        else:
            codes = data.float()
        return codes.view(*data.shape[:-1], self.head_dim // self.group_size, self.group_size)

    def dequantize(self, stored: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
        """Return ``[batch, kv_heads, seq, head_dim]`` in ``dtype``."""
        data = stored.parts["data"]
        out = torch.empty(*data.shape[:-1], self.head_dim, dtype=dtype, device=data.device)
        self.dequantize_into(stored, out)
        return out

    def dequantize_into(self, stored: StoredTensor, out: torch.Tensor) -> None:
        """``codes x scale + zero`` written straight into ``out`` (see [`KVQuantizer.dequantize_into`][h2o_compress.formats.KVQuantizer.dequantize_into])."""
        scale_zero = stored.parts["scale_zero"].float()
        codes = self._codes(stored.parts["data"])
        target = out.unflatten(-1, (self.head_dim // self.group_size, self.group_size))
        if out.dtype == torch.float32 and not torch.compiler.is_compiling():  # Dynamo takes no strided out=
            torch.addcmul(scale_zero[..., 1:], codes, scale_zero[..., :1], out=target)
        else:
            target.copy_(torch.addcmul(scale_zero[..., 1:], codes, scale_zero[..., :1]))

