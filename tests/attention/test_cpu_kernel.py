"""The CPU decode kernel (``h2o_compress/attention/cpu_decode.c``) against the cache's torch form.

Both forms run the same decode steps over the same buffers; the kernel must keep the same tokens (positions
identical in every layer) and give the same logits up to float summation order (16 bits: 1e-5; quantized: a
value on an fp16 or code rounding boundary can land one step apart, so 1e-3). Also: the build falls back to
the torch form when switched off or when no compiler works, and the custom op passes ``torch.library.opcheck``.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import TINY_MODELS
from helpers.decode_steps import POLICIES, run, setting
from helpers.pairwise import decode_matrix

import torch._dynamo

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.policies import policy_names
from h2o_compress.runtime.compiled import decode_step
from h2o_compress.policies import make_policy
from h2o_compress.attention import cpu

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the CPU kernel cannot be built")


def both_forms(arch: str, config: CompressionConfig, dtype=torch.float32):
    model = TINY_MODELS[arch]().to(dtype)
    with torch.inference_mode():
        native, native_cache, _, _ = run(model, config, decode_step)
        reference, torch_cache, _, _ = run(model, dataclasses.replace(config, attention_kernel="torch"), decode_step)
    assert all((layer.backend.name == "cpu") for layer in native_cache.layers)
    assert not any((layer.backend.name == "cpu") for layer in torch_cache.layers)
    return native, reference, native_cache, torch_cache


def same_tokens(a, b) -> None:
    for left, right in zip(a.layers, b.layers):
        assert torch.equal(left.positions(), right.positions())
        assert torch.equal(left.counters.seen, right.counters.seen)
        assert torch.equal(left.counters.first_real, right.counters.first_real)


@pytest.mark.parametrize("policy,arch,bits", decode_matrix(policy=POLICIES, arch=sorted(TINY_MODELS), bits=[16, 8, 4]))
def test_kernel_keeps_the_same_tokens_and_logits_as_the_torch_form(arch, policy, bits):
    """Every policy on every architecture, every policy at every width, every architecture at every width
    (all pairs; ``H2O_COMPRESS_FULL_MATRIX=1`` runs the whole cross product)."""
    native, reference, native_cache, torch_cache = both_forms(arch, setting(policy, bits))
    same_tokens(native_cache, torch_cache)
    torch.testing.assert_close(native, reference, atol=1e-5 if bits == 16 else 1e-3, rtol=0)
    if policy != "full":
        assert native_cache.kept_length() == 12
    native_cache.check()


@pytest.mark.parametrize("bits", [16, 4])
@pytest.mark.parametrize("policy", sorted(policy_names(shares_heads=True)))
@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_head_adaptive_pool_in_the_kernel_keeps_the_same_tokens(arch, policy, bits):
    """A head-adaptive layer's slot pool (``owner`` tags) in the kernel: each head's leaving token in the lowest
    free slot, attention over the slots its head owns, eviction over the pool by the caller; the same tokens and
    logits as the torch form, and the compiled step agrees."""
    config = dataclasses.replace(setting(policy, bits), head_budgets="adaptive")
    native, reference, native_cache, torch_cache = both_forms(arch, config)
    same_tokens(native_cache, torch_cache)
    for left, right in zip(native_cache.layers, torch_cache.layers):
        assert torch.equal(left.kept_per_head(), right.kept_per_head())
    torch.testing.assert_close(native, reference, atol=1e-5 if bits == 16 else 1e-3, rtol=0)
    assert native_cache.kept_length() <= 12 * native_cache.layers[0].geometry.kv_heads
    native_cache.check()


def test_head_adaptive_pool_compiles_with_the_kernel():
    model = TINY_MODELS["llama"]()
    config = dataclasses.replace(setting("h2o", 4), head_budgets="adaptive")
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, backend="eager")
    with torch.inference_mode():
        eager, eager_cache, _, _ = run(model, config, decode_step)
        ours, cache, _, _ = run(model, config, compiled)
    assert all((layer.backend.name == "cpu") for layer in cache.layers)
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)
    same_tokens(cache, eager_cache)


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("k_bits,v_bits", [(8, 4), (4, 16), (16, 8)])
def test_mixed_key_and_value_formats(k_bits, v_bits, rotate):
    config = dataclasses.replace(setting("h2o", 4), k_bits=k_bits, v_bits=v_bits, rotate=rotate)
    native, reference, native_cache, torch_cache = both_forms("llama", config)
    same_tokens(native_cache, torch_cache)
    torch.testing.assert_close(native, reference, atol=1e-3, rtol=0)


def test_stored_scores_and_codes_match_the_torch_form():
    """The state itself: scores to float precision, codes equal but for a few codes one step apart (a value on
    a rounding boundary: under 1 in 100 over the cache)."""
    _, _, native_cache, torch_cache = both_forms("llama", dataclasses.replace(setting("h2o", 8), rotate=False))
    apart_codes = total_codes = 0
    for left, right in zip(native_cache.layers, torch_cache.layers):
        mine, theirs = left.tensors(), right.tensors()
        for name in ("store.scores", "ring.scores"):
            torch.testing.assert_close(mine[name], theirs[name], atol=1e-5, rtol=1e-5)
        for name in ("store.keys.data", "store.values.data"):
            held = left.store.positions >= 0
            apart = (mine[name].int() - theirs[name].int()).abs()[held]
            assert int(apart.max()) <= 1
            apart_codes, total_codes = apart_codes + int((apart > 0).sum()), total_codes + apart.numel()
    assert apart_codes * 100 < total_codes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models(dtype):
    """16-bit models: the kernel computes in fp32 where the torch form rounds the dequantized tokens to the model
    dtype, so the logits agree to the model dtype's precision."""
    native, reference, native_cache, _ = both_forms("llama", setting("h2o", 4), dtype=dtype)
    assert native_cache.layers[0].ring.keys.dtype == dtype
    torch.testing.assert_close(native.float(), reference.float(), atol=0.05, rtol=0.05)


