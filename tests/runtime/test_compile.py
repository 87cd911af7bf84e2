"""The decode step compiles: ``torch.compile(fullgraph=True)`` over a model step with the compressed cache.

For tiny LLaMA (GQA), OPT and GPT-NeoX models, every policy and 16/8/4 bits (all pairs of kernel, architecture,
policy and bits: `helpers.pairwise`), with left-padded batches: 24 decode steps that cross several evictions and
ring turnovers run with no graph break, at most 2 compiled graphs (the growing attention mask's length turns
dynamic once), no ``.item()`` (``capture_scalar_outputs=False`` under ``fullgraph=True`` fails on any host read),
the cache's storage pointers unchanged, and logits within 1e-5 of the eager step. The matrix traces with Dynamo's
``eager`` backend (the capture is what can break); a subset runs through Inductor (CPU, gcc), with the options of
:data:`h2o_compress.runtime.compiled.INDUCTOR_OPTIONS`.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from conftest import TINY_MODELS
from helpers.decode_steps import POLICIES, PROMPT, STEPS, eager_and_compiled, run, setting
from helpers.pairwise import decode_matrix
from transformers import DynamicCache

from h2o_compress import CompressionConfig, ConfigError, InputError, make_cache
from h2o_compress.runtime.compiled import INDUCTOR_OPTIONS, decode_step
from h2o_compress.runtime import decode_loop


def check_compiled(arch, policy, bits, backend, kernel="auto", atol=1e-5):
    model = TINY_MODELS[arch]()
    config = setting(policy, bits, kernel)
    eager, ours, cache, before, after, graphs = eager_and_compiled(model, config, backend)
    assert graphs <= 2, f"{graphs} compiled graphs"
    assert after == before  # every buffer written in place
    assert all((layer.backend.name == "cpu") == (kernel == "auto") for layer in cache.layers)
    torch.testing.assert_close(ours, eager, atol=atol, rtol=0)
    if config.policy != "full":
        assert cache.kept_length() == 12
    cache.check()


@pytest.mark.parametrize("policy,bits,kernel,arch", decode_matrix(
    policy=POLICIES, bits=[16, 8, 4], kernel=["auto", "torch"], arch=sorted(TINY_MODELS)))
def test_decode_step_captures_in_one_graph(kernel, arch, policy, bits):
    """Every policy at every width, with both kernels and on every architecture, and every other pair of those
    (all pairs; ``H2O_COMPRESS_FULL_MATRIX=1`` runs the whole cross product)."""
    check_compiled(arch, policy, bits, "eager", kernel)


INDUCTOR_CASES = [("llama", "h2o", 4), ("llama", "h2o-mean", 8), ("llama", "sink", 16), ("llama", "local", 4),
                  ("llama", "full", 8), ("opt", "h2o", 4), ("neox", "sink", 4)]


@pytest.mark.parametrize("kernel,arch,policy,bits", [("auto", *case) for case in INDUCTOR_CASES] + [
    ("torch", "llama", "h2o", 4), ("torch", "neox", "sink", 4), ("torch", "llama", "full", 8)])
def test_inductor_decode_matches_eager(kernel, arch, policy, bits):
    """Each case with the CPU kernel (the CPU's default step), three with the torch form (the GPU's form; its
    every policy and width are traced above). Inductor compiles the model's own ops (norms, RoPE) with other float reassociations than eager (~1e-7);
    a quantized cache can turn that into one int8/int4 code one step apart when a value sits on a rounding
    boundary (~2e-4 in the logits for a step or two). 16 bits: 1e-5; quantized: 5e-4, and the same tokens kept."""
    with torch._inductor.config.patch(INDUCTOR_OPTIONS):
        check_compiled(arch, policy, bits, "inductor", kernel, atol=1e-5 if bits == 16 else 5e-4)


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_compiled_full_budget_16bit_equals_dynamic_cache(arch):
    """Budget >= the sequence with 16 bits: the compiled step gives DynamicCache's logits."""
    model = TINY_MODELS[arch]()
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, backend="eager")
    with torch.inference_mode():
        reference, _, _, _ = run(model, None, decode_step, cache=DynamicCache(config=model.config))
        ours, _, _, _ = run(model, CompressionConfig(policy="h2o", budget=PROMPT + STEPS), compiled)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_a_host_read_in_the_step_would_fail_the_capture(kernel):
    """The check above can fail: a decode step that reads a tensor on the host breaks the fullgraph capture."""
    from h2o_compress.attention import cpu
    from h2o_compress.attention import decode_step as decode  # the torch form's step (DecodeCall) adds the scores

    model = TINY_MODELS["llama"]()
    owner, name = (cpu, "decode_layer") if kernel == "auto" else (decode, "add_scores")
    original = getattr(owner, name)

    def syncing(buffers, *args):  # both take the layer's SlotBuffers first
        result = original(buffers, *args)
        if int(buffers.seen) < 0:  # a host read, as a Python branch on a tensor value would do
            return None
        return result

    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, backend="eager")
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode(), \
            torch._dynamo.config.patch(capture_scalar_outputs=False):
        patch.setattr(owner, name, syncing)
        with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
            run(model, setting("h2o", 4, kernel), compiled)


