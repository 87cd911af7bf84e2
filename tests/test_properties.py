"""Property tests (hypothesis) over random configurations, shapes and token streams.

- Layer level, model-independent: a :class:`CompressedLayer` is driven directly with keys and values that
  encode their absolute position in channel 0, and with random attention-probability sums. After every step:
  kept positions strictly increasing per sequence and KV head, keys and values still aligned, capacity never
  exceeded, scores equal to a reference accumulation (fp32, same order) and the kept set equal to a reference
  implementation of the eviction semantics of DESIGN.md §2 (sinks + top-``heavy`` scores, ties to the older
  token + recent window).
- Model level, on tiny random models: no crash, no NaN/Inf, capacity never exceeded, tokens seen counted; and
  budget 1.0 with 16-bit storage reproduces transformers' ``DynamicCache`` logits.
- Unbounded stream: with a fixed capacity, cache bytes (and the bytes of the underlying storages) stop
  growing once the cache is full.

Settings (``strategies.fuzz``): ``max_examples`` per test below (40, 30, 30; ``H2O_HYPOTHESIS_SCALE``
multiplies them for a longer local fuzz), ``deadline=None``, ``derandomize=True`` (same examples in every CI run).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_neox, tiny_opt
from hypothesis import given
from hypothesis import strategies as st
from helpers.strategies import cached_llama, configs, fuzz, llama_shapes
from transformers import DynamicCache

from h2o_compress import CompressionConfig, make_cache
from h2o_compress.attention import withdraw
from h2o_compress.cache import build_layers, chunk
from h2o_compress.cache import decode as decode_step


# -- layer level ---------------------------------------------------------------------------------------------
@st.composite
def layer_cases(draw):
    head_dim = draw(st.sampled_from([32, 64, 128]))
    values = draw(configs(head_dim))
    capacity = None if values["policy"] == "full" else draw(st.one_of(st.none(), st.integers(1, 40)))
    return dict(
        # the torch form: this test injects probability sums between its steps (the CPU kernel's own step is
        # checked against it in tests/attention/test_cpu_kernel.py)
        config=CompressionConfig(budget=1.0, attention_kernel="torch", **values),
        capacity=capacity,
        head_dim=head_dim,
        batch=draw(st.integers(1, 3)),
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.integers(1, 3)),
        chunks=draw(st.lists(st.integers(1, 24), min_size=1, max_size=8)),
        seed=draw(st.integers(0, 2**16)),
    )


def encoded(batch, kv_heads, start, count, head_dim):
    """Keys/values ``[batch, kv_heads, count, head_dim]``: position ``start + i`` in channel 0, zeros elsewhere
    (exactly representable after every quantizer, to < 0.5 for positions below 400)."""
    x = torch.zeros(batch, kv_heads, count, head_dim)
    x[..., 0] = torch.arange(start, start + count, dtype=torch.float32)
    return x


def decode(x: torch.Tensor, basis: torch.Tensor | None = None) -> torch.Tensor:
    """Positions encoded by :func:`encoded` in ``x``, held in ``basis`` (orthonormal, symmetric) if given."""
    x = x.float() if basis is None else x.float() @ basis
    return x[..., 0].round().long()


def slot_positions(layer, seen: int) -> torch.Tensor:
    """Positions ``[batch, kv_heads, slots + residual]`` the layer records for its store and ring (-1 = empty),
    in the order a decode step returns its keys (a chunk step puts the ring oldest first)."""
    held = layer.store.positions.long()
    if layer.ring is None:
        return held
    ring = layer.ring.positions.long().unsqueeze(1).expand(-1, layer.geometry.kv_heads, -1)
    return torch.cat((held, ring), dim=2)


def held_positions(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (sorted, ``[batch, kv_heads, kept]``) of the kept keys and of the kept values, read back from
    storage: dequantized store and ring, where the slot records a token."""
    out = []
    valid = slot_positions(layer, 0) >= 0
    for quantizer, stored, ring, basis in (
        (layer.setting.key_quantizer, layer.store.keys, None if layer.ring is None else layer.ring.keys, layer.geometry.key_basis),
        (layer.setting.value_quantizer, layer.store.values, None if layer.ring is None else layer.ring.values, layer.geometry.value_basis),
    ):
        parts = [quantizer.dequantize(stored, torch.float32)] + ([] if ring is None else [ring.float()])
        positions = decode(torch.cat(parts, 2), basis).masked_fill(~valid, -1)
        out.append(positions.sort(-1).values[..., -layer.kept_length() :])
    return out[0], out[1]


