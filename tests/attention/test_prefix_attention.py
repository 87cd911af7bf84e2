"""Fused decode attention (Triton) against the pure-torch reference, on real IntQuantizer storage.

Without a GPU the kernels run under the Triton interpreter (tests/attention/conftest.py), so sizes stay small.
Every case reads the stored tokens and the window through views of larger buffers whose extra tokens are
NaN/garbage, and the kernel's scratch buffers are pre-filled with NaN, so a read past the valid length or of
an element never written shows up as a wrong or non-finite result.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import compile_for_sm90

pytest.importorskip("triton")

from h2o_compress.attention import prefix_attention as da  # noqa: E402
from h2o_compress.attention.prefix_attention import choose_splits, fused_decode_attention  # noqa: E402
from h2o_compress.attention.reference import reference_decode_attention  # noqa: E402
from h2o_compress.formats.base import StoredTensor  # noqa: E402
from h2o_compress.formats.integer import IntQuantizer  # noqa: E402

PAD = 5  # garbage tokens after the valid ones in every stored/window buffer


@pytest.fixture(autouse=True)
def nan_scratch(monkeypatch):
    """Scratch buffers start as NaN: any element read before being written poisons the result."""
    monkeypatch.setattr(da, "_scratch", lambda shape, device: torch.full(shape, float("nan"), device=device))


def padded(x: torch.Tensor, fill: float | int) -> torch.Tensor:
    """``x`` (token dim 2) as a view of a buffer with ``PAD`` more tokens set to ``fill``."""
    buffer = torch.full((*x.shape[:2], x.shape[2] + PAD, *x.shape[3:]), fill, dtype=x.dtype, device=x.device)
    buffer[:, :, : x.shape[2]] = x
    return buffer[:, :, : x.shape[2]]


def stored(x: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype) -> StoredTensor:
    """``x`` ``[batch, kv_heads, seq, head_dim]`` quantized by the real IntQuantizer (bits 4/8) or kept raw in
    ``dtype`` (16), every part a view of a garbage-padded buffer."""
    if bits == 16:
        return StoredTensor({"x": padded(x.to(dtype), float("nan"))})
    parts = IntQuantizer(bits, group_size, x.shape[-1]).quantize(x).parts
    return StoredTensor({"data": padded(parts["data"], 255), "scale_zero": padded(parts["scale_zero"], float("nan"))})


def make_inputs(batch, kv_heads, group, head_dim, tokens, window, key_bits, value_bits, group_size,
                dtype=torch.float32, device="cpu", seed=0):
    """Kwargs for both implementations. ``tokens`` 0 means ``stored_* = None``; ``window`` None means no window
    tensors (0: an empty one). The query is a non-contiguous view ([batch, 1, heads, dim] transposed)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    query = randn(batch, 1, kv_heads * group, head_dim, scale=2.0).to(dtype).transpose(1, 2)
    kv = (batch, kv_heads, tokens, head_dim)
    keys = randn(*kv) + randn(1, 1, 1, head_dim, scale=3.0)  # a few outlier channels, like real keys
    stored_keys = stored(keys, key_bits, group_size, dtype) if tokens else None
    stored_values = stored(randn(*kv), value_bits, group_size, dtype) if tokens else None
    if window is None:
        window_keys = window_values = None
    else:
        window_keys = padded(randn(batch, kv_heads, window, head_dim).to(dtype), float("nan"))
        window_values = padded(randn(batch, kv_heads, window, head_dim).to(dtype), float("nan"))
    return dict(query=query, stored_keys=stored_keys, stored_values=stored_values, key_bits=key_bits,
                value_bits=value_bits, group_size=group_size, window_keys=window_keys, window_values=window_values,
                scaling=head_dim**-0.5, need_probability_sums=True, block_tokens=32)