def test_bitsandbytes_formats_refuse_compile_with_one_clear_error():
    from h2o_compress.runtime.compiled import resolve_compile

    model = TINY_MODELS["llama"]()
    cache = make_cache(model, CompressionConfig(budget=12, kv_bits=4, quant="nf4"), max_length=40)
    with pytest.raises(ConfigError, match="bitsandbytes formats .* run eagerly only"):
        resolve_compile(True, cache, torch.device("cpu"))
    assert resolve_compile(None, cache, torch.device("cuda")) is False  # auto: eager for them
    unknown_length = make_cache(model, CompressionConfig(policy="full"))
    with pytest.raises(ConfigError, match="pass max_length"):
        resolve_compile(True, unknown_length, torch.device("cpu"))


def symint_recorder():
    """``(backend, graphs)``: a Dynamo backend that runs each captured graph as is and appends to ``graphs`` the
    names of its SymInt inputs (Inductor's CUDA-graph trees record a new CUDA graph for each value of one)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"
                       and isinstance(n.meta.get("example_value"), torch.SymInt)])
        return gm.forward

    return backend, graphs


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_decode_one_steps_have_one_shape_so_cuda_graphs_record_once(arch):
    """``decode_one`` passes a compressed cache no attention mask: across 24 steps the compiled step is one graph
    whose inputs hold no symbolic size. (Inductor's CUDA-graph trees record a new CUDA graph for each value of a
    SymInt input: a growing mask marked dynamic put one in, so every token recorded a graph.) Same logits as the
    eager step with the growing mask."""
    from h2o_compress.runtime.compiled import decode_one

    model = TINY_MODELS[arch]()
    recording, graphs = symint_recorder()
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, backend=recording)

    def through_decode_one(model, token, cache, position, mask):  # run()'s step, as the library calls it
        return decode_one(compiled, model, token=token, cache=cache, seen=int(position[-1]))

    with torch.inference_mode():
        eager, _, _, _ = run(model, setting("h2o", 4), decode_step, pads=(0, 0))
        ours, cache, before, after = run(model, setting("h2o", 4), through_decode_one, pads=(0, 0))
    assert graphs == [[]], f"compiled graphs and their SymInt inputs: {graphs}"
    assert after == before
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)


def test_a_growing_mask_would_put_a_symbolic_size_into_the_graph():
    """The check above can fail: the same steps with the growing mask marked dynamic (the old way) give the graph
    a SymInt input."""
    model = TINY_MODELS["llama"]()
    recording, graphs = symint_recorder()
    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True, backend=recording)

    def dynamic_mask(model, token, cache, position, mask):
        torch._dynamo.mark_dynamic(mask, 1)
        return compiled(model, token, cache, position, mask)

    with torch.inference_mode():
        run(model, setting("h2o", 4), dynamic_mask)
    assert len(graphs) == 1 and graphs[0], graphs


def test_the_compiled_step_refuses_an_attention_mask():
    from h2o_compress.runtime.compiled import compiled_decode_step

    model = TINY_MODELS["llama"]()
    step = compiled_decode_step(model, "cpu")
    mask = torch.ones(2, 21, dtype=torch.long)
    with pytest.raises(InputError, match=r"attention mask of shape \(2, 21\); it takes none"):
        step(model, torch.zeros(2, 1, dtype=torch.long), None, torch.zeros(2, 1, dtype=torch.long), mask)


class _Clock:
    """A ``time`` module whose ``perf_counter`` advances one second per call: a timed pass reads it twice."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("device_steps", [1, 2], ids=["one-warm-up-step", "two-warm-up-steps"])
