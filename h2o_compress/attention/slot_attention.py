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
matrix, ``DC`` rows at a time), so neither rotation is a matmul launch of its own (fewer kernels per layer).

The op takes plain tensors (`decode_layer` unpacks a layer's `SlotBuffers`); the scratch (split partials,
logits: `DecodeScratch`, `make_scratch`) is kept by the cache, allocated once per shape, and passed in as mutated
arguments. Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from h2o_compress.attention.buffers import SlotBuffers
from h2o_compress.attention.launch import LaunchOptions, launch_for, mark_static_address, power_of_two
from h2o_compress.attention.prefix_attention import (
    _attend_block, _load_tokens, _program, _sm_count, choose_splits,
)
from h2o_compress.formats import IntQuantizer, NoQuantizer

BLOCK_T = 256  # tokens per program of the combine kernel's score pass
BLOCK_S = 8  # split partials merged per iteration of the combine kernel


@triton.jit
def _leave_row(ptr, bh, offs_d, held, D: tl.constexpr, FMT: tl.constexpr, DQ: tl.constexpr):
    """The leaving token's ``[D]`` keys or values for a block's select: ``held`` (loaded before the loop) for 16-bit
    storage, else loaded again here (an L1 hit after the first block). With dequantization in the loop, the held
    vector's broadcast over the tile layout held registers for the whole loop (fewer programs per SM); with 16-bit
    storage the reload cost registers instead. ``benchmarks/kernel_bandwidth.py`` measures both (the figures:
    ``benchmarks/results/kernel_bandwidth_cpu.md``)."""
    if FMT == 16:
        row = held
    else:
        row = tl.load(ptr + bh.to(tl.int64) * D + offs_d).to(DQ)
    return row


@triton.jit
def _load_query(q, q_b, q_h, qb, b, h, heads, head_mask, offs_d, G: tl.constexpr, GP: tl.constexpr,
                D: tl.constexpr, DOT: tl.constexpr, ROTATE_Q: tl.constexpr, DC: tl.constexpr):
    """The ``G`` query rows of KV head ``h`` as ``DOT`` ``[GP, D]`` (padded rows 0); with ``ROTATE_Q``, ``q @ H`` (the
    keys' basis ``qb``, fp32 ``[D, D]``) in fp32, ``DC`` rows of ``H`` at a time, rounded as ``q``."""
    if ROTATE_Q:
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
    return qv


@triton.jit
def _store_split(qv, m_i, l_i, acc, start, end, bh, b, h, offs_d, head_mask, logits_rows, scaling,
                 k, ksz, k_b, k_h, k_n, ksz_b, ksz_h, ksz_n, v, vsz, v_b, v_h, v_n, vsz_b, vsz_h, vsz_n,
                 pos, lk, lv, leave_slot, slots, D: tl.constexpr, GROUP: tl.constexpr, K_FMT: tl.constexpr,
                 V_FMT: tl.constexpr, BLOCK: tl.constexpr, WRITE_LOGITS: tl.constexpr, DOT: tl.constexpr,
                 PRECISION: tl.constexpr, DQ: tl.constexpr):
    """The online softmax over store slots ``[start, end)`` of (``b``, ``h``), dequantizing in registers; the
    leaving token is read at full precision from ``lk``/``lv`` in its slot ``leave_slot[bh]``."""
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
    return m_i, l_i, acc


