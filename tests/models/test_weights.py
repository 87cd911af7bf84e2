"""Weights as planned (issue 17, part 1): bitsandbytes 8/4-bit weights, accelerate device maps with disk offload,
``--weights-bits``/``--device-map`` on the CLI, and ``generate --memory-limit`` planned vs measured peak memory."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from h2o_compress import CompressionConfig, generate, load_model
from h2o_compress.cli import app
from h2o_compress.utils.errors import ConfigError, ModelLoadError
from h2o_compress.planner.known_models import resolve_model
from h2o_compress.planner import plan, weight_bytes
from h2o_compress.runtime.prefill import prefill
from h2o_compress.models.weights import (
    attention_devices, input_device, loaded_weight_bytes, loaded_weights_bits, parse_device_map, parse_max_memory,
)
from h2o_compress.runtime.generation import make_cache

runner = CliRunner()
PROMPT = " ".join(f"w{i}" for i in range(5, 45))  # 40 tokens of the word-level tokenizer
SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
         "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu"}
ON_CPU = {"model": "cpu", "lm_head": "cpu"}  # a device map on CPU: 8/4 bits go through bitsandbytes then


@pytest.fixture(scope="module")
def whole(four_layer_dir):
    return load_model(four_layer_dir, device="cpu")


@pytest.fixture(scope="module")
def split(four_layer_dir, tmp_path_factory):
    """The same model with layers 1 and 3 offloaded through accelerate to disk (weights read per forward)."""
    return load_model(four_layer_dir, device_map=SPLIT, offload_folder=str(tmp_path_factory.mktemp("offload")))


# -- a model split by device_map generates as in one piece ------------------------------------------------
def test_split_model_is_really_offloaded_to_disk(split):
    model, _ = split
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    offloaded = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert offloaded and all(n.startswith(("model.layers.1.", "model.layers.3.")) for n in offloaded)
    assert input_device(model) == torch.device("cpu")
    assert attention_devices(model, 4) == [torch.device("cpu")] * 4


@pytest.mark.parametrize("config", [CompressionConfig(), CompressionConfig(budget=0.3, kv_bits=4)],
                         ids=["budget1-16bit", "budget0.3-int4"])
def test_disk_offloaded_model_generates_the_same_tokens(whole, split, config):
    (one, tokenizer), (two, _) = whole, split
    a = generate(one, tokenizer, PROMPT, config, max_new_tokens=12, chat=False)
    b = generate(two, tokenizer, PROMPT, config, max_new_tokens=12, chat=False)
    assert a.prompt_tokens == 40 and a.new_tokens == b.new_tokens == 12
    assert b.token_ids == a.token_ids
    assert b.kv_bytes == a.kv_bytes and b.capacity == a.capacity
    if config.budget < 1:  # compression bites: the cache holds far fewer tokens than it saw
        assert b.capacity == 16 and b.kv_bytes < b.kv_bytes_full_fp16 / 4


def test_split_or_quantized_models_decode_eagerly_by_default(whole, split):
    from h2o_compress.models.weights import eager_only_reason

    assert eager_only_reason(whole[0]) is None
    assert eager_only_reason(split[0]) == "a model split or offloaded by device_map"


def test_disk_offloaded_prefill_logits_are_exact(whole, split):
    """Budget 1.0, 16-bit: the split model's logits through our cache equal the whole model's bit for bit, and
    every layer's storage is on the device its attention ran on."""
    (one, tokenizer), (two, _) = whole, split
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    caches = [make_cache(m, CompressionConfig(), max_length=48) for m in (one, two)]
    with torch.inference_mode():
        logits = [prefill(m, ids, c) for m, c in zip((one, two), caches)]
    assert torch.equal(logits[0], logits[1])
    for layer, device in zip(caches[1].layers, attention_devices(two, 4)):
        assert {t.device for t in layer.tensors().values()} == {device}


