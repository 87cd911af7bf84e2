"""Fused decode attention over the compressed KV cache (Triton).

One new query token per sequence attends to the *stored* tokens (int4/int8 codes with an fp16 (scale, zero)
pair per group, as [`IntQuantizer`][h2o_compress.formats.IntQuantizer] packs them, or raw 16-bit
``{"x": ...}`` storage) followed by the full-precision residual *window*, without materialising a
dequantized copy: each packed byte is read once and dequantized in registers.

Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"): the sequence is split across
programs so that short batches still fill the GPU; each program keeps an online softmax (running max,
sum-exp, unnormalised output) for all query heads of one KV head (GQA: K/V are read once per KV head), and a
second kernel combines the splits. When H2O scoring is on (Zhang et al. 2023, arXiv 2306.14048 §4) the same
pass also writes the scaled logits, and a third small kernel turns them into per-key probabilities summed
over the query heads of each KV head, so scoring costs no second ``q k^T`` pass.

Kernels:
    ``_partial_kernel``    grid ``(batch * kv_heads, splits)``: one split of one segment (stored or window).
    ``_combine_kernel``    grid ``(batch * q_heads,)``: splits -> output and log-sum-exp.
    ``_prob_sums_kernel``  grid ``(batch * kv_heads, cdiv(tokens, BLOCK_T))``: ``exp(logit - lse)`` summed
    over the GQA group.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from h2o_compress.formats.base import StoredTensor
from h2o_compress.attention.launch import H100_SMS, power_of_two, split_count

SUMS_BLOCK_T = 256  # tokens per program of `_prob_sums_kernel`


@triton.jit
def _load_tokens(data, sz, s_b, s_h, s_n, z_b, z_h, z_n, b, h, offs_n, mask_n,
                 D: tl.constexpr, GROUP: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                 OUT: tl.constexpr = tl.float32):
    """Tokens ``offs_n`` of (sequence ``b``, KV head ``h``) as ``OUT`` ``[BLOCK_N, D]``; masked tokens read as 0.

    ``FMT`` 16: raw ``data[b, h, n, :D]``. 8: uint8 codes ``data[b, h, n, :D]``. 4: uint8 ``data[b, h, n, :D/2]``,
    element ``2i`` in the low nibble of byte ``i``, ``2i+1`` in the high one. Codes dequantize to
    ``code * scale + zero`` (in ``OUT``: fp32, or fp16 for fp16 models, half the registers) with ``sz[b, h, n, g] =
    (scale, zero)`` fp16 for group ``g = d // GROUP``.
    """
    rows = data + b * s_b + h * s_h + offs_n[:, None] * s_n
    if FMT == 4:
        packed = tl.load(rows + tl.arange(0, D // 2)[None, :], mask=mask_n[:, None], other=0)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, D))
    else:
        codes = tl.load(rows + tl.arange(0, D)[None, :], mask=mask_n[:, None], other=0)
    if FMT == 16:
        x = codes.to(OUT)
    else:
        NG: tl.constexpr = D // GROUP
        pairs = (sz + b * z_b + h * z_h + offs_n[:, None, None] * z_n
                 + tl.arange(0, NG)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :])
        scale, zero = tl.split(tl.load(pairs, mask=mask_n[:, None, None], other=0.0).to(OUT))
        x = tl.reshape(codes.to(OUT), (BLOCK_N, NG, GROUP)) * scale[:, :, None] + zero[:, :, None]
        x = tl.reshape(x, (BLOCK_N, D))
    return x


@triton.jit
def _program(KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """Where a split program of grid ``(batch * kv_heads, splits)`` works: ``(bh, split, b, h, heads, head_mask, rows,
    offs_d)``, its sequence ``b`` and KV head ``h`` (int64: offsets into big caches), its ``GP`` query rows (``G``
    real, ``head_mask``) at ``rows = b * q_heads + h * G + r``, and the ``D`` offsets of a head dim."""
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = (bh // KV_HEADS).to(tl.int64), (bh % KV_HEADS).to(tl.int64)
    heads = tl.arange(0, GP)
    return bh, split, b, h, heads, heads < G, bh * G + heads, tl.arange(0, D)


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
def _partial_kernel(
    q, q_b, q_h, q_d,
    k, ksz, k_b, k_h, k_n, ksz_b, ksz_h, ksz_n,
    v, vsz, v_b, v_h, v_n, vsz_b, vsz_h, vsz_n,
    part_m, part_l, part_acc, logits,
    seq_len, split_tokens, slot_base, token_base, num_slots, total_tokens, scaling,
    KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LOGITS: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online softmax of the ``G`` query heads of KV head ``h`` over tokens ``[split * split_tokens, +split_tokens)``
    of one segment (``seq_len`` tokens).

    Writes ``part_m``/``part_l`` ``[batch * q_heads, num_slots]`` (max, sum-exp) and ``part_acc``
    ``[batch * q_heads, num_slots, D]`` (unnormalised output) at slot ``slot_base + split``, and, when
    ``WRITE_LOGITS``, the scaled logits to ``logits[batch * q_heads, total_tokens]`` at ``token_base + n``.
    Query rows are padded to ``GP`` (>= 16, for ``tl.dot``) and masked; both matmuls take ``DOT`` operands.
    """
    bh, split, b, h, heads, head_mask, rows, offs_d = _program(KV_HEADS, G, GP, D)
    qv = tl.load(q + b * q_b + (h * G + heads)[:, None] * q_h + offs_d[None, :] * q_d,
                 mask=head_mask[:, None], other=0.0).to(DOT)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)
    logits_rows = logits + rows[:, None] * total_tokens + token_base
    for n0 in range(start, end, BLOCK_N):  # every split is non-empty, so m_i is finite after one block
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        kt = _load_tokens(k, ksz, k_b, k_h, k_n, ksz_b, ksz_h, ksz_n, b, h, offs_n, mask_n, D, GROUP, K_FMT, BLOCK_N)
        vt = _load_tokens(v, vsz, v_b, v_h, v_n, vsz_b, vsz_h, vsz_n, b, h, offs_n, mask_n, D, GROUP, V_FMT, BLOCK_N)
        m_i, l_i, acc = _attend_block(qv, m_i, l_i, acc, kt, vt, mask_n, scaling, logits_rows, head_mask, offs_n,
                                      WRITE_LOGITS, DOT, PRECISION)
    slot = rows * num_slots + slot_base + split
    tl.store(part_m + slot, m_i, mask=head_mask)
    tl.store(part_l + slot, l_i, mask=head_mask)
    tl.store(part_acc + slot[:, None] * D + offs_d[None, :], acc, mask=head_mask[:, None])


