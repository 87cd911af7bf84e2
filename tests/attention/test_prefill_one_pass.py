"""The one-pass scored prefill (:func:`h2o_compress.attention.prefill.attention_with_sums`), in both its forms (the
native CPU kernel ``cpu_prefill.c`` and the blocked torch ops), gives what the two-pass path gives: SDPA's output and
:func:`~h2o_compress.attention.attention_probability_sums`' column sums, on random inputs with GQA, a held prefix,
left padding and a sliding window; and a cache prefilled with it keeps the same tokens as one prefilled through the
two passes."""

from __future__ import annotations

import ctypes
import itertools
import platform
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.attention import attention_probability_sums, cpu
from h2o_compress.attention.prefill import (
    attention_with_sums,
    blocked_attention_with_sums,
    native_attention_with_sums,
)
from h2o_compress.cache import chunk as chunk_module

BATCH, KV_HEADS, GROUP, HELD, N, HEAD_DIM = 2, 2, 3, 7, 19, 16
NATIVE = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the CPU kernels cannot be built")
FORMS = [pytest.param(native_attention_with_sums, id="native", marks=NATIVE),
         pytest.param(blocked_attention_with_sums, id="torch")]


def visibility(held: int, pad: int, window: int | None, generator) -> torch.Tensor:
    """bool ``[batch, kv_heads, n, held + n]`` built as :func:`h2o_compress.cache.chunk.attend` builds it: held slots
    (some empty, per KV head), the chunk's causal block, sequence 1 left-padded by ``pad`` tokens (a padding query
    sees itself only), and an optional sliding window of ``window`` positions."""
    queries = torch.arange(held, held + N)
    held_valid = torch.rand(BATCH, KV_HEADS, 1, held, generator=generator) > 0.3
    own = torch.ones(N, N, dtype=torch.bool).tril().expand(BATCH, KV_HEADS, N, N).clone()
    own[1, :, :, :pad] = False  # nobody sees sequence 1's padding...
    eye = torch.eye(N, dtype=torch.bool)
    own |= eye  # ...but a padding query sees itself
    mask = torch.cat((held_valid.expand(-1, -1, N, -1), own), dim=3)
    if window is not None:
        keys = torch.arange(held + N)
        mask &= keys[None, :] > queries[:, None] - window
        mask[..., held:] |= eye
    return mask


def two_pass(query, keys, values, mask, scaling):
    """The path the one pass replaces: SDPA (keys repeated per query head) + the chunked column sums."""
    sdpa_mask = mask if mask is None or mask.shape[1] == 1 else mask.repeat_interleave(GROUP, dim=1)
    n, total = query.shape[2], keys.shape[2]
    if mask is None and total > n:  # bottom-right causal, as attention_probability_sums reads None
        sdpa_mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    output = F.scaled_dot_product_attention(query, keys.repeat_interleave(GROUP, 1), values.repeat_interleave(GROUP, 1),
                                            attn_mask=sdpa_mask, is_causal=sdpa_mask is None, scale=scaling)
    return output.transpose(1, 2), attention_probability_sums(query, keys, mask, scaling, chunk_size=5)


@pytest.mark.parametrize("held, pad, window, masked", [
    (0, 0, None, False),  # a first prefill, causal, no mask
    (HELD, 0, None, False),  # a later chunk, causal over the held prefix, no mask
    (0, 4, None, True),  # left padding
    (HELD, 4, None, True),  # held prefix (some slots empty) + padding
    (HELD, 4, 5, True),  # + a sliding window
])
@pytest.mark.parametrize("block", [1, 4, 64, None])
@pytest.mark.parametrize("form", FORMS)
def test_one_pass_matches_sdpa_and_the_probability_sums(held, pad, window, masked, block, form):
    generator = torch.Generator().manual_seed(held * 100 + pad * 10 + (window or 0))
    query = torch.randn(BATCH, KV_HEADS * GROUP, N, HEAD_DIM, generator=generator)
    keys = torch.randn(BATCH, KV_HEADS, held + N, HEAD_DIM, generator=generator)
    values = torch.randn(BATCH, KV_HEADS, held + N, HEAD_DIM + 8, generator=generator)  # a value dim of its own
    mask = visibility(held, pad, window, generator) if masked else None
    output, sums = form(query, keys, values, mask, 0.3, block=block)
    expected_output, expected_sums = two_pass(query, keys, values, mask, 0.3)
    assert output.shape == expected_output.shape and sums.shape == expected_sums.shape == (BATCH, KV_HEADS, held + N)
    torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums, expected_sums, rtol=1e-5, atol=1e-6)
    if masked:  # keys no query sees (padding, empty held slots) receive nothing
        assert (sums[~mask.any(2)] == 0).all()