# (output error / max |output|, probability-sum error) allowed per query dtype. Half-precision queries take
# half-precision matmul operands (dequantized K, probabilities), as the model's own attention does, against an
# fp32 reference: about 2^-11 (fp16) / 2^-8 (bf16) relative error per operand, a few times that on the logits.
TOLERANCE = {torch.float32: (2e-3, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}


def check(inputs):
    """Kernel == reference: output within the :data:`TOLERANCE` of the output's scale, probability sums within
    theirs, each query head's probabilities summing to 1; returns the kernel's results."""
    out_tol, prob_tol = TOLERANCE[inputs["query"].dtype]
    output, sums = fused_decode_attention(**inputs)
    ref_output, ref_sums = reference_decode_attention(**inputs)
    assert output.shape == ref_output.shape and output.dtype == inputs["query"].dtype
    assert torch.isfinite(output).all() and torch.isfinite(sums).all()
    scale = ref_output.float().abs().max().item()
    out_err = (output.float() - ref_output.float()).abs().max().item()
    assert out_err <= out_tol * scale, (out_err, scale)
    assert sums.shape == ref_sums.shape and sums.dtype == torch.float32
    assert (sums - ref_sums).abs().max().item() <= prob_tol
    group = inputs["query"].shape[1] // sums.shape[1]
    torch.testing.assert_close(sums.sum(-1), torch.full_like(sums[..., 0], group), atol=1e-4, rtol=0)
    return output, sums


# (batch, kv_heads, group, head_dim, group_size): MHA, SmolLM2-like GQA (3 KV heads x 3), GQA 2, head_dim 32/128
SHAPES = [(1, 2, 1, 64, 32), (1, 3, 3, 64, 64), (2, 1, 3, 32, 32), (2, 2, 2, 128, 128), (1, 1, 3, 128, 32)]
BITS = [(4, 4), (8, 8), (4, 8), (8, 4)]
LENGTHS = [(1, None), (5, 3), (63, 7), (65, 0), (129, 3)]  # (stored tokens, window tokens)
CASES = [(bits, length, SHAPES[(i + j) % len(SHAPES)])
         for (i, bits), (j, length) in itertools.product(enumerate(BITS), enumerate(LENGTHS))]


@pytest.mark.parametrize("bits,lengths,shape", CASES)
def test_matches_reference(bits, lengths, shape, device):
    batch, kv_heads, group, head_dim, group_size = shape
    check(make_inputs(batch, kv_heads, group, head_dim, *lengths, *bits, group_size, device=device))


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [1, 7, 70])
def test_window_only(group, window, device):
    check(make_inputs(2, 2, group, 64, 0, window, 4, 4, 32, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_raw_16bit_storage(dtype, device):
    """``{"x": raw}`` storage (NoQuantizer) as the stored segment, also mixed with int4 values."""
    check(make_inputs(1, 3, 3, 64, 40, 3, 16, 16, 32, dtype=dtype, device=device))
    check(make_inputs(1, 3, 3, 64, 40, 3, 16, 4, 32, device=device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_query(dtype, device):
    """16-bit queries/windows: matmul operands in that dtype (fp32 under the interpreter for bf16), output in it."""
    check(make_inputs(2, 3, 3, 64, 65, 7, 4, 8, 32, dtype=dtype, device=device))


@pytest.mark.parametrize("sm_count", [1, 2])
def test_several_blocks_per_split(sm_count, monkeypatch, device):
    """Few SMs -> few splits, so each program loops over several blocks (online-softmax rescaling)."""
    monkeypatch.setattr(da, "_sm_count", lambda device: sm_count)
    inputs = make_inputs(1, 2, 3, 64, 150, 40, 4, 8, 32, device=device)
    check(inputs)
    monkeypatch.setattr(da, "choose_splits", lambda *args: (1, 256))  # one split per segment
    check(inputs)


def test_padding_never_read(device):
    """Same result from exact-size tensors as from views of garbage-padded buffers (bitwise)."""
    inputs = make_inputs(2, 2, 2, 64, 33, 5, 4, 8, 32, device=device)
    dense = dict(inputs, query=inputs["query"].contiguous(),
                 stored_keys=StoredTensor({k: v.clone() for k, v in inputs["stored_keys"].parts.items()}),
                 stored_values=StoredTensor({k: v.clone() for k, v in inputs["stored_values"].parts.items()}),
                 window_keys=inputs["window_keys"].clone(), window_values=inputs["window_values"].clone())
    for a, b in zip(fused_decode_attention(**inputs), fused_decode_attention(**dense)):
        assert torch.equal(a, b)


def test_without_probability_sums(device):
    inputs = make_inputs(1, 2, 3, 64, 20, 3, 8, 4, 64, device=device)
    output, sums = fused_decode_attention(**dict(inputs, need_probability_sums=False))
    assert sums is None
    torch.testing.assert_close(output, fused_decode_attention(**inputs)[0], atol=0, rtol=0)


def test_rejects_unsupported_inputs(device):
    base = make_inputs(1, 2, 2, 64, 8, 2, 4, 4, 32, device=device)
    bad = [
        dict(query=torch.zeros(1, 4, 2, 64, device=device)),  # two query tokens
        dict(key_bits=3),
        dict(group_size=48),
        dict(block_tokens=24),
        dict(query=torch.zeros(1, 3, 1, 64, device=device)),  # q_heads not a multiple of kv_heads
        dict(stored_keys=None, stored_values=None, window_keys=None, window_values=None),  # nothing to attend to
        dict(window_values=base["window_values"][:, :, :1]),
        dict(stored_values=None),
        dict(stored_values=StoredTensor({"x": torch.zeros(1, 2, 8, 64, device=device)})),  # parts of another format
    ]
    for change in bad:
        with pytest.raises(ValueError):
            fused_decode_attention(**dict(base, **change))
    odd_dim = make_inputs(1, 1, 1, 48, 4, 0, 8, 8, 16, device=device)
    with pytest.raises(ValueError, match="power of two"):
        fused_decode_attention(**odd_dim)


@pytest.mark.parametrize(
    "batch,kv_heads,tokens",
    [(1, 3, 1), (1, 3, 100), (1, 3, 32768), (1, 1, 40000), (8, 8, 4096), (4, 32, 40000), (64, 8, 100000)],
)
def test_choose_splits(batch, kv_heads, tokens):
    splits, split_tokens = choose_splits(batch, kv_heads, tokens, 64)
    assert splits >= 1 and split_tokens % 64 == 0
    assert (splits - 1) * split_tokens < tokens <= splits * split_tokens  # covers everything, none empty
    programs = batch * kv_heads * splits
    assert programs <= max(4 * 132, batch * kv_heads)
    if tokens >= 64 * 4 * 132:  # long enough for every program to get a block: at least 2x the SMs
        assert programs >= 2 * 132


def test_kernels_compile_for_h100():
    """The kernels lower to sm_90 machine code (no GPU needed: Triton's bundled ptxas), for every format, so a
    typo that the interpreter forgives fails here rather than on the first GPU run."""
    pytest.importorskip("triton.backends.nvidia")
    compile_for_sm90("""
        from h2o_compress.attention import prefix_attention as da
        ints = ("q_b q_h q_d k_b k_h k_n ksz_b ksz_h ksz_n v_b v_h v_n vsz_b vsz_h vsz_n "
                "seq_len split_tokens slot_base token_base num_slots total_tokens")
        for q, dot, k_fmt, v_fmt, head_dim, group_size, group in [
                ("*fp16", tl.float16, 4, 8, 64, 32, 3), ("*bf16", tl.bfloat16, 8, 4, 128, 128, 1),
                ("*fp32", tl.float32, 4, 4, 32, 32, 2), ("*fp16", tl.float16, 16, 16, 128, 64, 3)]:
            sig = dict({n: "i32" for n in ints.split()}, q=q, scaling="fp32",
                       k="*fp16" if k_fmt == 16 else "*u8", v="*fp16" if v_fmt == 16 else "*u8",
                       ksz="*fp16", vsz="*fp16", part_m="*fp32", part_l="*fp32", part_acc="*fp32", logits="*fp32")
            compile(da._partial_kernel, sig, dict(KV_HEADS=3, G=group, GP=16, D=head_dim, GROUP=group_size, K_FMT=k_fmt,
                    V_FMT=v_fmt, BLOCK_N=64, WRITE_LOGITS=True, DOT=dot, PRECISION="ieee" if q == "*fp32" else "tf32"))
        compile(da._combine_kernel, dict(part_m="*fp32", part_l="*fp32", part_acc="*fp32", out="*bf16", lse="*fp32",
                num_slots="i32"), dict(D=128, BLOCK_S=16))
        compile(da._prob_sums_kernel, dict(logits="*fp32", lse="*fp32", probs="*fp32", total_tokens="i32"),
                dict(G=3, GP=4, BLOCK_T=256))
        print("compiled")
    """, TRITON_DEFAULT_FP_FUSION="1")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [(4, 4), (8, 8), (4, 8)])
@pytest.mark.parametrize("tokens,batch", [(4000, 1), (32000, 1), (3000, 8)])
def test_long_sequences_on_gpu(dtype, bits, tokens, batch):
    """Many splits and blocks per split at real lengths (SmolLM2-like 9 q / 3 KV heads, head_dim 64)."""
    check(make_inputs(batch, 3, 3, 64, tokens, 100, *bits, 32, dtype=dtype, device="cuda"))


@pytest.mark.cuda
def test_no_dequantized_copy_on_gpu():
    """Peak extra memory stays far below one dequantized fp16 copy of the keys (only the small split partials
    and the fp32 logits scratch are allocated)."""
    inputs = make_inputs(1, 3, 3, 64, 32000, 100, 4, 4, 32, dtype=torch.float16, device="cuda")
    fused_decode_attention(**inputs)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fused_decode_attention(**inputs)
    torch.cuda.synchronize()
    dequantized_keys = 3 * 32000 * 64 * 2
    assert torch.cuda.max_memory_allocated() - before < dequantized_keys / 4