@triton.jit
def _combine_kernel(part_m, part_l, part_acc, out, lse, num_slots, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the ``num_slots`` partial softmaxes of query row ``b * q_heads + head``: ``out[row, :D]`` (in its
    dtype) ``= sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s`` and ``lse[row] = M + log(sum_s e^(m_s - M) l_s)``."""
    row = tl.program_id(0)
    offs_d = tl.arange(0, D)
    top = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    for s0 in range(0, num_slots, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        top = tl.maximum(top, tl.load(part_m + row * num_slots + offs_s, mask=offs_s < num_slots, other=float("-inf")))
    big = tl.max(top, 0)
    total = tl.zeros((BLOCK_S,), tl.float32)
    acc = tl.zeros((BLOCK_S, D), tl.float32)
    for s0 in range(0, num_slots, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask = offs_s < num_slots
        w = tl.exp(tl.load(part_m + row * num_slots + offs_s, mask=mask, other=float("-inf")) - big)
        total += w * tl.load(part_l + row * num_slots + offs_s, mask=mask, other=0.0)
        acc += w[:, None] * tl.load(part_acc + (row * num_slots + offs_s)[:, None] * D + offs_d[None, :],
                                    mask=mask[:, None], other=0.0)
    norm = tl.sum(total, 0)
    tl.store(out + row * D + offs_d, tl.sum(acc, 0) / norm)
    tl.store(lse + row, big + tl.log(norm))


@triton.jit
def _prob_sums_kernel(logits, lse, probs, total_tokens, G: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``probs[bh, t] = sum_r exp(logits[bh * G + r, t] - lse[bh * G + r])`` for one block of tokens."""
    bh = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, GP)
    rows = bh * G + heads
    head_mask, t_mask = heads < G, offs_t < total_tokens
    norm = tl.load(lse + rows, mask=head_mask, other=0.0)
    x = tl.load(logits + rows[:, None] * total_tokens + offs_t[None, :], mask=head_mask[:, None] & t_mask[None, :],
                other=float("-inf"))
    tl.store(probs + bh * total_tokens + offs_t, tl.sum(tl.exp(x - norm[:, None]), 0), mask=t_mask)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS


