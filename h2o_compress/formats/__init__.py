"""KV quantization stage: one small class per format, chosen by [`make_quantizer`][h2o_compress.formats.make_quantizer]."""

from __future__ import annotations

from h2o_compress.formats.base import GROUP_SIZES, KVQuantizer, StoredTensor, check_group_size, gather_tokens
from h2o_compress.formats.bitsandbytes import (
    BitsAndBytesQuantizer, FP4Quantizer, Int8BlockwiseQuantizer, NF4Quantizer,
)
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
    "eager_only_formats",
    "FORMATS",
    "GROUP_SIZES",
    "check_group_size",
    "NF4Quantizer",
    "FP4Quantizer",
    "Int8BlockwiseQuantizer",
]


#: The quantization formats by the name ``CompressionConfig.quant`` takes: each class declares the bits it stores
#: and what it supports ([`KVQuantizer`][h2o_compress.formats.KVQuantizer]'s class variables). Adding a format: one file and one line here.
FORMATS: dict[str, type[KVQuantizer]] = {
    "int": IntQuantizer,
    "nf4": NF4Quantizer,
    "fp4": FP4Quantizer,
    "int8-blockwise": Int8BlockwiseQuantizer,
}


def eager_only_formats() -> str:
    """``nf4, fp4, int8-blockwise``: the names of the registered formats that do not compile (``compilable``
    False), for the messages that refuse compiling them."""
    return ", ".join(name for name, cls in FORMATS.items() if not cls.compilable)


def make_quantizer(bits: int, quant: str, group_size: int, head_dim: int, rotate: bool = True) -> KVQuantizer:
    """The quantizer for one tensor (keys or values) stored in ``bits`` bits with format family ``quant`` (a key of
    `FORMATS`); 16 bits: no quantization.

    Raises:
        ConfigError: ``group_size`` does not divide ``head_dim``, or bitsandbytes is missing for its formats.
    """
    if bits == 16:
        return NoQuantizer()
    return FORMATS[quant].create(bits, group_size, head_dim, rotate)