def test_saved_cache_loads_onto_a_split_model(whole, tmp_path):
    """A prompt cache saved from the whole model continues on the split one (the CLI loads it with the map)
    with the same tokens."""
    one, tokenizer = whole
    config = CompressionConfig(budget=0.5, kv_bits=8)
    args = ["generate", PROMPT, "--no-chat", "--max-new-tokens", "6", "--budget", "0.5", "--kv-bits", "8", "--json"]
    model_dir = one.name_or_path_for_cache
    saved = runner.invoke(app, [*args, "--model", model_dir, "--device", "cpu", "--save-cache", str(tmp_path / "c")])
    assert saved.exit_code == 0, saved.output
    folder = tmp_path / "off"
    loaded = runner.invoke(app, [*args, "--model", model_dir, "--device-map", json.dumps(SPLIT), "--offload-folder",
                                 str(folder), "--load-cache", str(tmp_path / "c")])
    assert loaded.exit_code == 0, loaded.output
    assert json.loads(loaded.output)["text"] == json.loads(saved.output)["text"]
    assert generate(one, tokenizer, PROMPT, config, 6, chat=False).text == json.loads(saved.output)["text"]


def test_cli_ask_on_a_disk_offloaded_model_answers_as_in_one_piece(four_layer_dir, tmp_path):
    (tmp_path / "doc.txt").write_text(PROMPT)
    common = ["ask", "--context-file", str(tmp_path / "doc.txt"), "--question", "w7 w8", "--model", four_layer_dir,
              "--no-chat", "--max-new-tokens", "6", "--json"]
    plain = runner.invoke(app, common)
    mapped = runner.invoke(app, [*common, "--device-map", json.dumps(SPLIT), "--offload-folder", str(tmp_path / "o")])
    assert plain.exit_code == 0 and mapped.exit_code == 0, mapped.output
    same = ("text", "kv_bytes", "new_tokens")
    answers = [[{k: a[k] for k in same} for a in json.loads(r.output)["answers"]] for r in (plain, mapped)]
    assert answers[1] == answers[0] and answers[0][0]["new_tokens"] == 6


def test_cli_generate_with_a_device_map_file_prints_the_same_text(four_layer_dir, tmp_path):
    common = ["generate", PROMPT, "--model", four_layer_dir, "--no-chat", "--max-new-tokens", "8", "--budget", "0.4",
              "--kv-bits", "4", "--json"]
    plain = runner.invoke(app, common)
    (tmp_path / "map.json").write_text(json.dumps(SPLIT))
    mapped = runner.invoke(app, [*common, "--device-map", str(tmp_path / "map.json"), "--offload-folder",
                                 str(tmp_path / "off")])
    assert plain.exit_code == 0 and mapped.exit_code == 0, mapped.output
    assert json.loads(mapped.output)["text"] == json.loads(plain.output)["text"]


# -- 4-bit weights on CPU: torch's int4 kernel (8 bits: torch's int8 kernel, test_int8_weights.py) ----------------
def test_4bit_weights_load_and_generate_on_cpu(four_layer_dir, whole):
    model, tokenizer = load_model(four_layer_dir, weights_bits=4)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Int4Linear"
    assert type(model.lm_head).__name__ == "Int8Linear"
    assert loaded_weights_bits(model) == 4
    from h2o_compress.models.weights import eager_only_reason

    assert eager_only_reason(model) == "packed 4-bit CPU weights"
    # the planner's CPU 4-bit bytes are what the packed layers hold (+ the buffers, e.g. rotary frequencies,
    # which a loaded model's figure also counts)
    spec = resolve_model(four_layer_dir)
    buffers = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                  if name.rsplit(".", 1)[-1] not in ("weight_int4", "scales_and_zeros", "weight_int8", "scales"))
    assert loaded_weight_bytes(model) == weight_bytes(spec, 4, model.dtype, backend="cpu") + buffers
    assert loaded_weight_bytes(model) < loaded_weight_bytes(whole[0]) / 3
    # our cache at budget 1.0 gives exactly the greedy tokens of transformers' own cache on the same weights
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                   do_sample=False)[0, 40:].tolist()
    assert generate(model, tokenizer, PROMPT, CompressionConfig(), 12, chat=False).token_ids == reference
    # and the 4-bit weights stay close to the fp32 model (bounded error, not equality; group-32 codes on a random
    # model with 4 layers measured 16% of the logits' mean magnitude, int8 1.6%, unrelated logits ~110%)
    with torch.inference_mode():
        ours, full = model(ids).logits.float(), whole[0](ids).logits.float()
    assert (ours - full).abs().mean() < 0.3 * full.abs().mean()


