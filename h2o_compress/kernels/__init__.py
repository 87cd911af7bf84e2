"""Fused GPU kernels over the compressed KV cache.

Nothing here imports Triton at package import time: :mod:`.decode_attention` (Triton) is imported lazily by
callers that run on a GPU, and :mod:`.reference` is its pure-torch specification.
"""