@triton.jit
def _ring_split(qv, m_i, l_i, acc, start, end, b, h, head_mask, logits_rows, scaling, rk, rv, r_b, r_h, r_n, rpos,
                ring_size, D: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, WRITE_LOGITS: tl.constexpr,
                DOT: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax over ring slots ``[start, end)`` of (``b``, ``h``), at full precision. The ring holds
    ``residual`` tokens (3 by default): one or two blocks, nothing to pipeline; its pipeline buffers would take
    shared memory from the store's (``benchmarks/results/kernel_bandwidth_cpu.md``)."""
    for n0 in tl.range(start, end, BLOCK, num_stages=1):
        offs_n = n0 + tl.arange(0, BLOCK)
        in_range = offs_n < end
        valid = in_range & (tl.load(rpos + b * ring_size + offs_n, mask=in_range, other=-1) >= 0)
        kt = _load_tokens(rk, rk, r_b, r_h, r_n, 0, 0, 0, b, h, offs_n, in_range, D, GROUP, 16, BLOCK)
        vt = _load_tokens(rv, rv, r_b, r_h, r_n, 0, 0, 0, b, h, offs_n, in_range, D, GROUP, 16, BLOCK)
        m_i, l_i, acc = _attend_block(qv, m_i, l_i, acc, kt, vt, valid, scaling, logits_rows, head_mask,
                                      offs_n, WRITE_LOGITS, DOT, PRECISION)
    return m_i, l_i, acc


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
    below the live bound (`_store_split`), or (``split >= store_splits``) ring slots (`_ring_split`). Writes
    ``part_m``/``part_l`` ``[batch * q_heads, num_slots]`` and ``part_acc`` ``[batch * q_heads, num_slots, D]`` at
    ``split``; with ``WRITE_LOGITS`` the scaled logits of valid tokens to ``logits[batch * q_heads, total]`` (store
    ``t`` at ``t``, ring ``r`` at ``slots + r``). ``pos`` int32 ``[batch, kv_heads, slots]``, ``rpos`` int32
    ``[batch, ring_size]`` (contiguous), ``lk``/``lv`` ``[batch, kv_heads, D]`` and ``leave_slot`` int64 ``[batch,
    kv_heads]`` (contiguous)."""
    bh, split, b, h, heads, head_mask, rows, offs_d = _program(KV_HEADS, G, GP, D)
    qv = _load_query(q, q_b, q_h, qb, b, h, heads, head_mask, offs_d, G, GP, D, DOT, ROTATE_Q, DC)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    logits_rows = logits + rows[:, None].to(tl.int64) * total
    if split < store_splits:
        live = tl.minimum(tl.load(seen), slots).to(tl.int32)
        start = split * split_tokens
        m_i, l_i, acc = _store_split(
            qv, m_i, l_i, acc, start, tl.minimum(start + split_tokens, live), bh, b, h, offs_d, head_mask,
            logits_rows, scaling, k, ksz, k_b, k_h, k_n, ksz_b, ksz_h, ksz_n, v, vsz, v_b, v_h, v_n, vsz_b, vsz_h,
            vsz_n, pos, lk, lv, leave_slot, slots, D, GROUP, K_FMT, V_FMT, BLOCK, WRITE_LOGITS, DOT, PRECISION, DQ)
    else:
        start = (split - store_splits) * ring_split_tokens
        m_i, l_i, acc = _ring_split(
            qv, m_i, l_i, acc, start, tl.minimum(start + ring_split_tokens, ring_size), b, h, head_mask,
            logits_rows + slots, scaling, rk, rv, r_b, r_h, r_n, rpos, ring_size, D, GROUP, BLOCK, WRITE_LOGITS,
            DOT, PRECISION)
    slot = rows * num_slots + split
    tl.store(part_m + slot, m_i, mask=head_mask)
    tl.store(part_l + slot, l_i, mask=head_mask)
    tl.store(part_acc + slot[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=head_mask[:, None])


@triton.jit
def _merge_splits(part_m, part_l, rows, head_mask, num_slots, GP: tl.constexpr, BLOCK_S: tl.constexpr):
    """``(big, norm)`` of the query ``rows``: the largest split max and the sum-exp of every split against it
    (padded rows 0 and 1)."""
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
    return big, norm


@triton.jit
def _write_output(part_m, part_acc, out, vb, rows, head_mask, big, norm, num_slots, GP: tl.constexpr,
                  D: tl.constexpr, ROTATE_OUT: tl.constexpr, DC: tl.constexpr):
    """``out[row, :D]``: the splits' outputs merged and normalised; with ``ROTATE_OUT``, times ``H`` (the values'
    basis ``vb``, fp32 ``[D, D]``), ``DC`` columns of ``P.V`` at a time, in fp32."""
    offs_d = tl.arange(0, D)
    if ROTATE_OUT:
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


@triton.jit
def _add_scores(logits, pos, rpos, seen, scores, ring_scores, bh, block, rows, head_mask, lse, slots, ring_size,
                total, KV_HEADS: tl.constexpr, BLOCK_T: tl.constexpr, ACCUMULATE: tl.constexpr,
                HAS_RING: tl.constexpr):
    """Token block ``block``'s probabilities summed over the query ``rows``, added to (or, without ``ACCUMULATE``,
    written over) ``scores`` and ``ring_scores`` (0 for invalid tokens)."""
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


@triton.jit
def _slot_combine_kernel(
    part_m, part_l, part_acc, out, logits, pos, rpos, seen, scores, ring_scores, vb,
    slots, ring_size, num_slots, total,
    KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr, SCORES: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_RING: tl.constexpr,
    ROTATE_OUT: tl.constexpr = False, DC: tl.constexpr = 32,
):
    """Log-sum-exp of the ``G`` query rows of KV head ``bh`` from the splits (`_merge_splits`); output ``out[row,
    :D]`` (block 0, `_write_output`); with ``SCORES``, the probabilities of token block ``program_id(1)`` summed over
    the rows, added to (or, without ``ACCUMULATE``, written over) ``scores`` fp32 ``[batch, kv_heads, slots]`` and
    ``ring_scores`` ``[batch, kv_heads, ring_size]`` (0 for invalid tokens; `_add_scores`)."""
    bh, block = tl.program_id(0), tl.program_id(1)
    heads = tl.arange(0, GP)
    head_mask = heads < G
    rows = bh * G + heads
    big, norm = _merge_splits(part_m, part_l, rows, head_mask, num_slots, GP, BLOCK_S)
    if block == 0:
        _write_output(part_m, part_acc, out, vb, rows, head_mask, big, norm, num_slots, GP, D, ROTATE_OUT, DC)
    if SCORES:
        _add_scores(logits, pos, rpos, seen, scores, ring_scores, bh, block, rows, head_mask, big + tl.log(norm),
                    slots, ring_size, total, KV_HEADS, BLOCK_T, ACCUMULATE, HAS_RING)


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
    """Attention of one decode query over a layer's slots and ring, plus the fused H2O score update (the op's body:
    flat tensors and numbers, as a custom op takes them; `decode_layer` unpacks a layer's `SlotBuffers` into it).

    The arguments, by group:

    - ``query`` ``[batch, q_heads, head_dim]`` fp16/bf16/fp32, last dim contiguous, in the keys' basis (in the
      model's with ``key_basis``: fp32 ``[head_dim, head_dim]`` orthonormal and symmetric, rotated in the first
      launch, ``(q @ H)`` rounded to ``query.dtype`` as the torch form does; with ``value_basis`` the output is
      rotated back in the second, so neither costs a launch of its own).
    - the store: ``k_data``/``v_data`` ``[batch, kv_heads, slots, ...]`` (last dims dense), uint8 codes of
      ``key_bits``/``value_bits`` 4 or 8 with fp16 ``k_scale_zero``/``v_scale_zero`` ``[batch, kv_heads, slots,
      head_dim / group_size, 2]``, or raw (bits 16, scale_zero ``None``); int32 ``positions`` ``[batch, kv_heads,
      slots]`` (``-1`` = empty), contiguous; ``seen`` int64 0-dim: slots at or past ``min(slots, seen)`` are not read.
    - the token entering the store: ``leave_keys``/``leave_values`` ``[batch, kv_heads, head_dim]`` at full precision,
      read instead of its slot ``leave_slot`` (int64 ``[batch, kv_heads]``), all contiguous.
    - the ring: ``ring_keys``/``ring_values`` ``[batch, kv_heads, ring, head_dim]`` (last dim dense) with int32
      ``ring_positions`` ``[batch, ring]`` (contiguous), or all ``None``.
    - the scores: fp32 ``scores`` ``[batch, kv_heads, slots]`` and ``ring_scores`` ``[batch, kv_heads, ring]``,
      contiguous, updated in place (``accumulate``: ``+=`` this query's probabilities summed over each KV head's query
      heads; else ``=``); ``scores`` ``None`` for no scoring.
    - the layer's `DecodeScratch` (``part_m``, ``part_l``, ``part_acc``, ``logits``, overwritten), its `SplitPlan`
      (``store_splits``, ``split_tokens``, ``ring_splits``, ``ring_split_tokens``) and `LaunchOptions` (``block``,
      ``num_warps``, ``num_stages``, ``max_registers``); ``scaling`` the softmax scale, ``group_size`` the
      quantization group (power of two).

    Returns:
        ``[batch, q_heads, head_dim]`` in ``query.dtype`` (in the values' basis; in the model's with
        ``value_basis``). Softmax and accumulation in fp32; the matmuls take ``query.dtype`` operands; codes
        dequantize in fp16 for fp16 queries (fewer registers per thread, the torch form's rounding: it dequantizes
        in fp32 and rounds to fp16), else in fp32.
    """
    plan = SplitPlan(store_splits, split_tokens, ring_splits, ring_split_tokens,
                     LaunchOptions(block, num_warps, num_stages, max_registers))
    ring_size = 0 if ring_positions is None else ring_positions.shape[1]
    rpos = ring_positions if ring_positions is not None else positions
    ring = (ring_keys if ring_keys is not None else leave_keys, ring_values if ring_values is not None else leave_values,
            ring_keys.stride()[:3] if ring_keys is not None else (0, 0, 0), rpos, ring_size)
    store = (*_parts(k_data, k_scale_zero, key_bits), *_parts(v_data, v_scale_zero, value_bits), positions,
             (leave_keys, leave_values, leave_slot), seen)
    scratch = (part_m, part_l, part_acc, logits)
    _launch_split_pass(query, store, ring, scratch, key_basis, plan, scaling, group_size, scores is not None)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _launch_combine(out, scratch, positions, rpos, seen, scores, ring_scores, value_basis, plan, ring_size,
                    accumulate)
    return out


def _launch_split_pass(query, store, ring, scratch, key_basis, plan: SplitPlan, scaling, group_size,
                       with_scores: bool) -> None:
    """The first launch of `_slot_decode_attention`: `_slot_partial_kernel` over the plan's splits."""
    batch, q_heads, head_dim = query.shape
    kd, ksz, k_fmt, vd, vsz, v_fmt, positions, (leave_keys, leave_values, leave_slot), seen = store
    rk, rv, r_strides, rpos, ring_size = ring
    kv_heads, slots = positions.shape[1], positions.shape[2]
    group, launch = q_heads // kv_heads, plan.launch
    interpreted = isinstance(_slot_partial_kernel, InterpretedFunction)
    # Matmul operands in the query's dtype; the CPU interpreter's bf16 tl.dot is wrong (Triton 3.9), so fp32 there.
    dot = tl.float32 if interpreted and query.dtype == torch.bfloat16 else getattr(tl, str(query.dtype)[6:])
    _slot_partial_kernel[(batch * kv_heads, plan.num_slots)](
        query, query.stride(0), query.stride(1),
        kd, ksz, *kd.stride()[:3], *ksz.stride()[:3],
        vd, vsz, *vd.stride()[:3], *vsz.stride()[:3],
        positions, leave_keys, leave_values, leave_slot,
        rk, rv, *r_strides, rpos,
        seen, *scratch, query if key_basis is None else key_basis,
        slots, ring_size, plan.store_splits, plan.split_tokens, plan.ring_split_tokens, plan.num_slots,
        slots + ring_size, float(scaling),
        KV_HEADS=kv_heads, G=group, GP=max(16, triton.next_power_of_2(group)), D=head_dim, GROUP=group_size,
        K_FMT=k_fmt, V_FMT=v_fmt, BLOCK=launch.block, WRITE_LOGITS=with_scores, DOT=dot,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", ROTATE_Q=key_basis is not None,
        DC=min(head_dim, 32), DQ=tl.float16 if query.dtype == torch.float16 else tl.float32,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        **({"maxnreg": launch.max_registers} if launch.max_registers else {}),
    )