def choose_splits(
    batch: int, kv_heads: int, tokens: int, block_tokens: int, sm_count: int = H100_SMS
) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` for ``tokens`` tokens (`h2o_compress.attention.launch.split_count`)."""
    return split_count(batch, kv_heads, tokens, block_tokens, sm_count)


def _scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Uninitialised fp32 buffer (every element read is written first; the tests poison it with NaN)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _dense_tail(t: torch.Tensor, dims: int) -> torch.Tensor:
    """``t`` if its last ``dims`` dims are densely packed (outer dims may have any stride), else a dense copy."""
    expected = 1
    for size, stride in zip(reversed(t.shape[-dims:]), reversed(t.stride()[-dims:])):
        if stride != expected and size > 1:
            return t.contiguous()
        expected *= size
    return t


def _operand(stored: StoredTensor, bits: int, group_size: int, shape: tuple[int, ...], what: str):
    """``(data, scale_zero)`` of ``stored`` checked against ``shape = (batch, kv_heads, head_dim)``; 16-bit
    storage (``{"x": raw}``) returns ``(x, x)``."""
    batch, kv_heads, head_dim = shape
    if bits == 16:
        x = stored.parts.get("x")
        if x is None or x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != shape:
            raise ValueError(
                f"16-bit stored {what} must be {{'x': [batch={batch}, kv_heads={kv_heads}, seq, {head_dim}]}}")
        x = _dense_tail(x, 1)
        return x, x
    if bits not in (4, 8):
        raise ValueError(f"stored {what} bits must be 4, 8 or 16 (raw), got {bits}")
    data, sz = stored.parts.get("data"), stored.parts.get("scale_zero")
    if data is None or sz is None:
        raise ValueError(f"{bits}-bit stored {what} needs parts 'data' and 'scale_zero', got {sorted(stored.parts)}")
    n = data.shape[2] if data.dim() == 4 else -1
    if (data.dtype != torch.uint8 or tuple(data.shape) != (batch, kv_heads, n, head_dim * bits // 8)
            or tuple(sz.shape) != (batch, kv_heads, n, head_dim // group_size, 2)):
        raise ValueError(
            f"stored {what}: expected uint8 data [{batch}, {kv_heads}, seq, {head_dim * bits // 8}] and scale_zero "
            f"[{batch}, {kv_heads}, seq, {head_dim // group_size}, 2], got {tuple(data.shape)} {data.dtype} "
            f"and {tuple(sz.shape)}")
    return _dense_tail(data, 1), _dense_tail(sz, 2)


def _segments(query, stored_keys, stored_values, key_bits, value_bits, group_size, window_keys, window_values,
              block_tokens) -> tuple[list, int]:
    """The checked operands of `fused_decode_attention` (its arguments) as ``(segments, kv_heads)``: per segment
    (stored, then window), ``(keys (data, sz), values (data, sz), key format, value format, tokens)``.

    Raises:
        ValueError: the errors `fused_decode_attention` lists.
    """
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(
            f"fused decode attention takes one query token: [batch, q_heads, 1, head_dim], got {tuple(query.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype must be fp16, bf16 or fp32, got {query.dtype}")
    batch, q_heads, _, head_dim = query.shape
    if not power_of_two(head_dim, 16):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if not power_of_two(block_tokens, 16):
        raise ValueError(f"block_tokens must be a power of two >= 16, got {block_tokens}")
    if stored_keys is not None and len(stored_keys) and (key_bits != 16 or value_bits != 16):
        if not power_of_two(group_size, 2) or head_dim % group_size:
            raise ValueError(f"group_size must be a power of two dividing head_dim={head_dim}, got {group_size}")
    segments, kv_heads = [], None
    if stored_keys is not None and len(stored_keys):
        if stored_values is None:
            raise ValueError("stored_keys given without stored_values")
        kv_heads = next(iter(stored_keys.parts.values())).shape[1]
        shape = (batch, kv_heads, head_dim)
        k = _operand(stored_keys, key_bits, group_size, shape, "keys")
        v = _operand(stored_values, value_bits, group_size, shape, "values")
        if k[0].shape[2] != v[0].shape[2]:
            raise ValueError(f"stored keys ({k[0].shape[2]}) and values ({v[0].shape[2]}) hold different token counts")
        segments.append((k, v, key_bits, value_bits, k[0].shape[2]))
    if window_keys is not None and window_keys.shape[2]:
        kv_heads = window_keys.shape[1] if kv_heads is None else kv_heads
        expected = (batch, kv_heads, window_keys.shape[2], head_dim)
        if tuple(window_keys.shape) != expected or window_values is None or tuple(window_values.shape) != expected:
            raise ValueError(f"window keys and values must both be {list(expected)}, got {tuple(window_keys.shape)} "
                             f"and {None if window_values is None else tuple(window_values.shape)}")
        wk, wv = _dense_tail(window_keys, 1), _dense_tail(window_values, 1)
        segments.append(((wk, wk), (wv, wv), 16, 16, wk.shape[2]))
    if not segments:
        raise ValueError("decode attention needs at least one stored or window token")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return segments, kv_heads


def _split_pass(query, segments, splits, kv_heads, group_size, scaling, write_logits, block_tokens) -> tuple:
    """The first launches of `fused_decode_attention`: `_partial_kernel` over each segment's ``splits``
    (``(num_splits, split_tokens)``). Returns the scratch it wrote, fp32 ``(part_m, part_l, part_acc, logits)``
    (``logits`` is ``part_m`` without ``write_logits``)."""
    batch, q_heads, _, head_dim = query.shape
    group, device, rows = q_heads // kv_heads, query.device, batch * q_heads
    num_slots, total = sum(s for s, _ in splits), sum(seg[-1] for seg in segments)
    part_m, part_l = _scratch((rows, num_slots), device), _scratch((rows, num_slots), device)
    part_acc = _scratch((rows, num_slots, head_dim), device)
    logits = _scratch((rows, total), device) if write_logits else part_m
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # ignored for 16-bit operands
    # Matmul operands in the query's dtype; the CPU interpreter's bf16 tl.dot is wrong (Triton 3.9), so fp32 there.
    interpreted = isinstance(_partial_kernel, InterpretedFunction)
    dot = tl.float32 if interpreted and query.dtype == torch.bfloat16 else getattr(tl, str(query.dtype)[6:])
    slot_base = token_base = 0
    for ((kd, ksz), (vd, vsz), k_fmt, v_fmt, tokens), (num_splits, split_tokens) in zip(segments, splits):
        _partial_kernel[(batch * kv_heads, num_splits)](
            query, query.stride(0), query.stride(1), query.stride(3),
            kd, ksz, *kd.stride()[:3], *ksz.stride()[:3],
            vd, vsz, *vd.stride()[:3], *vsz.stride()[:3],
            part_m, part_l, part_acc, logits,
            tokens, split_tokens, slot_base, token_base, num_slots, total, float(scaling),
            KV_HEADS=kv_heads, G=group, GP=max(16, triton.next_power_of_2(group)), D=head_dim, GROUP=group_size,
            K_FMT=k_fmt, V_FMT=v_fmt, BLOCK_N=block_tokens, WRITE_LOGITS=write_logits,
            DOT=dot, PRECISION=precision, num_warps=4,
        )
        slot_base, token_base = slot_base + num_splits, token_base + tokens
    return part_m, part_l, part_acc, logits


def fused_decode_attention(
    query: torch.Tensor,
    stored_keys: StoredTensor | None,
    stored_values: StoredTensor | None,
    key_bits: int,
    value_bits: int,
    group_size: int,
    window_keys: torch.Tensor | None,
    window_values: torch.Tensor | None,
    scaling: float,
    need_probability_sums: bool,
    block_tokens: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of one new query over stored (compressed) tokens followed by the raw window, in one pass.

    Args:
        query: ``[batch, q_heads, 1, head_dim]`` fp16/bf16/fp32, already in the keys' basis; ``head_dim`` a
            power of two >= 16 and ``q_heads`` a multiple of ``kv_heads`` (query head ``i`` uses KV head
            ``i // (q_heads // kv_heads)``).
        stored_values: as ``stored_keys``, for the values.
        stored_keys: ``IntQuantizer`` parts (``key_bits``/``value_bits`` 4 or 8: uint8 ``data``
            ``[batch, kv_heads, seq, head_dim * bits / 8]``, fp16 ``scale_zero``
            ``[batch, kv_heads, seq, head_dim / group_size, 2]``) or raw ``{"x": [batch, kv_heads, seq, head_dim]}``
            (bits 16); ``None`` for no stored tokens. Outer strides are free (slices of larger buffers are fine).
        group_size: quantization group along ``head_dim`` (a power of two dividing it).
        window_keys: raw ``[batch, kv_heads, w, head_dim]`` tokens after the stored ones, or ``None``.
        window_values: the values of those tokens, as ``window_keys``.
        scaling: softmax scale applied to ``q . k``.
        need_probability_sums: also return the H2O per-key probability sums.
        block_tokens: tokens per loop iteration (power of two >= 16); splits are multiples of it.

    Returns:
        ``(output, sums)``: output ``[batch, q_heads, 1, head_dim]`` in ``query.dtype`` (in the values' basis);
        sums fp32 ``[batch, kv_heads, seq + w]`` (stored tokens first, then the window): each key's softmax
        probability summed over the query heads sharing its KV head, or ``None``. Softmax and accumulation are
        fp32; the two matmuls take ``query.dtype`` operands (fp32: full ``ieee`` precision).

    Raises:
        ValueError: unsupported shapes, formats or dtypes, or no tokens at all.
    """
    segments, kv_heads = _segments(query, stored_keys, stored_values, key_bits, value_bits, group_size,
                                   window_keys, window_values, block_tokens)
    batch, q_heads, _, head_dim = query.shape
    group, device, rows = q_heads // kv_heads, query.device, batch * q_heads
    splits = [choose_splits(batch, kv_heads, seg[-1], block_tokens, _sm_count(device)) for seg in segments]
    num_slots, total = sum(s for s, _ in splits), sum(seg[-1] for seg in segments)
    part_m, part_l, part_acc, logits = _split_pass(query, segments, splits, kv_heads, group_size, scaling,
                                                   need_probability_sums, block_tokens)
    output = torch.empty(batch, q_heads, 1, head_dim, dtype=query.dtype, device=device)
    lse = _scratch((rows,), device)
    _combine_kernel[(rows,)](part_m, part_l, part_acc, output, lse, num_slots, D=head_dim, BLOCK_S=16, num_warps=4)
    if not need_probability_sums:
        return output, None
    sums = torch.empty(batch, kv_heads, total, dtype=torch.float32, device=device)
    _prob_sums_kernel[(batch * kv_heads, triton.cdiv(total, SUMS_BLOCK_T))](
        logits, lse, sums, total, G=group, GP=max(2, triton.next_power_of_2(group)), BLOCK_T=SUMS_BLOCK_T,
        num_warps=4)
    return output, sums