def reference_keep(
    held: list[int], scores: dict[int, float], capacity, policy: str, ratio: float, sinks: int, seen: int = 0
):
    """DESIGN.md §2: sinks, then the ``heavy`` top-scored older tokens (ties to the older), then the recent window;
    ``h2o-mean`` ranks by score / (``seen`` - position)."""
    if capacity is None or len(held) <= capacity:
        return held
    sinks = min(sinks, capacity)
    free = capacity - sinks
    heavy = min(free, round(ratio * free)) if policy.startswith("h2o") else 0
    recent = free - heavy
    middle = held[sinks : len(held) - recent]
    def rank(p: int) -> float:  # in fp32, as the layer computes it
        if policy != "h2o-mean":
            return scores[p]
        return (torch.tensor(scores[p], dtype=torch.float32) / max(seen - p, 1)).item()

    top = sorted(middle, key=lambda p: (-rank(p), p))[:heavy]
    return held[:sinks] + sorted(top) + held[len(held) - recent :]


@fuzz(40)
@given(case=layer_cases())
def test_layer_keeps_increasing_positions_within_capacity_with_exact_scores(case):
    """Drives a layer's two steps directly (update, then the decode or chunk follow-up with random probability
    sums): kept set == the DESIGN.md reference rule, scores == a reference accumulation, keys and values aligned."""
    config, capacity = case["config"], case["capacity"]
    (layer,) = build_layers(config, 1, case["head_dim"], capacity, max_tokens=sum(case["chunks"]))
    batch, kv_heads, head_dim = case["batch"], case["kv_heads"], case["head_dim"]
    generator = torch.Generator().manual_seed(case["seed"])
    total = sum(case["chunks"])
    ref_scores = torch.zeros(batch, kv_heads, total)
    expected = [[list() for _ in range(kv_heads)] for _ in range(batch)]
    seen = 0
    for count in case["chunks"]:
        keys = encoded(batch, kv_heads, seen, count, head_dim)
        returned_keys, returned_values = layer.update(keys, keys.clone())
        step = withdraw(0)  # a decode step's DecodeCall (its validity), or the layer of a chunk
        layer.link.awaiting = False
        if count == 1:  # decode step: store slots then ring slots, validity from the slots
            positions = slot_positions(layer, seen + 1).masked_fill(~step.valid, -1)
        else:  # chunk: the store's slots up to its last occupied one, ring oldest first, then the chunk
            held = layer.store.positions.long()[..., : layer.chunk.get("used", layer.store.positions.shape[-1])]
            if layer.ring is not None:
                ring = layer.ring.positions.long().index_select(1, layer.ring.order(seen))
                held = torch.cat((held, ring.unsqueeze(1).expand(-1, kv_heads, -1)), 2)
            new = torch.arange(seen, seen + count).expand(batch, kv_heads, count)
            positions = new if seen == 0 else torch.cat((held, new), 2)
        valid = positions >= 0
        returned = decode(returned_keys, layer.geometry.key_basis)
        assert torch.equal(returned[valid], positions[valid])  # the layer knows where each returned key sits
        assert torch.equal(decode(returned_values, layer.geometry.value_basis)[valid], positions[valid])
        assert torch.equal(returned[..., -count:], decode(keys)) or count == 1
        sums = None
        if layer.setting.with_scores:
            sums = torch.rand(returned_keys.shape[:3], generator=generator).masked_fill(~valid, 0.0)
            ref_scores.scatter_add_(2, positions.clamp(min=0), sums)
        if count == 1:
            decode_step.add_layer_scores(layer, sums)
            layer.evict()
        else:
            pending, layer.chunk = layer.chunk, None
            # the sums cover the slots the chunk read (up to the last occupied one), laid out over all slots again
            chunk.evict_and_lay_out(layer, pending, torch.ones(batch, count, dtype=torch.bool),
                         chunk.with_unread_slots(sums, pending, layer.store.slots))
        seen += count
        assert int(layer.get_seq_length()) == seen
        keys_at, values_at = held_positions(layer)
        assert torch.equal(keys_at, values_at)
        assert (keys_at.diff(dim=-1) > 0).all()  # each token at most once
        assert torch.equal(keys_at, layer.positions())
        if capacity is not None:
            assert keys_at.shape[2] <= capacity
        if layer.setting.with_scores:  # every held token's score is exactly its accumulated attention
            slots = slot_positions(layer, seen)
            held_scores = torch.cat([layer.store.scores] + ([] if layer.ring is None else [layer.ring.scores]), 2)
            mask = slots >= 0
            assert torch.isfinite(held_scores[mask]).all()
            assert torch.equal(held_scores[mask], ref_scores.gather(2, slots.clamp(min=0))[mask])
        for b in range(batch):
            for h in range(kv_heads):
                held = expected[b][h] + list(range(seen - count, seen))
                score_of = dict(zip(range(total), ref_scores[b, h].tolist()))
                expected[b][h] = reference_keep(
                    held, score_of, layer.setting.capacity, config.policy, config.heavy_ratio, layer.setting.policy.sink_tokens, seen
                )
                assert keys_at[b, h].tolist() == expected[b][h], (b, h)


