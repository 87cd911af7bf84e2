"""The decode attention of one compressed layer over its slot layout, as the PyTorch op
``h2o_compress::slot_decode_attention`` (Triton; traced by Dynamo, replayed by CUDA graphs).

A [`CompressedLayer`][h2o_compress.cache.CompressedLayer] holds, per (sequence, KV head), ``slots`` stored tokens
(int4/int8 codes with an fp16 ``(scale, zero)`` pair per group, or raw 16-bit), each valid where its position is
``>= 0``, and a full-precision ring of ``residual`` tokens, valid where the ring's position is ``>= 0``
(docs/DESIGN.md §5, cold-compress's layout). This op is the whole attention + H2O scoring of one decode step over
those buffers in two kernel launches, with no host sync and no allocation but the output:

``_slot_partial_kernel``  grid ``(batch * kv_heads, store_splits + ring_splits)``: flash-decoding (Dao et al.
    2023) over a fixed number of splits chosen once per layer shape (`plan_splits`). Each program runs an
    online softmax of the ``G`` query heads of one KV head over its slots (K/V read once per KV head, GQA),
    dequantizing in registers, skipping invalid slots and every slot at or past the live bound ``min(slots,
    seen)`` read from the device (slots fill lowest first, so no token sits higher). The token that leaves the
    ring this step is read at full precision from ``leave_keys``/``leave_values`` in its new slot (its last step
    unquantized, as in the torch form). With scores it also writes the scaled logits to the ``logits`` scratch.
``_slot_combine_kernel``  grid ``(batch * kv_heads, cdiv(slots + residual, BLOCK_T))``: every program merges the
    splits' ``(max, sum-exp)`` of its ``G`` query rows into the log-sum-exp; the programs of the first token
    block also write the output; each program then turns its block of logits into probabilities summed over the
    ``G`` query heads and adds them to (``accumulate``) or writes them over (TOVA) the layer's score buffers in
    place: H2O's accumulated attention (Zhang et al. 2023, arXiv 2306.14048 §4), fused into the same pass.

With the layer's Hadamard bases (``key_basis``/``value_basis``) the split pass rotates the query into the keys'
basis and the combine rotates the output back from the values' basis (fp32 ``tl.dot`` against the ``[D, D]``
matrix, ``DC`` rows at a time), so neither rotation is a matmul launch of its own (issue 14: kernels per layer).

The scratch (split partials, logits) is owned by the layer (`DecodeScratch`, allocated once) and passed in
as mutated arguments. Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from h2o_compress.attention.launch import LaunchOptions, launch_for, mark_static_address, power_of_two
from h2o_compress.attention.prefix_attention import _load_tokens, _sm_count, choose_splits
from h2o_compress.formats import IntQuantizer, NoQuantizer

BLOCK_T = 256  # tokens per program of the combine kernel's score pass
BLOCK_S = 8  # split partials merged per iteration of the combine kernel


@triton.jit
def _attend_block(qv, m_i, l_i, acc, kt, vt, valid, scaling, logits_row_ptr, head_mask, offs_t,
                  WRITE_LOGITS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One block of the online softmax (``kt``/``vt`` fp32 ``[BLOCK, D]``, ``valid`` bool ``[BLOCK]``); a block
    with no valid token leaves ``(m_i, l_i, acc)`` as they were (exp against a finite base)."""
    s = tl.dot(qv, tl.trans(kt.to(DOT)), input_precision=PRECISION) * scaling
    s = tl.where(valid[None, :], s, float("-inf"))
    if WRITE_LOGITS:
        tl.store(logits_row_ptr + offs_t[None, :], s, mask=head_mask[:, None] & valid[None, :])
    m_new = tl.maximum(m_i, tl.max(s, 1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - base)
    p = tl.exp(s - base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vt.to(DOT), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _leave_row(ptr, bh, offs_d, held, D: tl.constexpr, FMT: tl.constexpr, DQ: tl.constexpr):
    """The leaving token's ``[D]`` keys or values for a block's select: ``held`` (loaded before the loop) for 16-bit
    storage, else loaded again here (an L1 hit after the first block). With dequantization in the loop, the held
    vector's broadcast over the tile layout took ~50 registers per thread for the whole loop (sm_90, int4,
    head_dim 128: 219 -> 168, one more program per SM); with 16-bit storage the reload cost registers instead
    (SmolLM2 shape: 128 -> 134). ``benchmarks/kernel_bandwidth.py`` measures both."""
    if FMT == 16:
        row = held
    else:
        row = tl.load(ptr + bh.to(tl.int64) * D + offs_d).to(DQ)
    return row


@triton.jit
def _slot_partial_kernel(
    q, q_b, q_h,
    k, ksz, k_b, k_h, k_n, ksz_b, ksz_h, ksz_n,
    v, vsz, v_b, v_h, v_n, vsz_b, vsz_h, vsz_n,
    pos, lk, lv, leave_slot,
    rk, rv, r_b, r_h, r_n, rpos,
    seen, part_m, part_l, part_acc, logits, qb,
    slots, ring_size, store_splits, split_tokens, ring_split_tokens, num_slots, total, scaling,
    KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr, BLOCK: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, ROTATE_Q: tl.constexpr = False, DC: tl.constexpr = 32,
    DQ: tl.constexpr = tl.float32,
):
    """Split ``split`` of (sequence ``b``, KV head ``h``): store slots ``[split * split_tokens, +split_tokens)``
    below the live bound, or (``split >= store_splits``) ring slots. Writes ``part_m``/``part_l`` ``[batch *
    q_heads, num_slots]`` and ``part_acc`` ``[batch * q_heads, num_slots, D]`` at ``split``; with
    ``WRITE_LOGITS`` the scaled logits of valid tokens to ``logits[batch * q_heads, total]`` (store ``t`` at
    ``t``, ring ``r`` at ``slots + r``). ``pos`` int32 ``[batch, kv_heads, slots]``, ``rpos`` int32 ``[batch,
    ring_size]`` (contiguous), ``lk``/``lv`` ``[batch, kv_heads, D]`` and ``leave_slot`` int64 ``[batch,
    kv_heads]`` (contiguous)."""
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = (bh // KV_HEADS).to(tl.int64), (bh % KV_HEADS).to(tl.int64)  # 64-bit offsets into big caches
    heads = tl.arange(0, GP)
    head_mask = heads < G
    rows = bh * G + heads  # = b * q_heads + h * G + r
    offs_d = tl.arange(0, D)
    if ROTATE_Q:  # q @ H (the keys' basis, fp32 [D, D]) in fp32, DC rows of H at a time, rounded as q
        offs_c = tl.arange(0, DC)
        qf = tl.zeros((GP, D), tl.float32)
        for c0 in tl.static_range(0, D, DC):
            qc = tl.load(q + b * q_b + (h * G + heads)[:, None] * q_h + (c0 + offs_c)[None, :],
                         mask=head_mask[:, None], other=0.0).to(tl.float32)
            hc = tl.load(qb + (c0 + offs_c)[:, None] * D + offs_d[None, :])
            qf += tl.dot(qc, hc, input_precision="ieee")
        qv = qf.to(q.dtype.element_ty).to(DOT)
    else:
        qv = tl.load(q + b * q_b + (h * G + heads)[:, None] * q_h + offs_d[None, :],
                     mask=head_mask[:, None], other=0.0).to(DOT)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    logits_rows = logits + rows[:, None].to(tl.int64) * total
    if split < store_splits:
        live = tl.minimum(tl.load(seen), slots).to(tl.int32)
        start = split * split_tokens
        end = tl.minimum(start + split_tokens, live)
        leave = tl.load(leave_slot + bh)
        leave_k = tl.load(lk + bh.to(tl.int64) * D + offs_d).to(DQ)
        leave_v = tl.load(lv + bh.to(tl.int64) * D + offs_d).to(DQ)
        for n0 in range(start, end, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            in_range = offs_n < end
            valid = in_range & (tl.load(pos + bh.to(tl.int64) * slots + offs_n, mask=in_range, other=-1) >= 0)
            is_leave = (offs_n == leave)[:, None]
            kt = _load_tokens(k, ksz, k_b, k_h, k_n, ksz_b, ksz_h, ksz_n, b, h, offs_n, in_range, D, GROUP, K_FMT,
                              BLOCK, DQ)
            vt = _load_tokens(v, vsz, v_b, v_h, v_n, vsz_b, vsz_h, vsz_n, b, h, offs_n, in_range, D, GROUP, V_FMT,
                              BLOCK, DQ)
            kt = tl.where(is_leave, _leave_row(lk, bh, offs_d, leave_k, D, K_FMT, DQ)[None, :], kt)
            vt = tl.where(is_leave, _leave_row(lv, bh, offs_d, leave_v, D, V_FMT, DQ)[None, :], vt)
            m_i, l_i, acc = _attend_block(qv, m_i, l_i, acc, kt, vt, valid, scaling, logits_rows, head_mask,
                                          offs_n, WRITE_LOGITS, DOT, PRECISION)
    else:
        start = (split - store_splits) * ring_split_tokens
        end = tl.minimum(start + ring_split_tokens, ring_size)
        # The ring holds `residual` tokens (3 by default): one or two blocks, nothing to pipeline; its pipeline
        # buffers would take shared memory from the store's (sm_90, int4: 72 -> 40 KiB; kernel_bandwidth.py).
        for n0 in tl.range(start, end, BLOCK, num_stages=1):
            offs_n = n0 + tl.arange(0, BLOCK)
            in_range = offs_n < end
            valid = in_range & (tl.load(rpos + b * ring_size + offs_n, mask=in_range, other=-1) >= 0)
            kt = _load_tokens(rk, rk, r_b, r_h, r_n, 0, 0, 0, b, h, offs_n, in_range, D, GROUP, 16, BLOCK)
            vt = _load_tokens(rv, rv, r_b, r_h, r_n, 0, 0, 0, b, h, offs_n, in_range, D, GROUP, 16, BLOCK)
            m_i, l_i, acc = _attend_block(qv, m_i, l_i, acc, kt, vt, valid, scaling, logits_rows + slots, head_mask,
                                          offs_n, WRITE_LOGITS, DOT, PRECISION)
    slot = rows * num_slots + split
    tl.store(part_m + slot, m_i, mask=head_mask)
    tl.store(part_l + slot, l_i, mask=head_mask)
    tl.store(part_acc + slot[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=head_mask[:, None])


@triton.jit
def _slot_combine_kernel(
    part_m, part_l, part_acc, out, logits, pos, rpos, seen, scores, ring_scores, vb,
    slots, ring_size, num_slots, total,
    KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr, SCORES: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_RING: tl.constexpr,
    ROTATE_OUT: tl.constexpr = False, DC: tl.constexpr = 32,
):
    """Log-sum-exp of the ``G`` query rows of KV head ``bh`` from the splits; output ``out[row, :D]`` (block 0);
    with ``SCORES``, the probabilities of token block ``program_id(1)`` summed over the rows, added to (or, without
    ``ACCUMULATE``, written over) ``scores`` fp32 ``[batch, kv_heads, slots]`` and ``ring_scores`` ``[batch,
    kv_heads, ring_size]`` (0 for invalid tokens)."""
    bh, block = tl.program_id(0), tl.program_id(1)
    heads = tl.arange(0, GP)
    head_mask = heads < G
    rows = bh * G + heads
    big = tl.full((GP,), float("-inf"), tl.float32)
    for s0 in range(0, num_slots, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask = head_mask[:, None] & (offs_s < num_slots)[None, :]
        m = tl.load(part_m + rows[:, None] * num_slots + offs_s[None, :], mask=mask, other=float("-inf"))
        big = tl.maximum(big, tl.max(m, 1))
    big = tl.where(head_mask, big, 0.0)
    norm = tl.zeros((GP,), tl.float32)
    for s0 in range(0, num_slots, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask = head_mask[:, None] & (offs_s < num_slots)[None, :]
        at = rows[:, None] * num_slots + offs_s[None, :]
        w = tl.exp(tl.load(part_m + at, mask=mask, other=float("-inf")) - big[:, None])
        norm += tl.sum(w * tl.load(part_l + at, mask=mask, other=0.0), 1)
    norm = tl.where(head_mask, norm, 1.0)
    if block == 0:
        offs_d = tl.arange(0, D)
        if ROTATE_OUT:  # (P.V) @ H (the values' basis, fp32 [D, D]): DC columns of P.V at a time, in fp32
            offs_c = tl.arange(0, DC)
            acc = tl.zeros((GP, D), tl.float32)
            for c0 in tl.static_range(0, D, DC):
                part = tl.zeros((GP, DC), tl.float32)
                for s0 in range(0, num_slots):
                    at = rows * num_slots + s0
                    w = tl.exp(tl.load(part_m + at, mask=head_mask, other=float("-inf")) - big)
                    part += w[:, None] * tl.load(part_acc + at[:, None].to(tl.int64) * D + (c0 + offs_c)[None, :],
                                                 mask=head_mask[:, None], other=0.0)
                hc = tl.load(vb + (c0 + offs_c)[:, None] * D + offs_d[None, :])
                acc += tl.dot(part / norm[:, None], hc, input_precision="ieee")
            tl.store(out + rows[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=head_mask[:, None])
        else:
            acc = tl.zeros((GP, D), tl.float32)
            for s0 in range(0, num_slots):
                at = rows * num_slots + s0
                w = tl.exp(tl.load(part_m + at, mask=head_mask, other=float("-inf")) - big)
                acc += w[:, None] * tl.load(part_acc + at[:, None].to(tl.int64) * D + offs_d[None, :],
                                            mask=head_mask[:, None], other=0.0)
            tl.store(out + rows[:, None].to(tl.int64) * D + offs_d[None, :], acc / norm[:, None],
                     mask=head_mask[:, None])
    if SCORES:
        lse = big + tl.log(norm)
        offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        live = tl.minimum(tl.load(seen), slots).to(tl.int32)
        in_store = offs_t < live
        store_valid = in_store & (tl.load(pos + bh.to(tl.int64) * slots + offs_t, mask=in_store, other=-1) >= 0)
        valid = store_valid
        ring_t = offs_t - slots
        in_ring = (offs_t >= slots) & (offs_t < total)
        if HAS_RING:
            b = (bh // KV_HEADS).to(tl.int64)
            ring_valid = in_ring & (tl.load(rpos + b * ring_size + ring_t, mask=in_ring, other=-1) >= 0)
            valid = valid | ring_valid
        seen_by = head_mask[:, None] & valid[None, :]
        x = tl.load(logits + rows[:, None].to(tl.int64) * total + offs_t[None, :], mask=seen_by, other=float("-inf"))
        p = tl.sum(tl.where(seen_by, tl.exp(x - lse[:, None]), 0.0), 0)
        store_at = scores + bh.to(tl.int64) * slots + offs_t
        if ACCUMULATE:
            tl.store(store_at, tl.load(store_at, mask=store_valid, other=0.0) + p, mask=store_valid)
        else:
            tl.store(store_at, p, mask=offs_t < slots)
        if HAS_RING:
            ring_at = ring_scores + bh.to(tl.int64) * ring_size + ring_t
            if ACCUMULATE:
                tl.store(ring_at, tl.load(ring_at, mask=ring_valid, other=0.0) + p, mask=ring_valid)
            else:
                tl.store(ring_at, p, mask=in_ring)


@dataclass(frozen=True)
class SplitPlan:
    """The fixed launch of one layer shape: ``store_splits`` splits of ``split_tokens`` slots, then ``ring_splits``
    of ``ring_split_tokens`` ring slots (each a multiple of ``launch.block``), run with ``launch``."""

    store_splits: int
    split_tokens: int
    ring_splits: int
    ring_split_tokens: int
    launch: LaunchOptions = LaunchOptions()

    @property
    def num_slots(self) -> int:
        """Split partials per query row."""
        return self.store_splits + self.ring_splits


def plan_splits(batch: int, kv_heads: int, slots: int, ring_size: int, sm_count: int | None = None,
                device: torch.device | None = None, launch: LaunchOptions = LaunchOptions()) -> SplitPlan:
    """The split counts for ``slots`` store slots and a ring of ``ring_size`` (chosen once per layer shape from the
    capacity, never per call: `choose_splits`, 2-4 programs per SM),
    in blocks of ``launch.block`` tokens."""
    sms = sm_count if sm_count is not None else _sm_count(device or torch.device("cpu"))
    store_splits, split_tokens = choose_splits(batch, kv_heads, max(slots, 1), launch.block, sms)
    ring_splits, ring_split_tokens = (0, launch.block) if ring_size == 0 else choose_splits(
        batch, kv_heads, ring_size, launch.block, sms)
    return SplitPlan(store_splits, split_tokens, ring_splits, ring_split_tokens, launch)


class DecodeScratch:
    """fp32 scratch of one layer's decode step, allocated once for its shape: split partials ``part_m``/``part_l``
    ``[batch * q_heads, num_slots]``, ``part_acc`` ``[batch * q_heads, num_slots, head_dim]`` and, with scores,
    ``logits`` ``[batch * q_heads, slots + ring_size]`` (else a 1-element placeholder), at static addresses (a
    captured CUDA graph replays them)."""

    def __init__(self, plan: SplitPlan, batch: int, q_heads: int, head_dim: int, tokens: int, with_scores: bool,
                 device: torch.device):
        rows = batch * q_heads
        self.plan, self.key = plan, (batch, q_heads, tokens, with_scores)
        self.part_m = torch.empty(rows, plan.num_slots, device=device)
        self.part_l = torch.empty(rows, plan.num_slots, device=device)
        self.part_acc = torch.empty(rows, plan.num_slots, head_dim, device=device)
        self.logits = torch.empty(rows, tokens if with_scores else 1, device=device)
        mark_static_address(self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.part_m, self.part_l, self.part_acc, self.logits

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def device_reason(device: torch.device) -> str | None:
    """Why the op cannot run on ``device`` at all (it runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``), or
    ``None``."""
    if device.type != "cuda" and not isinstance(_slot_partial_kernel, InterpretedFunction):
        return f"the Triton kernel runs on CUDA (or under TRITON_INTERPRET=1), not on {device}"
    return None


def supported(device: torch.device, head_dim: int, formats) -> str | None:
    """Why the op cannot run a layer with ``head_dim`` and key/value quantizers ``formats`` on ``device``, or
    ``None``: it takes int4/int8 (``IntQuantizer``, power-of-two groups) and raw 16-bit storage, ``head_dim`` a
    power of two >= 16, on CUDA (or on the CPU under ``TRITON_INTERPRET=1``)."""
    reason = device_reason(device)
    if reason is not None:
        return reason
    if not power_of_two(head_dim, 16):
        return f"head_dim={head_dim} is not a power of two >= 16"
    for f in formats:
        if type(f) not in (IntQuantizer, NoQuantizer):
            return f"the {type(f).__name__} format is not read by the Triton kernel (int or 16-bit only)"
        if type(f) is IntQuantizer and not power_of_two(f.group_size, 2):
            return f"group_size={f.group_size} is not a power of two"
    return None


def _parts(data: torch.Tensor, scale_zero: torch.Tensor | None, bits: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(data, scale_zero, format)`` for the kernel: 16-bit storage passes its data twice."""
    return (data, data, 16) if bits == 16 else (data, scale_zero, bits)


def _slot_decode_attention(
    query: torch.Tensor, k_data: torch.Tensor, k_scale_zero: torch.Tensor | None, v_data: torch.Tensor,
    v_scale_zero: torch.Tensor | None, positions: torch.Tensor, leave_keys: torch.Tensor, leave_values: torch.Tensor,
    leave_slot: torch.Tensor, ring_keys: torch.Tensor | None, ring_values: torch.Tensor | None,
    ring_positions: torch.Tensor | None, seen: torch.Tensor, scores: torch.Tensor | None,
    ring_scores: torch.Tensor | None, part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor,
    logits: torch.Tensor, scaling: float, key_bits: int, value_bits: int, group_size: int, store_splits: int,
    split_tokens: int, ring_splits: int, ring_split_tokens: int, accumulate: bool,
    key_basis: torch.Tensor | None = None, value_basis: torch.Tensor | None = None,
    block: int = LaunchOptions.block, num_warps: int = LaunchOptions.num_warps,
    num_stages: int = LaunchOptions.num_stages, max_registers: int = LaunchOptions.max_registers,
) -> torch.Tensor:
    """Attention of one decode query over a layer's slots and ring, plus the fused H2O score update.

    Args:
        query: ``[batch, q_heads, head_dim]`` fp16/bf16/fp32, last dim contiguous, in the keys' basis.
        v_data: as ``k_data``, for the values.
        k_data: the store's parts ``[batch, kv_heads, slots, ...]``: uint8 codes (``*_bits`` 4/8) with fp16
            ``*_scale_zero`` ``[batch, kv_heads, slots, head_dim / group_size, 2]``, or raw 16-bit (bits 16,
            scale_zero ``None``); last dims dense.
        positions: int32 ``[batch, kv_heads, slots]`` (``-1`` = empty), contiguous.
        leave_values: as ``leave_keys``, for the values.
        leave_keys: ``[batch, kv_heads, head_dim]`` contiguous: this step's token entering the store,
            at full precision, read instead of its slot ``leave_slot`` (int64 ``[batch, kv_heads]``, contiguous).
        ring_values: as ``ring_keys``, for the values.
        ring_keys: ``[batch, kv_heads, ring, head_dim]`` (last dim dense) with int32
            ``ring_positions`` ``[batch, ring]`` (contiguous), or all ``None``.
        seen: int64 0-dim, tokens seen (this one included): slots at or past ``min(slots, seen)`` are not read.
        ring_scores: fp32 ``[batch, kv_heads, ring]``, the ring's scores, as ``scores``.
        scores: fp32 ``[batch, kv_heads, slots]``, contiguous, updated in
            place (``accumulate``: ``+=`` this query's probabilities summed over each KV head's query heads; else
            ``=``); ``scores`` ``None`` for no scoring.
        part_m: the layer's `DecodeScratch` (overwritten).
        part_l: the layer's `DecodeScratch` (overwritten).
        part_acc: the layer's `DecodeScratch` (overwritten).
        logits: the layer's `DecodeScratch` (overwritten).
        scaling: softmax scale.
        key_bits: 4, 8 or 16.
        value_bits: 4, 8 or 16.
        group_size: quantization group (power of two).
        store_splits: the layer's `SplitPlan`.
        split_tokens: the layer's `SplitPlan`.
        ring_splits: the layer's `SplitPlan`.
        ring_split_tokens: the layer's `SplitPlan`.
        value_basis: as ``key_basis``, for the values.
        key_basis: the layer's orthonormal, symmetric bases fp32 ``[head_dim, head_dim]``
            contiguous (the Hadamard rotation of the stored keys / values, ``formats/integer.py``), or ``None``:
            with ``key_basis`` the query is given in the model's basis and rotated in the first launch
            (``(q @ H)`` in fp32, rounded to ``query.dtype``, as the torch form does); with ``value_basis`` the
            output is rotated back (``@ H``, fp32) in the second, so neither costs a launch of its own.
        block: the split pass's `LaunchOptions` block (the split sizes must be multiples of it).
        num_warps: the split pass's `LaunchOptions` num_warps.
        num_stages: the split pass's `LaunchOptions` num_stages.
        max_registers: the split pass's `LaunchOptions` max_registers.

    Returns:
        ``[batch, q_heads, head_dim]`` in ``query.dtype`` (in the values' basis; in the model's with
        ``value_basis``). Softmax and accumulation in fp32;
        the matmuls take ``query.dtype`` operands; codes dequantize in fp16 for fp16 queries (fewer registers per
        thread, the torch form's rounding: it dequantizes in fp32 and rounds to fp16), else in fp32.
    """
    batch, q_heads, head_dim = query.shape
    kv_heads, slots = positions.shape[1], positions.shape[2]
    group = q_heads // kv_heads
    ring_size = 0 if ring_positions is None else ring_positions.shape[1]
    total = slots + ring_size
    kd, ksz, k_fmt = _parts(k_data, k_scale_zero, key_bits)
    vd, vsz, v_fmt = _parts(v_data, v_scale_zero, value_bits)
    rk = ring_keys if ring_keys is not None else leave_keys
    rv = ring_values if ring_values is not None else leave_values
    r_strides = ring_keys.stride()[:3] if ring_keys is not None else (0, 0, 0)
    rpos = ring_positions if ring_positions is not None else positions
    with_scores = scores is not None
    interpreted = isinstance(_slot_partial_kernel, InterpretedFunction)
    # Matmul operands in the query's dtype; the CPU interpreter's bf16 tl.dot is wrong (Triton 3.9), so fp32 there.
    dot = tl.float32 if interpreted and query.dtype == torch.bfloat16 else getattr(tl, str(query.dtype)[6:])
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    num_slots = store_splits + ring_splits
    gp = max(16, triton.next_power_of_2(group))
    _slot_partial_kernel[(batch * kv_heads, num_slots)](
        query, query.stride(0), query.stride(1),
        kd, ksz, *kd.stride()[:3], *ksz.stride()[:3],
        vd, vsz, *vd.stride()[:3], *vsz.stride()[:3],
        positions, leave_keys, leave_values, leave_slot,
        rk, rv, *r_strides, rpos,
        seen, part_m, part_l, part_acc, logits, query if key_basis is None else key_basis,
        slots, ring_size, store_splits, split_tokens, ring_split_tokens, num_slots, total, float(scaling),
        KV_HEADS=kv_heads, G=group, GP=gp, D=head_dim, GROUP=group_size, K_FMT=k_fmt, V_FMT=v_fmt, BLOCK=block,
        WRITE_LOGITS=with_scores, DOT=dot, PRECISION=precision, ROTATE_Q=key_basis is not None,
        DC=min(head_dim, 32), DQ=tl.float16 if query.dtype == torch.float16 else tl.float32, num_warps=num_warps,
        num_stages=num_stages, **({"maxnreg": max_registers} if max_registers else {}),
    )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    blocks = triton.cdiv(total, BLOCK_T) if with_scores else 1
    _slot_combine_kernel[(batch * kv_heads, blocks)](
        part_m, part_l, part_acc, out, logits, positions, rpos, seen,
        scores if with_scores else part_m, ring_scores if ring_scores is not None else part_m,
        part_m if value_basis is None else value_basis,
        slots, ring_size, num_slots, total,
        KV_HEADS=kv_heads, G=group, GP=max(2 if value_basis is None else 16, triton.next_power_of_2(group)),
        D=head_dim, BLOCK_S=BLOCK_S, BLOCK_T=BLOCK_T, SCORES=with_scores, ACCUMULATE=accumulate,
        HAS_RING=with_scores and ring_size > 0, ROTATE_OUT=value_basis is not None, DC=min(head_dim, 32),
        num_warps=4,
    )
    return out


#: The op ``h2o_compress::slot_decode_attention`` around `_slot_decode_attention`: what ``torch.compile``
#: traces (a fake implementation gives Dynamo its output; the score buffers and the scratch are declared mutated).
slot_decode_attention = torch.library.custom_op(
    "h2o_compress::slot_decode_attention",
    mutates_args=("scores", "ring_scores", "part_m", "part_l", "part_acc", "logits"),
)(_slot_decode_attention)


@slot_decode_attention.register_fake
def _(query, *args, **kwargs):
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def layer_scratch(layer, q_heads: int) -> DecodeScratch:
    """The `DecodeScratch` of ``layer`` (a [`CompressedLayer`][h2o_compress.cache.CompressedLayer] whose decode
    steps run this op) for ``q_heads`` query heads, allocated once per shape (batch, slots) with the split plan of
    that shape and the launch of its storage width (`launch_for`), kept as
    ``layer.backend.scratch``. Eager steps allocate it (at the prefill, or the first decode step); a compiled step finds
    it."""
    ring = 0 if layer.ring is None else layer.ring.size
    key = (layer.batch, q_heads, layer.store.slots + ring, layer.with_scores)
    backend = layer.backend
    if backend.scratch is None or backend.scratch.key != key:
        plan = plan_splits(
            layer.batch, layer.kv_heads, layer.store.slots, ring, device=layer.device,
            launch=launch_for(layer.key_quantizer.bits, layer.value_quantizer.bits),
        )
        backend.scratch = DecodeScratch(
            plan, layer.batch, q_heads, layer.head_dim, layer.store.slots + ring, layer.with_scores, layer.device
        )
    return backend.scratch


def decode_layer(layer, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """The attention and score update of one decode step of ``layer`` in this op (two launches, no host sync),
    after the layer wrote the new token into its ring and the leaving one into the store (``layer.backend.leaving``:
    that token's keys and values ``[batch, kv_heads, 1, head_dim]`` at full precision and its int64 slot ``[batch,
    kv_heads, 1]``, consumed here). ``query`` ``[batch, q_heads, 1, head_dim]`` in the model's basis (the op
    rotates it into the keys' basis in its first launch and the output back from the values' basis in its
    second); ``scaling`` ``None`` for ``head_dim ** -0.5``. Returns ``[batch, q_heads, 1, head_dim]`` in the
    model's basis. Eviction stays with the layer (the policy's priority, in torch)."""
    (keys, values, slot), layer.backend.leaving = layer.backend.leaving, None
    batch, q_heads, _, head_dim = query.shape
    kv_heads, store, ring = layer.kv_heads, layer.store, layer.ring
    scratch = layer_scratch(layer, q_heads)
    plan = scratch.plan
    k_parts, v_parts = store.keys.parts, store.values.parts
    group = next((q.group_size for q in (layer.key_quantizer, layer.value_quantizer) if q.bits < 16), 32)
    output = slot_decode_attention(
        query.reshape(batch, q_heads, head_dim),  # the op reads its strides: no copy
        k_parts.get("data", k_parts.get("x")), k_parts.get("scale_zero"),
        v_parts.get("data", v_parts.get("x")), v_parts.get("scale_zero"),
        store.positions, keys.reshape(batch, kv_heads, head_dim).contiguous(),
        values.reshape(batch, kv_heads, head_dim).contiguous(), slot.reshape(batch, kv_heads),
        None if ring is None else ring.keys, None if ring is None else ring.values,
        None if ring is None else ring.positions, layer.seen, store.scores, None if ring is None else ring.scores,
        *scratch.tensors(), head_dim**-0.5 if scaling is None else float(scaling), layer.key_quantizer.bits,
        layer.value_quantizer.bits, group, plan.store_splits, plan.split_tokens, plan.ring_splits,
        plan.ring_split_tokens, layer.policy.accumulates, layer.key_basis, layer.value_basis, plan.launch.block,
        plan.launch.num_warps, plan.launch.num_stages, plan.launch.max_registers,
    )
    return output.view(batch, q_heads, 1, head_dim)