def _launch_combine(out, scratch, positions, rpos, seen, scores, ring_scores, value_basis, plan: SplitPlan,
                    ring_size: int, accumulate: bool) -> None:
    """The second launch of `_slot_decode_attention`: `_slot_combine_kernel`, the output into ``out`` and the
    scores."""
    part_m, part_l, part_acc, logits = scratch
    (batch, q_heads, head_dim), (kv_heads, slots) = out.shape, positions.shape[1:]
    group, with_scores, total = q_heads // kv_heads, scores is not None, slots + ring_size
    _slot_combine_kernel[(batch * kv_heads, triton.cdiv(total, BLOCK_T) if with_scores else 1)](
        part_m, part_l, part_acc, out, logits, positions, rpos, seen,
        scores if with_scores else part_m, ring_scores if ring_scores is not None else part_m,
        part_m if value_basis is None else value_basis,
        slots, ring_size, plan.num_slots, total,
        KV_HEADS=kv_heads, G=group, GP=max(2 if value_basis is None else 16, triton.next_power_of_2(group)),
        D=head_dim, BLOCK_S=BLOCK_S, BLOCK_T=BLOCK_T, SCORES=with_scores, ACCUMULATE=accumulate,
        HAS_RING=with_scores and ring_size > 0, ROTATE_OUT=value_basis is not None, DC=min(head_dim, 32),
        num_warps=4,
    )


