"""Fused GPU kernels over the compressed KV cache.

Nothing here imports Triton at package import time: :mod:`.decode_attention` (Triton) is imported lazily by
callers that run on a GPU, and :mod:`.reference` is its pure-torch specification.
"""


def power_of_two(n: int, minimum: int = 1) -> bool:
    """Whether ``n`` is a power of two ``>= minimum`` (the kernels' tile sizes: ``head_dim``, group, block)."""
    return n >= minimum and n & (n - 1) == 0


H100_SMS = 132  # streaming multiprocessors of an H100/H200 SXM: the split plan of a device not at hand


def split_count(batch: int, kv_heads: int, tokens: int, block_tokens: int, sm_count: int = H100_SMS) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` of flash-decoding over ``tokens`` tokens: ``batch * kv_heads * num_splits``
    programs fill 2-4x ``sm_count`` once the sequence is long enough (at most ``4 * sm_count``, or one split when
    ``batch * kv_heads`` alone exceeds it); each split a multiple of ``block_tokens``, none empty, at least one."""
    blocks = max(1, -(-tokens // block_tokens))
    wanted = min(blocks, max(1, 4 * sm_count // (batch * kv_heads)))
    split_blocks = -(-blocks // wanted)
    return -(-blocks // split_blocks), split_blocks * block_tokens


def decode_scratch_bytes(batch: int, q_heads: int, kv_heads: int, head_dim: int, slots: int, ring: int,
                         with_scores: bool, sm_count: int = H100_SMS, block_tokens: int = 64) -> int:
    """Bytes of one layer's scratch for the Triton decode op (:class:`.slot_attention.DecodeScratch`): fp32 split
    partials ``(2 + head_dim) x splits`` and, with scores, logits ``slots + ring`` per query row. No Triton import
    (the planner sizes it offline)."""
    splits = split_count(batch, kv_heads, max(slots, 1), block_tokens, sm_count)[0]
    if ring:
        splits += split_count(batch, kv_heads, ring, block_tokens, sm_count)[0]
    return 4 * batch * q_heads * ((2 + head_dim) * splits + ((slots + ring) if with_scores else 1))
