"""Fused GPU kernels over the compressed KV cache.

Nothing here imports Triton at package import time: :mod:`.decode_attention` (Triton) is imported lazily by
callers that run on a GPU, and :mod:`.reference` is its pure-torch specification.
"""


def power_of_two(n: int, minimum: int = 1) -> bool:
    """Whether ``n`` is a power of two ``>= minimum`` (the kernels' tile sizes: ``head_dim``, group, block)."""
    return n >= minimum and n & (n - 1) == 0
