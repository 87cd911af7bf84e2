"""How the decode kernels launch, without importing Triton (the planner sizes their scratch offline): the split
count of flash-decoding (`split_count`), the launch options per storage width (`LAUNCH`), the bytes of a
layer's scratch (`decode_scratch_bytes`), and static addresses for buffers a CUDA graph replays.
"""

from dataclasses import dataclass

import torch


def power_of_two(n: int, minimum: int = 1) -> bool:
    """Whether ``n`` is a power of two ``>= minimum`` (the kernels' tile sizes: ``head_dim``, group, block)."""
    return n >= minimum and n & (n - 1) == 0


def mark_static_address(tensors) -> None:
    """Tell Dynamo these buffers keep their address (CUDA graphs replay them; transformers' StaticLayer does it);
    nothing while compiling."""
    if torch.compiler.is_compiling():
        return
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


H100_SMS = 132  # streaming multiprocessors of an H100/H200 SXM: the split plan of a device not at hand


def split_count(batch: int, kv_heads: int, tokens: int, block_tokens: int, sm_count: int = H100_SMS) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` of flash-decoding over ``tokens`` tokens: ``batch * kv_heads * num_splits``
    programs fill 2-4x ``sm_count`` once the sequence is long enough (at most ``4 * sm_count``, or one split when
    ``batch * kv_heads`` alone exceeds it); each split a multiple of ``block_tokens``, none empty, at least one."""
    blocks = max(1, -(-tokens // block_tokens))
    wanted = min(blocks, max(1, 4 * sm_count // (batch * kv_heads)))
    split_blocks = -(-blocks // wanted)
    return -(-blocks // split_blocks), split_blocks * block_tokens


@dataclass(frozen=True)
class LaunchOptions:
    """How the split pass runs (Triton's launch options; fixed per layer like the split count): ``block`` tokens
    per loop iteration, ``num_warps`` warps per program, a ``num_stages``-deep software pipeline of the store's loads
    (sm_80+), at most ``max_registers`` registers per thread (0: the compiler's choice; a cap trades spills for
    more programs per SM). ``benchmarks/kernel_bandwidth.py`` compares them. (Here, not in `h2o_compress.attention.slot_attention`:
    the planner sizes the scratch by the block without importing Triton.)

    Raises:
        ValueError: ``block`` not a power of two in [16, 256], ``num_warps`` not 1/2/4/8, ``num_stages`` not 1-6 or
            ``max_registers`` neither 0 nor in [32, 255].
    """

    block: int = 64
    num_warps: int = 4
    num_stages: int = 3
    max_registers: int = 0

    def __post_init__(self):
        if not power_of_two(self.block, 16) or self.block > 256:
            raise ValueError(f"block={self.block} tokens per iteration is not allowed; allowed: a power of two in "
                             "[16, 256]")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps={self.num_warps} is not allowed; allowed: 1, 2, 4, 8")
        if self.num_stages not in range(1, 7):
            raise ValueError(f"num_stages={self.num_stages} is not allowed; allowed: 1 to 6")
        if self.max_registers != 0 and self.max_registers not in range(32, 256):
            raise ValueError(f"max_registers={self.max_registers} is not allowed; allowed: 0 (no cap) or 32 to 255")


#: The launch by storage width (the narrower of keys and values), chosen without a GPU from the split pass's sm_90
#: resources at the LLaMA-7B (16k x 16 at 0.2) and SmolLM2 shapes (``benchmarks/results/kernel_bandwidth_cpu.md``):
#: the most bytes in flight per SM at both shapes with at most 16 bytes of spills. Narrower storage carries fewer
#: bytes per token, so it takes a deeper pipeline, and int4 twice the tokens per iteration too. A proxy, not a
#: timing: ``kernel_bandwidth.py --device cuda`` measures them on a card.
LAUNCH = {4: LaunchOptions(block=128, num_stages=5), 8: LaunchOptions(num_stages=4), 16: LaunchOptions()}


def launch_for(key_bits: int, value_bits: int) -> LaunchOptions:
    """`LAUNCH`'s options for a layer storing keys and values in ``key_bits`` / ``value_bits`` (4, 8, 16)."""
    return LAUNCH[min(key_bits, value_bits)]


def decode_scratch_bytes(batch: int, q_heads: int, kv_heads: int, head_dim: int, slots: int, ring: int,
                         with_scores: bool, sm_count: int = H100_SMS,
                         block_tokens: int = LaunchOptions.block) -> int:
    """Bytes of one layer's scratch for the Triton decode op (`slot_attention.DecodeScratch`): fp32 split
    partials ``(2 + head_dim) x splits`` and, with scores, logits ``slots + ring`` per query row. No Triton import
    (the planner sizes it offline)."""
    splits = split_count(batch, kv_heads, max(slots, 1), block_tokens, sm_count)[0]
    if ring:
        splits += split_count(batch, kv_heads, ring, block_tokens, sm_count)[0]
    return 4 * batch * q_heads * ((2 + head_dim) * splits + ((slots + ring) if with_scores else 1))