#: The op ``h2o_compress::slot_decode_attention`` around `_slot_decode_attention`: what ``torch.compile``
#: traces (a fake implementation gives Dynamo its output; the score buffers and the scratch are declared mutated).
slot_decode_attention = torch.library.custom_op(
    "h2o_compress::slot_decode_attention",
    mutates_args=("scores", "ring_scores", "part_m", "part_l", "part_acc", "logits"),
)(_slot_decode_attention)


@slot_decode_attention.register_fake
def _(query, *args, **kwargs):
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def make_scratch(batch: int, q_heads: int, kv_heads: int, head_dim: int, slots: int, ring_size: int,
                 with_scores: bool, key_bits: int, value_bits: int, device: torch.device) -> DecodeScratch:
    """The `DecodeScratch` of a layer of ``slots`` store slots and a ring of ``ring_size`` for ``q_heads`` query
    heads, with the split plan of that shape and the launch of its storage width (`launch_for`). The cache keeps it
    (one per layer and shape) and passes it to `decode_layer` each step."""
    plan = plan_splits(batch, kv_heads, slots, ring_size, device=device, launch=launch_for(key_bits, value_bits))
    return DecodeScratch(plan, batch, q_heads, head_dim, slots + ring_size, with_scores, device)


def decode_layer(buffers: SlotBuffers, scratch: DecodeScratch, query: torch.Tensor, leaving: tuple,
                 scaling: float | None, accumulate: bool) -> torch.Tensor:
    """The attention and score update of one decode step of a compressed layer in this op (two launches, no host
    sync), after the cache wrote the new token into its ring and the leaving one into the store.

    Args:
        buffers: the layer's store, ring and counters (`SlotBuffers`; per-head slots); the scores are updated in
            place.
        scratch: the layer's `DecodeScratch` for this shape (`make_scratch`).
        query: ``[batch, q_heads, 1, head_dim]`` in the model's basis (the op rotates it into the keys' basis in its
            first launch and the output back from the values' basis in its second).
        leaving: ``(keys, values, slot)``: the token that entered the store this step, its keys and values
            ``[batch, kv_heads, 1, head_dim]`` at full precision and its int64 slot ``[batch, kv_heads, 1]``.
        scaling: softmax scale; ``None`` for ``head_dim ** -0.5``.
        accumulate: add this query's probabilities to the scores (else they replace them: TOVA).

    Returns:
        ``[batch, q_heads, 1, head_dim]`` in the model's basis. Eviction stays with the cache.
    """
    keys, values, slot = leaving
    batch, q_heads, _, head_dim = query.shape
    kv_heads, plan, ring = buffers.positions.shape[1], scratch.plan, buffers.ring
    k, v = buffers.keys, buffers.values
    group = next((side.group for side in (k, v) if side.bits < 16), 32)
    output = slot_decode_attention(
        query.reshape(batch, q_heads, head_dim),  # the op reads its strides: no copy
        k.data, k.scale_zero, v.data, v.scale_zero,
        buffers.positions, keys.reshape(batch, kv_heads, head_dim).contiguous(),
        values.reshape(batch, kv_heads, head_dim).contiguous(), slot.reshape(batch, kv_heads),
        *((None,) * 3 if ring is None else ring[:3]), buffers.seen, buffers.scores,
        None if ring is None else ring.scores,
        *scratch.tensors(), head_dim**-0.5 if scaling is None else float(scaling), k.bits, v.bits, group,
        plan.store_splits, plan.split_tokens, plan.ring_splits, plan.ring_split_tokens, accumulate, k.basis,
        v.basis, plan.launch.block, plan.launch.num_warps, plan.launch.num_stages, plan.launch.max_registers,
    )
    return output.view(batch, q_heads, 1, head_dim)