# -- model level -----------------------------------------------------------------------------------------------
@st.composite
def stream_cases(draw):
    head_dim = draw(st.sampled_from([32, 64]))
    values = draw(configs(head_dim))
    chunks = draw(st.lists(st.integers(1, 20), min_size=1, max_size=6))
    budget = draw(st.one_of(st.sampled_from([0.1, 0.3, 0.5, 1.0]), st.integers(1, 30)))
    return dict(
        values=values | {"budget": budget},
        model=draw(llama_shapes(head_dim)),
        batch=draw(st.integers(1, 3)),
        chunks=chunks,
        seed=draw(st.integers(0, 2**16)),
    )


@fuzz(30)
@given(case=stream_cases())
@torch.no_grad()
def test_token_stream_never_crashes_never_nan_and_respects_capacity(case):
    model = cached_llama(*case["model"])
    config = CompressionConfig(**case["values"])
    total = sum(case["chunks"])
    cache = make_cache(model, config, max_length=total)
    ids = torch.randint(0, 128, (case["batch"], total), generator=torch.Generator().manual_seed(case["seed"]))
    start = 0
    for count in case["chunks"]:
        logits = model(input_ids=ids[:, start : start + count], past_key_values=cache, use_cache=True).logits
        start += count
        assert torch.isfinite(logits).all()
        assert cache.get_seq_length() == start
        cache.check()
        for layer in cache.layers:
            assert int(layer.counters.seen) == start
            if cache.capacity is not None:
                assert layer.kept_length() <= cache.capacity
            held = layer.store.positions >= 0
            if layer.setting.with_scores:
                assert torch.isfinite(layer.store.scores[held]).all()
            if layer.ring is not None:
                assert torch.isfinite(layer.ring.keys).all() and torch.isfinite(layer.ring.values).all()
    capacity = config.capacity(total)
    assert cache.capacity == (None if capacity is None else min(capacity, total))


ARCHS = {"opt": tiny_opt, "neox": tiny_neox}


@st.composite
def equality_cases(draw):
    arch = draw(st.sampled_from(["llama", "llama", "opt", "neox"]))
    batch = draw(st.integers(1, 3))
    chunks = draw(st.lists(st.integers(1, 16), min_size=1, max_size=5))
    return dict(
        arch=arch,
        model=draw(llama_shapes(draw(st.sampled_from([32, 64])))),
        policy=draw(st.sampled_from(["h2o", "local", "sink", "full"])),
        batch=batch,
        chunks=chunks,
        pads=draw(st.lists(st.integers(0, chunks[0] - 1), min_size=batch, max_size=batch)),
        seed=draw(st.integers(0, 2**16)),
    )


