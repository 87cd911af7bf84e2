"""KV quantization stage: one small class per format, chosen by :func:`make_quantizer`."""

from __future__ import annotations

from h2o_compress.formats.base import KVQuantizer, StoredTensor, gather_tokens
from h2o_compress.formats.bitsandbytes import BitsAndBytesQuantizer
from h2o_compress.formats.integer import IntQuantizer, hadamard_matrix
from h2o_compress.formats.none import NoQuantizer

__all__ = [
    "KVQuantizer",
    "StoredTensor",
    "gather_tokens",
    "IntQuantizer",
    "BitsAndBytesQuantizer",
    "NoQuantizer",
    "hadamard_matrix",
    "make_quantizer",
]


def make_quantizer(bits: int, quant: str, group_size: int, head_dim: int, rotate: bool = True) -> KVQuantizer:
    """The quantizer for one tensor (keys or values) stored in ``bits`` bits with format family ``quant``.

    ``quant="int"``: :class:`IntQuantizer`. ``nf4``/``fp4``: bitsandbytes 4-bit for 4-bit tensors and
    blockwise 8-bit for 8-bit tensors. ``int8-blockwise``: bitsandbytes blockwise 8-bit. 16 bits: no
    quantization.
    """
    if bits == 16:
        return NoQuantizer()
    if quant == "int":
        return IntQuantizer(bits, group_size, head_dim, rotate)
    fmt = quant if bits == 4 else "int8"
    return BitsAndBytesQuantizer(fmt, group_size, head_dim)
