"""The CPU decode kernel (``h2o_compress/attention/cpu_decode.c``) on several threads: its sequences split over
``torch.get_num_threads()`` threads must give bitwise the results of one thread (each sequence's arithmetic is
the same; only which thread runs it changes).

A batch of 8 left-padded prompts of different lengths is prefilled on one thread twice (two identical caches);
then the same decode steps, random queries, keys and values fed to each layer in turn, run on one thread in the
first cache and on 2 or 3 threads in the second. The shapes are above the kernel's threshold for threads
(``h2o_cpu_decode_parallel_work``), the longer prompts evict every step and the short ones not at all, and the
outputs and every buffer of the caches (codes, scales, positions, scores, ring, counters) must be equal. Both
builds: with OpenMP (torch's thread pool, the default) and without (pthreads of the kernel's own).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.attention import cpu

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the CPU kernel cannot be built")

PROMPT, STEPS, BATCH, BUDGET, RESIDUAL = 200, 6, 8, 160, 8
PADS = (0, 3, 17, 30, 64, 90, 150, 180)  # left padding per sequence: 200 down to 20 real tokens; the first 4 evict


def prefilled(model, config: CompressionConfig):
    """A cache of ``config`` for ``model`` after the left-padded prompt (``PADS``), prefilled on one thread."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (BATCH, PROMPT), generator=generator)
    mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    for row, pad in enumerate(PADS):
        mask[row, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = make_cache(model, config, max_length=PROMPT + STEPS)
    model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    return cache


def decode(model, cache, threads: int) -> list[torch.Tensor]:
    """``STEPS`` decode steps over every layer of ``cache`` with seeded random queries, keys and values
    ``[BATCH, heads, 1, head_dim]``, on ``threads`` torch threads: the attention outputs, one per layer and step."""
    generator = torch.Generator().manual_seed(11)
    config = model.config
    outputs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(STEPS):
            for index, layer in enumerate(cache.layers):
                shape = (BATCH, config.num_key_value_heads, 1, config.head_dim)
                keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
                query = torch.randn((BATCH, config.num_attention_heads, 1, config.head_dim), generator=generator)
                cache.update(keys, values, index)
                module = model.model.layers[index].self_attn
                outputs.append(layer.attend(module, query, keys, values, None, None))
    finally:
        torch.set_num_threads(before)
    return outputs


def one_and_many(bits: int, heads: str, policy: str, threads: int):
    """The outputs and caches of the same steps on one thread and on ``threads`` threads."""
    model = tiny_llama(kv_heads=2, heads=4, head_dim=64)
    config = CompressionConfig(policy=policy, budget=BUDGET, kv_bits=bits, residual=RESIDUAL, sink_tokens=2,
                               head_budgets=heads)
    with torch.inference_mode():
        torch.set_num_threads(1)
        caches = prefilled(model, config), prefilled(model, config)
        torch.set_num_threads(2)
        return decode(model, caches[0], 1), decode(model, caches[1], threads), caches


def same_results(bits: int, heads: str, policy: str, threads: int) -> None:
    """Assert that ``threads`` threads give bitwise the outputs and cache buffers of one (`one_and_many`)."""
    one, many, (cache, threaded) = one_and_many(bits, heads, policy, threads)
    layer = cache.layers[0]
    assert all(layer.backend.name == "cpu" for layer in threaded.layers)
    slots, ring = layer.store.positions.shape[-1], layer.ring.positions.shape[-1]
    work = BATCH * layer.geometry.kv_heads * (slots + ring) * layer.geometry.head_dim
    assert work >= cpu.library().h2o_cpu_decode_parallel_work()  # else both runs took the one-thread path
    assert len(one) == len(many) == STEPS * len(cache.layers)
    for mine, theirs in zip(one, many):
        assert torch.equal(mine, theirs)
    for left, right in zip(cache.layers, threaded.layers):
        mine, theirs = left.tensors(), right.tensors()
        assert mine.keys() == theirs.keys() and {"store.positions", "store.scores", "ring.positions"} <= mine.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name
        assert torch.equal(left.positions(), right.positions())
    # the steps evicted in the long sequences (held at the budget: per head, or over a pool's heads) and not in the
    # short ones (holding every real token)
    kept = threaded.layers[0].kept_per_head()
    assert kept[:4].sum(-1).tolist() == [BUDGET * layer.geometry.kv_heads] * 4
    assert kept[-1].tolist() == [PROMPT - PADS[-1] + STEPS] * layer.geometry.kv_heads
    assert int(threaded.layers[0].counters.seen) == PROMPT + STEPS


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_threads_give_bitwise_the_one_thread_results(policy, bits, heads, threads):
    same_results(bits, heads, policy, threads)


@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_without_openmp_pthreads_give_bitwise_the_one_thread_results(monkeypatch, tmp_path, heads):
    """The build for a compiler without OpenMP (`FLAGS_WITHOUT_OPENMP`): pthreads of the kernel's own, a higher
    threshold."""
    monkeypatch.setattr(cpu, "FLAGS", cpu.FLAGS_WITHOUT_OPENMP)
    cpu._build(os.environ.get("CC", "").strip() or "gcc", tmp_path / "no_openmp.so")
    lib = ctypes.CDLL(str(tmp_path / "no_openmp.so"))
    lib.h2o_cpu_decode_parallel_work.restype = ctypes.c_int
    assert lib.h2o_cpu_decode_parallel_work() == 1 << 17  # the pthreads build's threshold: it is that build
    monkeypatch.setattr(cpu, "library", lambda: lib)
    same_results(4, heads, "h2o", 2)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the loaded libraries from /proc")
def test_the_build_uses_openmp_from_the_libgomp_torch_loaded():
    """The default build is the OpenMP one, and its threads are torch's pool: the one ``libgomp.so.1`` (the name
    the library needs) in the process is torch's, not a second runtime with threads of its own. (Copies vendored
    under other names, such as scikit-learn's ``libgomp-<hash>.so``, are their packages' own.)"""
    assert cpu.library().h2o_cpu_decode_parallel_work() == 1 << 14  # the OpenMP build's threshold
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if Path(line.split()[-1]).name == "libgomp.so.1"}
    assert len(runtimes) == 1 and Path(torch.__file__).parent in Path(runtimes.pop()).parents