@fuzz(30)
@given(case=equality_cases())
@torch.no_grad()
def test_budget_one_and_16_bits_equals_the_uncompressed_cache(case):
    model = cached_llama(*case["model"]) if case["arch"] == "llama" else ARCHS[case["arch"]]()
    total = sum(case["chunks"])
    ids = torch.randint(0, 128, (case["batch"], total), generator=torch.Generator().manual_seed(case["seed"]))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(case["pads"]):  # left padding inside the first chunk
        mask[row, :pad] = 0
    compressed = make_cache(model, CompressionConfig(policy=case["policy"], budget=1.0, kv_bits=16), max_length=total)
    reference = DynamicCache(config=model.config)
    start = 0
    for count in case["chunks"]:
        stop = start + count
        inputs = dict(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], use_cache=True)
        want = model(**inputs, past_key_values=reference).logits
        got = model(**inputs, past_key_values=compressed).logits
        visible = mask[:, start:stop].bool()
        assert torch.isfinite(got[visible]).all()
        torch.testing.assert_close(got[visible], want[visible], rtol=1e-5, atol=1e-5)
        start = stop
    assert compressed.kept_length() == total - min(case["pads"])  # padding is never held


# -- unbounded stream --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        CompressionConfig(budget=16, kv_bits=4, residual=3),
        CompressionConfig(policy="sink", budget=12, kv_bits=8, quant="int8-blockwise", residual=2),
        CompressionConfig(policy="local", budget=12),
    ],
    ids=["h2o-int4", "sink-int8-blockwise", "local-16bit"],
)
@torch.no_grad()
def test_long_stream_keeps_cache_bytes_bounded(config):
    model = cached_llama(0, 2, 2, 32, 2)
    cache = make_cache(model, config)
    generator = torch.Generator().manual_seed(0)
    steady, token = [], torch.randint(0, 128, (1, 8), generator=generator)
    for step in range(250):
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        assert cache.storage_nbytes() == cache.nbytes()  # no hidden growth behind views
        if step >= 30:  # full for a while: capacity reached and residual windows cycling
            steady.append(cache.nbytes())
    assert cache.get_seq_length() == 257 and cache.kept_length() == cache.capacity
    assert max(steady[110:]) <= max(steady[:110])  # no growth in the second half of the stream
    assert len(set(steady)) <= 2 * config.residual + 1  # a few values that repeat with the residual cycle


# -- entry points given junk: calibration, stream, serve ------------------------------------------------------------
# One to three arguments of a working call replaced by `strategies.wrong_values`: the call returns or raises an
# H2OCompressError subclass, never a TypeError, AttributeError, OverflowError... (few examples: most calls stop at
# their first check; the full public API is fuzzed in tests/test_public_api_types.py).

CALIBRATION_TEXT = "the cache keeps heavy hitters and the recent window of tokens while the rest is evicted\n" * 12


@pytest.fixture(scope="module")
def junk_api(tmp_path_factory):
    """A tiny LLaMA and its tokenizer, a calibration text file and a calibration file fitted on the model."""
    from h2o_compress.calibration import calibrate
    from helpers.tiny_lm import tiny_lm

    model, tokenizer = tiny_lm()
    folder = tmp_path_factory.mktemp("junk")
    (folder / "text.txt").write_text(CALIBRATION_TEXT)
    fitted = calibrate(model, tokenizer, str(folder / "text.txt"), tokens=64, segments=2,
                       out=str(folder / "fitted.safetensors"))
    return {"model": model, "tokenizer": tokenizer, "text": str(folder / "text.txt"),
            "fitted": fitted.details["path"]}


def _junk_call(data, good: dict, function, keep: tuple = ()):
    """``function(**good)`` with one to three of its arguments (not those in ``keep``) replaced by wrong values; an
    H2OCompressError is the allowed failure. Returns the result, or the error."""
    from h2o_compress import H2OCompressError
    from helpers.strategies import wrong_values

    names = sorted(n for n in good if n not in keep)
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True), label="replaced")
    arguments = {n: data.draw(wrong_values(), label=n) if n in chosen else v for n, v in good.items()}
    threads = torch.get_num_threads()
    try:
        result = function(**arguments)
        return list(result) if type(result).__name__ == "GenerationStream" else result
    except H2OCompressError as error:
        return error
    finally:
        torch.set_num_threads(threads)


