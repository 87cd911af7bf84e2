"""Pure-torch specification of `h2o_compress.attention.prefix_attention.fused_decode_attention`.

Dequantizes the stored tokens with the real quantizer, appends the full-precision window and computes
``softmax(q k^T * scaling) v`` in fp32 with GQA, plus the per-key probability sums H2O accumulates (Zhang et
al. 2023, arXiv 2306.14048 §4). Slow but obviously right: the kernel tests compare against it.
"""

from __future__ import annotations

import torch

from h2o_compress.formats.base import StoredTensor
from h2o_compress.formats.integer import IntQuantizer


def _dequantize(stored: StoredTensor, bits: int, group_size: int, head_dim: int) -> torch.Tensor:
    """fp32 ``[batch, kv_heads, seq, head_dim]`` of an int4/int8 (``IntQuantizer``) or raw (16, ``{"x"}``) store."""
    if bits == 16:
        return stored.parts["x"].float()
    return IntQuantizer(bits, group_size, head_dim, rotate=False).dequantize(stored, torch.float32)


def reference_decode_attention(
    query: torch.Tensor, stored_keys: StoredTensor | None, stored_values: StoredTensor | None, key_bits: int,
    value_bits: int, group_size: int, window_keys: torch.Tensor | None, window_values: torch.Tensor | None,
    scaling: float, need_probability_sums: bool, block_tokens: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of one new query over stored tokens followed by window tokens (the arguments of
    `fused_decode_attention`, which this function specifies).

    Args:
        query: ``[batch, q_heads, 1, head_dim]`` (in the keys' basis).
        stored_values: as ``stored_keys``, for the values.
        stored_keys: stored tokens (``key_bits``/``value_bits`` 4 or 8: ``IntQuantizer`` parts;
            16: ``{"x": raw}``), or ``None``.
        window_keys: raw ``[batch, kv_heads, w, head_dim]`` after the stored tokens, or ``None``.
        window_values: the values of those tokens, as ``window_keys``.
        block_tokens: ignored (kept for the kernel's signature).

    Returns:
        Output ``[batch, q_heads, 1, head_dim]`` in ``query.dtype`` (in the values' basis) and, when
        ``need_probability_sums``, fp32 ``[batch, kv_heads, stored + w]``: each key's softmax probability summed
        over the ``q_heads // kv_heads`` query heads sharing its KV head.
    """
    head_dim = query.shape[-1]
    keys, values = [], []
    if stored_keys is not None and len(stored_keys):
        keys.append(_dequantize(stored_keys, key_bits, group_size, head_dim))
        values.append(_dequantize(stored_values, value_bits, group_size, head_dim))
    if window_keys is not None and window_keys.shape[2]:
        keys.append(window_keys.float())
        values.append(window_values.float())
    if not keys:
        raise ValueError("decode attention needs at least one stored or window token")
    k, v = torch.cat(keys, 2), torch.cat(values, 2)
    batch, kv_heads, tokens, _ = k.shape
    group = query.shape[1] // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = torch.softmax(query.float() @ k.transpose(-1, -2) * scaling, dim=-1)  # [batch, q_heads, 1, tokens]
    output = (probs @ v).to(query.dtype)
    sums = probs.view(batch, kv_heads, group, tokens).sum(2) if need_probability_sums else None
    return output, sums