@pytest.mark.parametrize("form", FORMS)
def test_a_mask_that_shows_a_later_token_is_honoured(form):
    """Not a causal mask (a query sees a later chunk token): that block reads every key, as the two passes do."""
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, KV_HEADS * GROUP, N, HEAD_DIM, generator=generator)
    keys = torch.randn(1, KV_HEADS, N, HEAD_DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, N, HEAD_DIM, generator=generator)
    mask = torch.ones(N, N, dtype=torch.bool).tril()
    mask[2, 10] = True
    mask = mask.expand(1, 1, N, N)
    output, sums = form(query, keys, values, mask, None, block=4)
    expected_output, expected_sums = two_pass(query, keys, values, mask, None)
    torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums, expected_sums, rtol=1e-5, atol=1e-6)


@NATIVE
@pytest.mark.parametrize("group, held, n, value_dim, threads, dtype", [
    (1, 0, 150, 64, 1, torch.float32),  # MHA; more keys than one tile and one value block
    (4, 90, 170, 80, 3, torch.float32),  # held prefix; a value width that is not a whole tile; 3 threads
    (3, 0, 300, 64, 2, torch.bfloat16),  # a bf16 model: fp32 inside, output in bf16
])
def test_the_native_kernel_matches_the_torch_form_at_larger_shapes(group, held, n, value_dim, threads, dtype):
    """Several key tiles, value blocks and work items per thread: the native kernel and the blocked torch ops agree
    to fp32 rounding (bf16: to the output's rounding), and the sums of every query's probabilities add up to
    ``queries x query heads``."""
    generator = torch.Generator().manual_seed(n)
    query = torch.randn(2, 2 * group, n, 64, generator=generator).to(dtype)
    keys = torch.randn(2, 2, held + n, 64, generator=generator).to(dtype)
    values = torch.randn(2, 2, held + n, value_dim, generator=generator).to(dtype)
    output, sums = native_attention_with_sums(query, keys, values, None, None, threads=threads)
    expected_output, expected_sums = blocked_attention_with_sums(query, keys, values, None, None)
    assert output.dtype == dtype and sums.dtype == torch.float32
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(output, expected_output, **tolerance)
    torch.testing.assert_close(sums, expected_sums, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums.sum(-1), torch.full((2, 2), float(n * group)), rtol=1e-5, atol=1e-3)


