"""8-bit weights on CPU through torch's packed int8 kernel (issue 50, Build item 1): ``load_model(weights_bits=8)``
on CPU packs every Linear layer and the output head to per-row int8 (`h2o_compress.models.int8_linear`), without
bitsandbytes; the planner counts those bytes exactly; the compressed cache runs on the model; CUDA (and a
``device_map``) keep bitsandbytes' LLM.int8."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

import h2o_compress.models.loading as loading
import h2o_compress.models.weights as weights
from h2o_compress import CompressionConfig, generate, load_model
from h2o_compress.cli import app
from h2o_compress.models import default_weights_bits, placement_options, resolve_weights_bits
from h2o_compress.utils.errors import ConfigError
from h2o_compress.models.int8_linear import COMPUTE_DTYPE, Int8Linear, int8_layers, quantize_linears
from h2o_compress.models.weights import eager_only_reason, loaded_weight_bytes, loaded_weights_bits
from h2o_compress.planner import weight_bytes
from h2o_compress.planner.known_models import resolve_model

from conftest import save_tiny_model_dir

PROMPT = " ".join(f"w{i}" for i in range(5, 45))  # 40 tokens of the word-level tokenizer
# measured on the 4-layer random llama: mean |int8 - fp32| logits 2.0% of the mean |fp32 logit| (bf16 activations
# inside the layers and per-row int8 weights); unrelated logits differ by ~110%
LOGIT_BOUND = 0.05


def _packed_buffer_bytes(model) -> int:
    """Bytes of the buffers that are not packed weights (the rotary frequencies a loaded figure also counts)."""
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers()
               if not n.endswith(("weight_int8", "scales")) and not n.endswith(".bias"))


@pytest.fixture(scope="module")
def fp32(four_layer_dir):
    return load_model(four_layer_dir, device="cpu")


@pytest.fixture(scope="module")
def int8(four_layer_dir):
    return load_model(four_layer_dir, device="cpu", weights_bits=8)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tiny llama whose head is tied to its input embeddings (as SmolLM2's), with the word-level tokenizer."""
    path = save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tied"))
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_every_linear_and_the_head_become_int8_and_the_model_stays_fp32(int8):
    model, _ = int8
    assert not [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(int8_layers(model)) == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert isinstance(model.lm_head, Int8Linear)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.shape == (layer.out_features, layer.in_features)
    assert layer.scales.dtype == COMPUTE_DTYPE and layer.scales.shape == (layer.out_features,)
    assert model.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    assert loaded_weights_bits(model) == 8 and eager_only_reason(model) == "packed int8 CPU weights"


def test_int8_logits_are_within_a_bounded_error_of_fp32(fp32, int8, four_layer_dir):
    ids = fp32[1](PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        full, ours = fp32[0](ids).logits, int8[0](ids).logits
    assert ours.dtype == torch.float32  # bf16 only inside the layers
    assert (ours - full).abs().mean() < LOGIT_BOUND * full.abs().mean()
    # and the kernel computes what the module says: x (in bf16) @ (int8 * scale)^T
    layer = int8[0].model.layers[1].self_attn.q_proj
    x = torch.randn(3, 5, layer.in_features)
    expected = x.to(COMPUTE_DTYPE).float() @ layer.dequantized().T
    assert torch.allclose(layer(x), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_quantization_is_per_row_symmetric():
    linear = torch.nn.Linear(16, 4, bias=True)
    with torch.no_grad():
        linear.weight[2] = 0  # an all-zero row stays zero (scale 1, not a division by zero)
    layer = Int8Linear.from_linear(linear)
    peaks = layer.weight_int8.abs().amax(dim=1).tolist()
    assert peaks[2] == 0 and all(126 <= p <= 127 for p in peaks[:2] + peaks[3:])  # the bf16 scale rounds up
    assert layer.scales.dtype == COMPUTE_DTYPE
    assert (layer.scales.float() * 127 >= linear.weight.abs().amax(dim=1).detach()).all()  # nothing clips
    err = (layer.dequantized() - linear.weight).abs()
    assert (err <= layer.scales.float()[:, None] / 2 + 1e-7).all()  # half a step of the scale the kernel uses
    assert torch.equal(layer.bias, linear.bias.detach())


def test_weight_bytes_are_exact_for_the_loaded_int8_model(int8, four_layer_dir):
    model, _ = int8
    loaded = loaded_weight_bytes(model)
    by_hand = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        m.weight_int8.numel() + m.scales.numel() * m.scales.element_size() for m in int8_layers(model))
    assert loaded == by_hand + _packed_buffer_bytes(model)
    # the planner's count for this path (1 byte per weight, the head's included, + a bf16 scale per row), from the
    # config alone, is the same bytes; and a plan of the loaded model uses them
    spec = resolve_model(four_layer_dir)
    assert weight_bytes(spec, 8, torch.float32, backend="cpu") + _packed_buffer_bytes(model) == loaded
    assert weight_bytes(resolve_model(model), 8, torch.float32) == loaded
    # bitsandbytes' count (CUDA) differs: fp32 scales and an fp head
    assert weight_bytes(spec, 8, torch.float32) != weight_bytes(spec, 8, torch.float32, backend="cpu")


def test_a_tied_head_is_untied_only_for_its_int8_copy(tied_dir):
    full, _ = load_model(tied_dir, device="cpu")
    assert full.lm_head.weight is full.model.embed_tokens.weight
    model, _ = load_model(tied_dir, device="cpu", weights_bits=8)
    assert isinstance(model.lm_head, Int8Linear) and not model.config.tie_word_embeddings
    assert torch.equal(model.model.embed_tokens.weight, full.model.embed_tokens.weight)  # the embedding unchanged
    assert model.model.embed_tokens.weight.dtype == torch.float32
    spec = resolve_model(tied_dir)
    assert spec.head_tied and spec.head_parameters == 128 * 128
    assert weight_bytes(spec, 8, torch.float32, backend="cpu") + _packed_buffer_bytes(model) == \
        loaded_weight_bytes(model)


def test_generate_runs_with_the_compressed_cache(int8):
    model, tokenizer = int8
    result = generate(model, tokenizer, PROMPT, CompressionConfig(budget=0.2, kv_bits=4), 12, chat=False)
    assert result.new_tokens == 12 and result.kv_bytes > 0
    cli = CliRunner().invoke(app, ["generate", PROMPT, "--model", model.name_or_path_for_cache, "--no-chat",
                                   "--max-new-tokens", "4", "--weights-bits", "8", "--budget", "0.2", "--kv-bits", "4"])
    assert cli.exit_code == 0, cli.output


def test_bitsandbytes_is_not_used_on_cpu(four_layer_dir, monkeypatch):
    """bitsandbytes missing and its probe failing: 8-bit weights on CPU still load (4 bits still need it)."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)

    def no_kernels(bits, device):
        raise RuntimeError("bitsandbytes probed")

    monkeypatch.setattr(weights, "_probe", no_kernels)
    placement = placement_options("cpu", None, 8)
    assert "quantization_config" not in placement and placement["_cpu_packed"]
    assert placement["_dtype"] == torch.float32  # not LLM.int8's fp16
    model, _ = load_model(four_layer_dir, device="cpu", weights_bits=8)
    assert len(int8_layers(model)) == 29
    assert not [m for m in model.modules() if "bitsandbytes" in type(m).__module__]


def test_cuda_and_device_maps_keep_bitsandbytes(monkeypatch):
    """On CUDA (simulated: the device resolves to cuda and bitsandbytes' probe passes) and with a device_map,
    8 bits stays LLM.int8 through transformers' BitsAndBytesConfig, computing in fp16 as before."""
    monkeypatch.setattr(weights, "_probe", lambda bits, device: None)
    monkeypatch.setattr(loading, "resolve_device", lambda device: torch.device("cuda", 0))
    cuda = placement_options("cuda", None, 8)
    assert not cuda["_cpu_packed"] and cuda["quantization_config"].load_in_8bit
    assert cuda["_dtype"] == torch.float16 and cuda["device_map"] == {"": 0}
    monkeypatch.setattr(loading, "resolve_device", lambda device: torch.device("cpu"))
    mapped = placement_options("auto", None, 8, device_map={"": "cpu"})
    assert not mapped["_cpu_packed"] and mapped["quantization_config"].load_in_8bit


@pytest.mark.cuda
def test_cuda_int8_is_still_bitsandbytes(four_layer_dir):
    model, _ = load_model(four_layer_dir, device="cuda", weights_bits=8)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear8bitLt" and not int8_layers(model)


def test_quantize_linears_leaves_the_head_when_asked():
    from conftest import tiny_llama

    model = tiny_llama()
    assert quantize_linears(model, head=False) == 2 * 7 and type(model.lm_head) is torch.nn.Linear


# -- the CPU default (issue 50, Build item 2) ------------------------------------------------------------------------
def test_the_default_weights_bits_are_8_on_cpu_for_the_embedded_model_only(monkeypatch):
    """``weights_bits=None`` (load_model's default): 8 for smollm2-135m on CPU without a device_map, 16 for any
    other model, on CUDA and with a map; explicit values win; a bad one is the usual one-line error."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert default_weights_bits("smollm2-135m", cpu) == 8
    assert default_weights_bits("smollm2-135m", cuda) == 16
    assert default_weights_bits("smollm2-135m", cpu, device_map={"": "cpu"}) == 16
    assert default_weights_bits("org/name", cpu) == 16 and default_weights_bits("/a/model/dir", cpu) == 16
    assert resolve_weights_bits("smollm2-135m", device="cpu") == 8
    assert resolve_weights_bits("smollm2-135m", device="cpu", weights_bits=16) == 16
    assert resolve_weights_bits("org/name", device="cpu", weights_bits=8) == 8
    embedded = placement_options("cpu", None, None, name_or_path="smollm2-135m")
    assert embedded["_bits"] == 8 and embedded["_cpu_packed"] and embedded["_dtype"] == torch.float32
    other = placement_options("cpu", None, None, name_or_path="org/name")
    assert other["_bits"] == 16 and not other["_cpu_packed"] and "quantization_config" not in other
    monkeypatch.setattr(loading, "resolve_device", lambda device: torch.device("cuda", 0))
    on_cuda = placement_options("cuda", None, None, name_or_path="smollm2-135m")
    assert on_cuda["_bits"] == 16 and "quantization_config" not in on_cuda and on_cuda["_dtype"] == torch.bfloat16
    for bad in ("8", 8.0, True, 2):
        with pytest.raises(ConfigError, match=r"^weights_bits=.* is not supported; allowed: 16, 8, 4 or None"):
            placement_options("cpu", None, bad)


def test_a_model_directory_loads_fp32_by_default_on_cpu(fp32):
    """Only the embedded alias gets int8 by default: a local directory loads its Linear layers in fp32."""
    model, _ = fp32
    assert not int8_layers(model) and loaded_weights_bits(model) == 32


@torch.no_grad()
def test_a_cache_saved_with_fp32_weights_is_refused_by_the_int8_model_in_one_line(fp32, int8, tmp_path):
    """A prompt cache saved with fp32 weights (every earlier default) does not load into the same model with packed
    int8 weights: the fingerprint reads the packed weights, and the refusal says how to load fp32 again."""
    from h2o_compress.models.identity import model_fingerprint
    from h2o_compress.persistence import load_cache, save_cache
    from h2o_compress.runtime.generation import make_cache
    from h2o_compress.runtime.prefill import prefill
    from h2o_compress.utils.errors import CacheStateError

    model, tokenizer = fp32
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    cache = make_cache(model, CompressionConfig(budget=0.5, kv_bits=4), max_length=ids.shape[1] + 4)
    prefill(model, ids, cache)
    path = save_cache(cache, tmp_path / "fp32.safetensors")
    with pytest.raises(CacheStateError, match=r"allowed: the model that saved it \(this model has 8-bit weights, "
                       r"the CPU default .*--weights-bits 16, or load_model\(\.\.\., weights_bits=16\)\)$"):
        load_cache(path, int8[0])
    assert load_cache(path, model).get_seq_length() == ids.shape[1]  # the model that saved it still loads it
    packed = int8[0]
    before = model_fingerprint(packed)
    middle = int8_layers(packed)[3].weight_int8.view(-1)[4:-4]
    middle.neg_()  # other packed weights inside one layer (its first and last 4 values unchanged)
    try:
        assert model_fingerprint(packed) != before
    finally:
        middle.neg_()
    assert model_fingerprint(packed) == before


def _mapped_ranges(suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of files ending in ``suffix`` (Linux ``/proc/self/maps``)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(suffix):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_no_weight_stays_in_the_converted_checkpoints_memory_map(four_layer_dir):
    """The int8 load copies what it left in fp32 (embedding, norms) out of the checkpoint's memory map
    (`release_source_weights`), so the fp32 file does not stay resident beside the int8 weights; the values are the
    same as the fp32 load's."""
    model, _ = load_model(four_layer_dir, device="cpu", weights_bits=8)
    fp32, _ = load_model(four_layer_dir, device="cpu", weights_bits=16)
    mapped = _mapped_ranges(".safetensors")
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.numel()]
    assert not [t.shape for t in tensors if any(a <= t.data_ptr() < b for a, b in mapped)]
    assert torch.equal(model.get_input_embeddings().weight, fp32.get_input_embeddings().weight)


def _packed_product(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the packed kernel gives for ``x`` ``[rows, in]`` (the decode path), in ``x``'s dtype."""
    out = torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE_DTYPE), layer.weight_int8, layer.scales)
    return out.to(x.dtype)


def test_a_long_prompt_chunk_runs_the_dense_product_within_bf16_rounding_of_the_packed_kernel():
    from h2o_compress.models.int8_linear import DENSE_ROWS

    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(96, 80, bias=False))
    chunk = torch.randn(1, DENSE_ROWS, 96)
    exact = (chunk[0].to(COMPUTE_DTYPE).float() @ layer.dequantized().T)
    dense, packed = layer(chunk)[0], _packed_product(layer, chunk[0])
    assert not torch.equal(dense, packed)  # the dense bf16 product ran, not the packed kernel
    scale = exact.abs().max()
    assert (dense - exact).abs().max() / scale < 2 ** -7  # two bf16 roundings of the output at most
    assert (packed - exact).abs().max() / scale < 2 ** -7


def test_a_decode_step_runs_the_packed_kernel_whatever_the_batch_so_a_row_does_not_depend_on_the_others():
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(96, 80, bias=False))
    rows = torch.randn(128, 1, 96)  # 128 sequences, one token each: a batched decode step
    batched = layer(rows)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(rows.shape[0])])
    assert torch.equal(batched, alone)
    assert torch.equal(batched[:, 0], _packed_product(layer, rows[:, 0]))
    short = torch.randn(1, 8, 96)  # a short chunk (fewer rows than DENSE_ROWS): the packed kernel too
    assert torch.equal(layer(short)[0], _packed_product(layer, short[0]))
