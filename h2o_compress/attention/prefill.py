"""One pass for a scored multi-token step (prefill, a chunk): the attention output and the H2O column sums from the
same softmax, instead of SDPA followed by a second q @ k^T + softmax for the scores
([`attention_probability_sums`][h2o_compress.attention.attention_probability_sums]).

On the CPU the pass is one native call (``cpu_prefill.c``, built with the decode kernel by
`h2o_compress.attention.cpu.library`): a tiled kernel that keeps each block's logits in cache, faster than
SDPA's unscored flash attention there (``benchmarks/results/prefill_7900_cpu.md``). Elsewhere (CUDA, no C compiler,
``H2O_COMPRESS_NATIVE=0``, under ``torch.compile``) the same arithmetic runs as blocked torch ops
(`blocked_attention_with_sums`).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from h2o_compress.attention import cpu

# fp32 logits per block: 16 MiB (blocks of ~59 queries at 8k keys with 9 query heads): large enough for few ops per
# layer, which matters most when other jobs share the cores (every op of 2 threads waits for both); much larger
# blocks ran slower on a CPU
BLOCK_ELEMENTS = 1 << 22


def attention_with_sums(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
    scaling: float | None, block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and H2O column sums from one softmax (see `blocked_attention_with_sums` for the arguments,
    shapes and semantics): the native CPU kernel (`native_attention_with_sums`) where it runs, else the
    blocked torch form. Both agree to fp32 rounding."""
    if query.device.type == "cpu" and not torch.compiler.is_compiling() and cpu.library() is not None:
        return native_attention_with_sums(query, keys, values, visible, scaling, block)
    return blocked_attention_with_sums(query, keys, values, visible, scaling, block)