@fuzz(12)
@given(data=st.data())
def test_calibrate_given_junk_raises_only_our_errors(junk_api, data, tmp_path_factory):
    """``calibrate``'s text, counts, input set, output path and overwrite switch, junk: refused in one line before the
    model reads anything (a few valid values drawn run the fit on 2 x 64 tokens)."""
    from h2o_compress.calibration import calibrate

    out = str(tmp_path_factory.mktemp("calibrated") / "c.safetensors")
    good = dict(model=junk_api["model"], tokenizer=junk_api["tokenizer"], text_file=junk_api["text"], tokens=64,
                segments=2, out=out, overwrite=False, inputs="score,age")
    _junk_call(data, good, calibrate)


@fuzz(15)
@given(data=st.data())
def test_calibrated_policy_and_calibration_files_given_junk_raise_only_our_errors(junk_api, data, tmp_path_factory):
    """``CalibratedPolicy`` (weights, heavy ratio, sinks), a cache of policy ``calibrated`` naming a junk file or
    path, and ``load_calibration`` of a file of junk bytes: each refused with an H2OCompressError."""
    from h2o_compress import H2OCompressError, make_cache
    from h2o_compress.persistence.calibration_file import load_calibration
    from h2o_compress.policies.calibrated import CalibratedPolicy

    model = junk_api["model"]
    _junk_call(data, dict(heavy_ratio=0.5, sink_tokens=1, weights=torch.zeros(2, 36)), CalibratedPolicy)
    junk = tmp_path_factory.mktemp("junkfile") / "junk.safetensors"
    junk.write_bytes(data.draw(st.binary(max_size=64), label="bytes"))
    for path in (str(junk), junk_api["fitted"]):
        _junk_call(data, dict(path=path, model=model), load_calibration, keep=("model",))
    with pytest.raises(H2OCompressError):
        load_calibration(str(junk), model)
    calibration = data.draw(st.one_of(st.just(str(junk)), st.text(max_size=12)), label="calibration")
    with pytest.raises(H2OCompressError):
        make_cache(model, CompressionConfig(policy="calibrated", budget=4, calibration=calibration), max_length=8)


@fuzz(10)
@given(data=st.data())
def test_stream_given_junk_raises_only_our_errors(junk_api, data):
    """``stream``'s arguments, junk: refused when it is called or at the first ``next()``, never another error."""
    from h2o_compress import stream

    good = dict(model=junk_api["model"], tokenizer=junk_api["tokenizer"], prompt="the cache keeps", config=None,
                max_new_tokens=2, chat=False, temperature=0.0, seed=None, cache=None, compile=False)
    _junk_call(data, good, stream)


class _Loading(Exception):
    """Raised in place of loading the model: serve's checks all passed."""


@fuzz(20)
@given(data=st.data())
def test_serve_refuses_junk_settings_before_loading_anything(data, monkeypatch_module):
    """``serve``'s settings, junk: an H2OCompressError before the model is loaded (load_model is replaced by a
    function raising `_Loading`, which only settings that are all valid reach; no server starts)."""
    from h2o_compress.serving import serve

    good = dict(model="smollm2-135m", config=None, host="127.0.0.1", port=0, max_queue=4, batch_size=2,
                memory_limit=None, max_tokens=4, temperature=0.0, name=None, compile=None, load=None, threads=None,
                trust_remote_code=False, log_level="info", ray=None, replicas=1)
    try:
        result = _junk_call(data, good, serve)
    except _Loading:
        return
    assert result is not None  # serve returns only when its server stops: here it must have refused


@pytest.fixture(scope="module")
def monkeypatch_module():
    """load_model replaced by a function raising `_Loading` for this module's serve test."""
    import h2o_compress.models as models

    def loading(*args, **kwargs):
        raise _Loading

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_model", loading)
        yield patch
