"""Attention over the compressed KV cache: the ``h2o_compress`` attention function and its decode kernels.

- `h2o_compress.attention.interface`: the attention function transformers calls (``AttentionInterface``), the one hand-off
  from a cache layer to it (``announce``), and the chunked H2O scorer.
- `h2o_compress.attention.decode_step`: a layer's decode step as the attention function runs it (`DecodeCall`: which
  kernel, on which buffers), and the torch form of decode attention over the slots.
- `h2o_compress.attention.buffers`: what a decode kernel reads and writes of a layer, as plain tensors and sizes (the kernels
  take these, never a cache object).
- `h2o_compress.attention.prefill`: a scored multi-token step in one pass (attention output and H2O column sums from one softmax);
  on the CPU one native call (``cpu_prefill.c``, built with the decode kernel by `h2o_compress.attention.cpu`).
- `h2o_compress.attention.cpu` (+ ``cpu_decode.c``): a layer's whole decode step in one native call on the CPU (a custom op under
  ``torch.compile``).
- `h2o_compress.attention.slot_attention`: the Triton op ``h2o_compress::slot_decode_attention``, decode attention over the slots
  on CUDA with the H2O scores fused; `h2o_compress.attention.launch`: its split plan and launch options (no Triton import).
- `h2o_compress.attention.prefix_attention` (Triton flash-decoding over stored tensors, a benchmark reference) and
  `h2o_compress.attention.reference` (its pure-torch specification).

Importing this package imports neither Triton nor the native kernel: the kernel modules load on first use.
"""

from h2o_compress.attention.decode_step import DecodeCall, decode_attention
from h2o_compress.attention.interface import (
    ATTENTION_NAME, announce, attention_probability_sums, check_attention_backend, h2o_attention_forward,
    register_attention, use_h2o_attention, withdraw,
)

__all__ = [
    "ATTENTION_NAME", "DecodeCall", "announce", "attention_probability_sums", "check_attention_backend",
    "decode_attention", "h2o_attention_forward", "register_attention", "use_h2o_attention", "withdraw",
]