def native_attention_with_sums(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
    scaling: float | None, block: int | None = None, threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`blocked_attention_with_sums` as one call of ``cpu_prefill.c`` (CPU tensors; the kernel must be built:
    `h2o_compress.attention.cpu.library`). Work items are (sequence, KV head, ``block`` queries), shared by
    ``threads`` threads (``None``: ``torch.get_num_threads()``); ``block`` ``None`` means about 48 rows (queries x
    the group's query heads) per item, whose logits (``48 x keys`` fp32) stay in the core's L2 cache.

    Raises:
        RuntimeError: the kernel could not allocate its scratch (or refused shapes the caller should not pass).
    """
    batch, q_heads, n, head_dim = query.shape
    kv_heads, total, value_dim = keys.shape[1], keys.shape[2], values.shape[-1]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    lib = cpu.library()
    tile = lib.h2o_cpu_prefill_tile()
    total_pad, value_pad = -(-total // tile) * tile, -(-value_dim // tile) * tile
    # [batch, kv_heads, n * group, head_dim] scaled; keys [.., head_dim, total_pad] and values [.., total_pad,
    # value_pad], zero-padded to whole tiles
    q = (query.float() * scale).view(batch, kv_heads, group, n, head_dim).transpose(2, 3).contiguous()
    k = F.pad(keys.float(), (0, 0, 0, total_pad - total)).transpose(-1, -2).contiguous()
    v = F.pad(values.float(), (0, value_pad - value_dim, 0, total_pad - total)).contiguous()
    output = torch.empty(batch, n, q_heads, value_dim, dtype=torch.float32)
    sums = torch.empty(batch, kv_heads, total, dtype=torch.float32)
    strides = (0, 0, 0)
    if visible is not None:
        if visible.dtype != torch.bool or visible.stride(-1) != 1:
            visible = visible.to(torch.bool).contiguous()
        strides = tuple(0 if visible.shape[d] == 1 else visible.stride(d) for d in range(3))
    block = max(1, 48 // group) if block is None else block
    status = lib.h2o_cpu_prefill_attention(
        batch, kv_heads, group, n, total, total_pad, head_dim, value_dim, value_pad, min(block, n),
        threads or torch.get_num_threads(), *(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v)),
        None if visible is None else ctypes.c_void_p(visible.data_ptr()), *map(ctypes.c_int64, strides),
        ctypes.c_void_p(output.data_ptr()), ctypes.c_void_p(sums.data_ptr()),
    )
    if status:
        reason = "it could not allocate its scratch" if status == 2 else "it refused the shapes"
        raise RuntimeError(f"cpu_prefill.c failed (status {status}): {reason}")
    return output.to(values.dtype), sums


def _block_rows(logits_per_row: int) -> int:
    """Queries per block of `blocked_attention_with_sums`: about `BLOCK_ELEMENTS` fp32 logits, 16 to 256."""
    return min(256, max(16, BLOCK_ELEMENTS // max(1, logits_per_row)))


def blocked_attention_with_sums(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
    scaling: float | None, block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``n`` queries over ``held + n`` keys (the held tokens, then the chunk's own) and the sum of the
    probabilities each key receives, summed over the queries and the query heads of its KV head (H2O, arXiv
    2306.14048 §4: the accumulated attention score), from one fp32 softmax.

    Query blocks ``[a, b)``: logits against keys ``[0, held + b)`` only (a query never sees a later chunk token, so
    the upper right of the causal matrix is skipped), masked where ``visible`` says, softmax in fp32, output block
    ``p @ v``, sums ``+= p`` summed over the block's queries and the group's query heads. GQA without repeating
    keys: the ``group`` query heads of a KV head are one ``[group * block, head_dim]`` matmul operand. One KV head at
    a time, so the workspace is one head group's block of logits (about `BLOCK_ELEMENTS` fp32), whatever the number
    of heads. Inference only: the logits and probabilities of a block share one buffer, written in place (no
    autograd).

    Args:
        query: ``[batch, q_heads, n, head_dim]``.
        keys: ``[batch, kv_heads, held + n, head_dim]``; ``q_heads`` a multiple of ``kv_heads``.
        values: ``[batch, kv_heads, held + n, value_dim]``.
        visible: bool ``[batch | 1, kv_heads | 1, n, held + n]`` (``True`` = seen; every row sees at least one
            key), or ``None``: causal, bottom-right aligned (query ``i`` sees keys ``0 .. held + i``). A mask that
            shows a query a later chunk token is honoured (that block reads every key).
        scaling: softmax scale; ``None`` means ``head_dim ** -0.5``.
        block: queries per block; ``None``: about `BLOCK_ELEMENTS` fp32 logits per block.

    Returns:
        ``(output [batch, n, q_heads, value_dim]`` in ``values``' dtype (the layout transformers' attention
        functions return), ``sums`` fp32 ``[batch, kv_heads, held + n]``).
    """
    batch, q_heads, n, head_dim = query.shape
    kv_heads, total, value_dim = keys.shape[1], keys.shape[2], values.shape[-1]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    block = min(_block_rows(batch * group * total) if block is None else block, n)
    # [batch, kv_heads, n * group, head_dim], scaled once: a block's rows (query, head) are one contiguous slice
    q = (query.float() * scale).view(batch, kv_heads, group, n, head_dim).transpose(2, 3).contiguous()
    q = q.view(batch, kv_heads, n * group, head_dim)
    output = torch.empty(batch, n, kv_heads, group, value_dim, dtype=values.dtype, device=query.device)
    sums = torch.zeros(batch, kv_heads, total, dtype=torch.float32, device=query.device)
    # one buffer for every block's logits (then probabilities, in place), one KV head's query group at a time: no
    # allocation per block, and the scoring workspace does not grow with the heads
    scratch = torch.empty(batch * group * block * total, dtype=torch.float32, device=query.device)
    above = torch.ones(block, block, dtype=torch.bool, device=query.device).triu(1)
    for head in range(kv_heads):
        mask = None if visible is None else visible[:, head : head + 1] if visible.shape[1] > 1 else visible
        _head_blocks(q[:, head : head + 1], keys[:, head : head + 1].float(), values[:, head : head + 1].float(),
                     mask, block, scratch, above, output[:, :, head : head + 1], sums[:, head : head + 1])
    return output.view(batch, n, q_heads, value_dim), sums


def _head_blocks(q, k, v, visible, block: int, scratch, above, output, sums) -> None:
    """`blocked_attention_with_sums` of one KV head, in place: ``q`` ``[batch, 1, n * group, head_dim]`` (scaled),
    ``k`` ``[batch, 1, total, head_dim]`` and ``v`` ``[batch, 1, total, value_dim]`` fp32, ``visible`` ``[batch | 1,
    1, n, total]`` or ``None``; writes ``output`` ``[batch, n, 1, group, value_dim]`` and adds to ``sums`` ``[batch,
    1, total]``."""
    batch, n, group, value_dim = output.shape[0], output.shape[1], output.shape[3], output.shape[4]
    total = k.shape[2]
    held = total - n
    hidden = None if visible is None else visible.logical_not()
    for a in range(0, n, block):
        b, rows = min(a + block, n), min(block, n - a)
        cut = held + b  # keys a causal block reads
        if visible is not None and cut < total and visible[..., a:b, cut:].any():
            cut = total  # a mask that is not causal: read every key
        logits = scratch[: batch * group * rows * cut].view(batch, 1, rows * group, cut)
        torch.matmul(q[:, :, a * group : b * group], k[:, :, :cut].transpose(-1, -2), out=logits)
        per_query = logits.view(batch, 1, rows, group, cut)
        if visible is not None:
            per_query.masked_fill_(hidden[..., a:b, :cut].unsqueeze(3), float("-inf"))
        elif rows > 1:  # causal: only the last `rows` keys (the block's own diagonal square) hide anything
            per_query[..., cut - rows :].masked_fill_(above[:rows, None, :rows], float("-inf"))
        probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)
        sums[..., :cut] += probs.sum(dim=2)
        out = torch.matmul(probs, v[:, :, :cut])
        output[:, a:b] = out.view(batch, 1, rows, group, value_dim).transpose(1, 2)