def prefilled(heads: str = "uniform"):
    """A tiny LLaMA and its h2o int4 cache (``head_budgets=heads``) after a 20-token prompt."""
    model = TINY_MODELS["llama"]()
    cache = make_cache(model, dataclasses.replace(setting("h2o", 4), head_budgets=heads), max_length=40)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 128, (1, 20)), past_key_values=cache)
    return model, cache


def test_non_finite_key_sets_the_flag_read_by_check():
    model, cache = prefilled()
    with torch.inference_mode():
        layer = cache.layers[0]
        keys = torch.full((1, layer.geometry.kv_heads, 1, layer.geometry.head_dim), float("nan"))
        cache.update(keys, torch.zeros_like(keys), 0)
        query = torch.zeros(1, 2 * layer.geometry.kv_heads, 1, layer.geometry.head_dim)
        layer.attend(model.model.layers[0].self_attn, query, keys, keys, None, None)
    assert not bool(layer.counters.finite)
    with pytest.raises(Exception, match="not finite|NaN"):
        cache.check()


def test_ranks_by_says_what_rank_returns():
    """The kernel reads ``ranks_by`` instead of calling ``rank()``: they must agree for every policy."""
    scores = torch.rand(2, 3, 10)
    positions = torch.arange(10).expand(2, 3, 10)
    for name in ("h2o", "h2o-mean", "local", "sink", "full"):
        policy = make_policy(name, 0.5, 2)
        rank = policy.rank(scores, positions, 12)
        if policy.ranks_by == "scores":
            assert torch.equal(rank, scores)
        elif policy.ranks_by == "nothing":
            assert bool((rank == rank.flatten()[0]).all())
        else:
            assert policy.ranks_by == "custom" and not torch.equal(rank, scores)


def test_switched_off_or_without_a_compiler_the_torch_form_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("H2O_COMPRESS_CACHE", str(tmp_path))
    try:
        cpu.library.cache_clear()
        monkeypatch.setenv("H2O_COMPRESS_NATIVE", "0")
        assert cpu.library() is None
        model = TINY_MODELS["llama"]()
        cache = make_cache(model, setting("h2o", 4), max_length=30)
        with torch.inference_mode():
            model(input_ids=torch.randint(0, 128, (1, 8)), past_key_values=cache)
        assert not (cache.layers[0].backend.name == "cpu")

        cpu.library.cache_clear()
        monkeypatch.setenv("H2O_COMPRESS_NATIVE", "1")
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        with pytest.warns(UserWarning, match="building the CPU decode kernel"):
            assert cpu.library() is None

        cpu.library.cache_clear()
        monkeypatch.setenv("CC", "no-such-compiler-h2o")
        with pytest.warns(UserWarning, match="no C compiler"):
            assert cpu.library() is None

        cpu.library.cache_clear()
        monkeypatch.delenv("CC")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu.library() is not None  # built afresh into the new cache directory
        assert list((tmp_path / "kernels").glob("cpu_decode-*.so"))
        assert not list((tmp_path / "kernels").glob("*.partial"))
    finally:
        cpu.library.cache_clear()


@pytest.mark.parametrize("budgets", ["uniform", "adaptive"])
def test_custom_op_passes_opcheck(budgets):
    _, cache = prefilled(budgets)
    layer = cache.layers[1]
    store, ring = layer.store, layer.ring
    heads, dim = layer.geometry.kv_heads, layer.geometry.head_dim
    pool = budgets == "adaptive"
    args = (
        torch.randn(1, 2 * heads, dim), torch.randn(1, heads, dim), torch.randn(1, heads, dim), dim**-0.5,
        4, 32, store.keys.parts["data"].clone(), store.keys.parts["scale_zero"].clone(), layer.geometry.key_basis,
        4, 32, store.values.parts["data"].clone(), store.values.parts["scale_zero"].clone(), layer.geometry.value_basis,
        store.positions.clone(), store.owner.clone() if pool else None, store.scores.clone(),
        ring.keys.clone(), ring.values.clone(), ring.positions.clone(), ring.scores.clone(), layer.counters.seen.clone(),
        layer.counters.first_real.clone(), layer.counters.finite.clone(), 12, 6, 0, None, not pool, None,
        layer.counters.consistent.clone(), False,
    )
    torch.library.opcheck(cpu.cpu_decode_layer, args, test_utils=("test_schema", "test_faketensor"))
    if pool:  # a pool without its head tags would be read as per-head slots, past its end: refused
        with pytest.raises(ValueError, match="store rows"):
            cpu._decode(*args[:15], None, *args[16:])