def test_generate_leaves_the_compiled_steps_warm_up_out_of_the_decode_speed(monkeypatch, tiny_model_dir,
                                                                              device_steps):
    """``generate(compile=True)``: the first ``warmup_steps`` decode passes (compile; on CUDA also the CUDA-graph
    recording) go to ``compile_s``, the others to ``decode_s``. The compiled step is stood in for by the eager one
    and time by a clock that ticks once per reading, so the split is exact."""
    from transformers import AutoTokenizer

    from h2o_compress.runtime import generation
    from h2o_compress.runtime.compiled import warmup_steps

    assert warmup_steps("cpu") == 1 and warmup_steps(torch.device("cuda")) == 2
    model, tokenizer = TINY_MODELS["llama"](), AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(generation, "compiled_decode_step", lambda model, device: decode_step)
    monkeypatch.setattr(generation, "warmup_steps", lambda device: device_steps)
    monkeypatch.setattr(decode_loop, "time", _Clock())  # the decode steps' clock
    result = generation.generate(model, tokenizer, "w1 w2 w3", CompressionConfig(budget=0.5, kv_bits=4),
                                 max_new_tokens=6, chat=False, compile=True)
    passes = result.new_tokens - 1
    assert result.compiled and passes > device_steps
    assert result.compile_s == device_steps and result.decode_s == passes - device_steps
    assert result.decode_tokens_per_s == 1.0


def test_greedy_decode_leaves_untimed_passes_out(monkeypatch):
    from h2o_compress.evaluation import stream

    model = TINY_MODELS["llama"]()
    seconds = {}
    for untimed in (0, 2):
        cache = make_cache(model, CompressionConfig(budget=8, kv_bits=4), max_length=16)
        with torch.inference_mode():
            logits = model(input_ids=torch.arange(1, 9)[None], past_key_values=cache).logits[:, -1]
            monkeypatch.setattr(decode_loop, "time", _Clock())
            ids, seconds[untimed] = stream.greedy_decode(model, cache, logits, 6, untimed=untimed)
        assert len(ids) == 6
    assert seconds == {0: 5.0, 2: 3.0}


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_transformers_generate_auto_compile_captures_one_graph(arch):
    """``model.generate(past_key_values=cache)`` compiles the decode forward by itself on CUDA (the cache is
    compileable). Forced on CPU (``CompileConfig._compile_all_devices``, transformers' switch for its own tests) with
    a recording backend: one graph for 12 steps, no SymInt input (so one CUDA graph on a GPU), and eager generate's
    tokens."""
    from transformers import CompileConfig

    model = TINY_MODELS[arch]()
    recording, graphs = symint_recorder()
    torch._dynamo.reset()
    compile_config = CompileConfig(fullgraph=True, backend=recording, mode=None)
    compile_config._compile_all_devices = True
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    config = CompressionConfig(budget=12, kv_bits=4, residual=2)
    runs = [
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                       past_key_values=make_cache(model, config, max_length=40), **extra)
        for extra in ({}, {"compile_config": compile_config})
    ]
    assert graphs == [[]], f"compiled graphs and their SymInt inputs: {graphs}"
    assert torch.equal(runs[1], runs[0])