def test_no_backend_is_one_clear_error(four_layer_dir, monkeypatch):
    """Where bitsandbytes cannot run (here simulated: its probe fails as it does without CUDA or a CPU backend),
    one error says what would work, before anything is loaded."""
    import h2o_compress.models.weights as weights

    def no_kernels(bits, device):
        raise RuntimeError("no kernel image is available for execution")

    monkeypatch.setattr(weights, "_probe", no_kernels)
    with pytest.raises(ModelLoadError, match=r"cannot run 4-bit weights on cpu .*what would work: weights_bits=16, or a "
                                             r"CUDA GPU"):
        load_model(four_layer_dir, weights_bits=4, device_map=ON_CPU)
    result = runner.invoke(app, ["generate", "hi", "--model", four_layer_dir, "--weights-bits", "4", "--device-map",
                                 json.dumps(ON_CPU)])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert result.output.startswith("error: bitsandbytes") and "Traceback" not in result.output


def test_missing_bitsandbytes_names_the_package(four_layer_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ModelLoadError, match="needs bitsandbytes; install it with: pip install"):
        load_model(four_layer_dir, weights_bits=4, device_map=ON_CPU)


# -- options checked before loading ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"weights_bits": 3}, r"weights_bits=3 is not supported; allowed: 16, 8, 4 or None \(the default: 8 on CPU"),
    ({"weights_bits": True}, "weights_bits=True is not supported"),
    ({"device_map": "everywhere"}, "device_map='everywhere' is invalid; allowed: auto, balanced"),
    ({"device_map": {}}, "device_map={} is invalid"),
    ({"device_map": {"model": "tpu"}}, r"device_map\['model'\]='tpu' is invalid; allowed: a GPU index"),
    ({"device_map": {"model": -1}}, r"device_map\['model'\]=-1 is invalid"),
    ({"device_map": {"model": 0}}, "names GPU 0 but this machine has"),
    ({"device_map": {"model": "disk"}}, "puts modules on disk but no offload_folder was given"),
    ({"device_map": "auto", "device": "cpu"}, "device='cpu' and a device_map were both given"),
    ({"max_memory": "cpu=1GiB"}, "max_memory only applies to a device_map strategy"),
    ({"offload_folder": "offload"}, "offload_folder 'offload' only applies to a device_map"),
    ({"device_map": "auto", "max_memory": "cpu"}, "max_memory entry 'cpu' is invalid"),
    ({"device_map": "auto", "max_memory": "cpu=lots"}, r"max_memory\['cpu'\]='lots' is invalid"),
])
def test_bad_placement_is_refused_before_loading(kwargs, message):
    if torch.cuda.device_count() and "GPU 0" in message:
        pytest.skip("this machine has a GPU 0")
    with pytest.raises(ConfigError, match=message):  # the model name is never looked at
        load_model("/no/such/model", **kwargs)