@NATIVE
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set variants")
@pytest.mark.parametrize("flags", [["-march=native", "-mno-avx512f"], ["-march=x86-64"]], ids=["avx2", "sse"])
def test_the_native_kernel_built_for_narrower_vectors_gives_the_same_results(monkeypatch, tmp_path, flags):
    """``cpu_prefill.c`` picks its tile from the vector width it is built for (AVX-512: 64 keys, AVX: 16, 128-bit:
    8); the builds this machine does not pick by itself give the blocked torch form's results too."""
    target = tmp_path / "prefill.so"
    subprocess.run(["gcc", "-O3", *flags, "-std=gnu11", "-shared", "-fPIC", "-pthread",
                    str(cpu.SOURCES[0].with_name("cpu_prefill.c")), "-o", str(target), "-lm"], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(str(target))
    lib.h2o_cpu_prefill_attention.restype = lib.h2o_cpu_prefill_tile.restype = ctypes.c_int
    assert lib.h2o_cpu_prefill_tile() == (16 if "-mno-avx512f" in flags else 8)
    monkeypatch.setattr(cpu, "library", lambda: lib)
    generator = torch.Generator().manual_seed(11)
    query = torch.randn(2, 6, 70, 32, generator=generator)
    keys, values = torch.randn(2, 2, 90, 32, generator=generator), torch.randn(2, 2, 90, 40, generator=generator)
    mask = visibility_of(keys.shape[2], query.shape[2], generator)
    for visible in (None, mask):
        output, sums = native_attention_with_sums(query, keys, values, visible, None, threads=2)
        expected_output, expected_sums = blocked_attention_with_sums(query, keys, values, visible, None)
        torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sums, expected_sums, rtol=1e-5, atol=1e-5)


def visibility_of(total: int, n: int, generator) -> torch.Tensor:
    """bool ``[2, 2, n, total]``: causal over a held prefix of ``total - n`` tokens, some held tokens hidden per
    sequence and head (every query still sees itself)."""
    held = total - n
    causal = torch.ones(n, total, dtype=torch.bool).tril(held)
    mask = causal & (torch.rand(2, 2, 1, total, generator=generator) > 0.3)
    return mask | torch.cat((torch.zeros(n, held, dtype=torch.bool), torch.eye(n, dtype=torch.bool)), 1)


def test_attention_with_sums_runs_the_native_kernel_on_the_cpu_unless_switched_off(monkeypatch):
    """The dispatcher: the native kernel where it is built, the blocked torch form with ``H2O_COMPRESS_NATIVE=0``."""
    calls = []
    monkeypatch.setattr("h2o_compress.attention.prefill.native_attention_with_sums",
                        lambda *args: calls.append("native") or blocked_attention_with_sums(*args))
    query, keys, values = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    attention_with_sums(query, keys, values, None, None)
    assert calls == (["native"] if cpu.library() is not None else [])
    before = len(calls)
    cpu.library.cache_clear()
    try:
        monkeypatch.setenv("H2O_COMPRESS_NATIVE", "0")
        attention_with_sums(query, keys, values, None, None)
        assert len(calls) == before
    finally:
        monkeypatch.delenv("H2O_COMPRESS_NATIVE")
        cpu.library.cache_clear()


@pytest.mark.parametrize("chunks", [1, 3])
@torch.inference_mode()
def test_a_cache_prefilled_in_one_pass_keeps_the_same_tokens(monkeypatch, chunks):
    """h2o prefill of a left-padded batch (whole, or in 3 chunks: a held prefix), one pass against two passes:
    same kept positions, scores and logits to float tolerance."""
    model = tiny_llama(kv_heads=2, heads=6)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 128, (2, 30), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    config = CompressionConfig(policy="h2o", budget=12, kv_bits=16, residual=2)
    used = []

    def prefill(one_pass: bool):
        monkeypatch.setattr(chunk_module, "one_pass", lambda *args: used.append(one_pass) or one_pass)
        cache = make_cache(model, config, max_length=40)
        bounds = torch.linspace(0, ids.shape[1], chunks + 1).long().tolist()
        for a, b in itertools.pairwise(bounds):
            logits = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=positions[:, a:b],
                           past_key_values=cache).logits
        return cache, logits

    fast, fast_logits = prefill(True)
    slow, slow_logits = prefill(False)
    assert set(used) == {True, False}
    torch.testing.assert_close(fast_logits, slow_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(fast.layers, slow.layers, strict=True):
        held_a, held_b = a.tensors(), b.tensors()
        assert held_a.keys() == held_b.keys()
        for name in held_a:
            if "position" in name:
                assert torch.equal(held_a[name], held_b[name]), name
            elif held_a[name].is_floating_point():
                torch.testing.assert_close(held_a[name], held_b[name], rtol=1e-5, atol=1e-6, msg=name)