def test_offload_folder_must_be_a_directory_without_other_files(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        load_model("/no/such/model", device_map={"model": "disk"}, offload_folder=str(tmp_path / "file"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"holds other files \('notes.txt'\) that offloading could overwrite"):
        load_model("/no/such/model", device_map={"model": "disk"}, offload_folder=str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_placement_options_are_declared_once_and_taken_by_every_command_that_loads_a_model():
    import pathlib

    import typer

    cli = pathlib.Path(__file__).resolve().parents[2] / "h2o_compress" / "cli"
    flags = ("--weights-bits", "--device-map", "--max-memory", "--offload-folder")
    for flag in flags:
        assert [p.name for p in cli.glob("*.py") if f'"{flag}"' in p.read_text()] == ["options.py"], flag
    root = typer.main.get_command(app)
    for path in (("generate",), ("ask",), ("eval", "perplexity"), ("eval", "needle"), ("eval", "agreement"),
                 ("profile",), ("plan",)):
        command = root
        for name in path:
            command = command.commands[name]
        options = {o for p in command.params for o in p.opts}
        assert ({"--weights-bits"} if path == ("plan",) else set(flags)) <= options, path


def test_device_map_and_max_memory_parsing(tmp_path):
    assert parse_device_map(None) is None and parse_device_map("auto") == "auto"
    assert parse_device_map('{"model": "cpu", "lm_head": "disk"}') == {"model": "cpu", "lm_head": "disk"}
    (tmp_path / "m.json").write_text('{"model": "cpu"}')
    assert parse_device_map(str(tmp_path / "m.json")) == {"model": "cpu"}
    with pytest.raises(ConfigError, match="is not valid JSON"):
        parse_device_map("{model")
    assert parse_max_memory("cpu=2GiB, disk=1000") == {"cpu": 2 * 2**30, "disk": 1000}


@pytest.mark.parametrize("args,message", [
    (["--weights-bits", "2"], "error: weights_bits=2 is not supported"),
    (["--device-map", "{nope"], "error: device_map='{nope' is not valid JSON"),
    (["--device-map", '{"model": "disk"}'], "error: device_map puts modules on disk but no offload_folder"),
    (["--offload-folder", "offload"], "error: offload_folder 'offload' only applies to a device_map"),
])
@pytest.mark.parametrize("command", [["generate", "hi"], ["eval", "perplexity"], ["profile", "--out", "OUT"],
                                     ["ask", "--context-file", "CONTEXT", "--question", "Q"]])
def test_cli_refuses_bad_placement_in_one_line_before_any_side_effect(tmp_path, command, args, message):
    (tmp_path / "context.txt").write_text("A short document.")
    names = {"OUT": str(tmp_path / "out"), "CONTEXT": str(tmp_path / "context.txt")}
    command = [names.get(c, c) for c in command]
    result = runner.invoke(app, [*command, "--model", "/no/such/model", *args])
    assert result.exit_code == 2 and result.output.startswith(message), result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "out").exists()


def test_profile_settings_carry_the_placement_to_the_loader(monkeypatch, tmp_path):
    from h2o_compress.profiling import sweep
    from h2o_compress.profiling.sweep import ProfileSettings, _load

    with pytest.raises(ConfigError, match="weights_bits=3 is not supported"):
        ProfileSettings(placement={"weights_bits": 3})
    with pytest.raises(ConfigError, match="placement keys \\['bits'\\] are unknown"):
        ProfileSettings(placement={"bits": 4})
    seen = {}
    monkeypatch.setattr(sweep, "load_model", lambda name, **kwargs: seen.update(kwargs, name=name))
    placement = {"device_map": {"model": "disk"}, "offload_folder": str(tmp_path)}
    _load(ProfileSettings(model="m", device="auto", placement=placement))
    assert seen["device_map"] == {"model": "disk"} and seen["offload_folder"] == str(tmp_path) and seen["name"] == "m"
    assert seen["weights_bits"] == 16  # resolved: a map loads 16-bit weights by default
    # the embedded model on CPU: int8 by default, recorded as 8 (never None); an explicit 16 stays 16
    embedded = ProfileSettings(model="smollm2-135m", device="cpu", placement={"weights_bits": None})
    assert embedded.placement == {"weights_bits": 8} and ProfileSettings(device="cpu").placement == {"weights_bits": 8}
    assert ProfileSettings(device="cpu", placement={"weights_bits": 16}).placement == {"weights_bits": 16}
    _load(embedded)
    assert seen["weights_bits"] == 8 and seen["name"] == "smollm2-135m"


# -- generate --memory-limit: planned with the weights it loads, planned vs measured peak --------------------
def test_memory_limit_plans_with_the_loaded_weight_bits(four_layer_dir):
    result = runner.invoke(app, ["generate", PROMPT, "--model", four_layer_dir, "--no-chat", "--max-new-tokens", "6",
                                 "--weights-bits", "4", "--memory-limit", "64GiB", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.splitlines()[-1])
    model, _ = load_model(four_layer_dir, weights_bits=4)
    assert figures["weights_bits"] == 4
    assert figures["planned_peak_bytes"] > loaded_weight_bytes(model)  # weights as loaded + cache + workspace
    assert figures["measured_peak_kind"] == "cpu_peak_rss"  # the whole process: the limit bounds it
    # the window opens before the load and restarts after it: the weights stay resident while generating, so the
    # peak covers them (what the window counts and drops: tests/utils/test_memory.py)
    assert figures["measured_peak_bytes"] >= loaded_weight_bytes(model), (figures, loaded_weight_bytes(model))
    text = runner.invoke(app, ["generate", PROMPT, "--model", four_layer_dir, "--no-chat", "--max-new-tokens", "4",
                               "--weights-bits", "4", "--memory-limit", "64GiB"])
    assert "[peak memory while generating: planned" in text.output and "measured" in text.output


@pytest.mark.integration
def test_smollm2_loads_int8_weights_by_default_on_cpu(smollm2):
    """The embedded SmolLM2 alias on CPU with the default weights_bits (the session fixture's
    ``load_model("smollm2-135m", device="cpu")``) has 8-bit weights (torch's packed int8 kernel, the head included
    and untied from the fp32 embedding): a few coherent tokens through a compressed cache, its bytes the planner's
    8-bit CPU count to the byte, and a plan of it says 8 bits; ``weights_bits=16`` loads fp32 Linear layers."""
    model, tokenizer = smollm2
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Int8Linear" and loaded_weights_bits(model) == 8
    assert type(model.lm_head).__name__ == "Int8Linear" and model.model.embed_tokens.weight.dtype == torch.float32
    result = generate(model, tokenizer, "The capital of France is", CompressionConfig(budget=0.5, kv_bits=4), 4)
    assert result.new_tokens == 4 and result.text.strip()
    rotary = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "int8" not in n and "scales" not in n)
    assert loaded_weight_bytes(model) == weight_bytes(resolve_model("smollm2-135m"), 8, torch.float32, "cpu") + rotary
    report = plan(model, "1GiB")
    assert report.weights_bits == 8 and report.weight_bytes == loaded_weight_bytes(model)
    fp32, _ = load_model("smollm2-135m", device="cpu", weights_bits=16)
    linears = [m for m in fp32.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 211 and all(m.weight.dtype == torch.float32 for m in linears)
    assert not [m for m in fp32.modules() if type(m).__name__ == "Int8Linear"] and loaded_weights_bits(fp32) == 32
    assert loaded_weight_bytes(fp32) == weight_bytes(resolve_model("smollm2-135m"), 16, torch.float32) + rotary
    assert loaded_weight_bytes(model) < 0.5 * loaded_weight_bytes(fp32)  # Linear weights and the head at 1 byte (0.46x)


@pytest.mark.integration
def test_cli_loads_the_embedded_model_int8_by_default_and_fp32_with_weights_bits_16(monkeypatch):
    """``generate --device cpu`` loads int8 weights and says so (``--json``'s ``weights_bits``: 8, resolved, not
    None); ``--weights-bits 16`` loads fp32 Linear layers and reports 16."""
    import h2o_compress.models as models

    real, loaded = models.load_model, []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    for flags, bits in (([], 8), (["--weights-bits", "16"], 16)):
        result = CliRunner().invoke(app, ["generate", "Hi", "--device", "cpu", "--max-new-tokens", "2", "--json",
                                          *flags])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["weights_bits"] == bits
        packed = [m for m in loaded[-1][0].modules() if type(m).__name__ == "Int8Linear"]
        assert len(packed) == (211 if bits == 8 else 0), flags


# -- CUDA only -------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_split_generates_the_same_tokens(four_layer_dir):
    one, tokenizer = load_model(four_layer_dir, device="cuda:0", dtype="float32")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    two, _ = load_model(four_layer_dir, device_map=device_map, dtype="float32")
    assert attention_devices(two, 4) == [torch.device("cuda", 0)] * 2 + [torch.device("cuda", 1)] * 2
    for config in (CompressionConfig(), CompressionConfig(budget=0.3, kv_bits=4)):
        a = generate(one, tokenizer, PROMPT, config, 24, chat=False)
        b = generate(two, tokenizer, PROMPT, config, 24, chat=False)
        assert b.token_ids == a.token_ids and b.kv_bytes == a.kv_bytes


@pytest.mark.cuda
def test_nf4_memory_limit_peak_within_ten_percent_of_the_plan():
    """``generate --memory-limit --weights-bits 4`` on SmolLM2: NF4 weights are loaded and the peak CUDA memory
    measured over load + generation is within 10% of the planner's total."""
    prompt = "Summarise the plot of a detective story in which the butler did it. " * 40
    result = runner.invoke(app, ["generate", prompt, "--model", "smollm2-135m", "--max-new-tokens", "64",
                                 "--weights-bits", "4", "--memory-limit", "2GiB", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.splitlines()[-1])
    assert figures["weights_bits"] == 4 and figures["measured_peak_kind"] == "cuda_max_memory_allocated"
    assert abs(figures["measured_peak_bytes"] - figures["planned_peak_bytes"]) <= 0.1 * figures["planned_peak_bytes"]
