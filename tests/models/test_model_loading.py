"""load_model on local directories: weights that disagree with config.json are refused (instead of being
initialised randomly or dropped in silence), and an incomplete directory says what it lacks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import save_tiny_model_dir, tiny_llama
from typer.testing import CliRunner

from h2o_compress import load_model
from h2o_compress.cli import app
from h2o_compress.utils.errors import ModelLoadError

runner = CliRunner()


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """A correct tiny model directory (2 layers, untied embeddings); tests copy it before damaging it."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def copy_with_config(saved_dir, tmp_path, **changes) -> str:
    """A copy of ``saved_dir`` whose config.json has ``changes`` (the weights are left as they are)."""
    path = tmp_path / "model"
    shutil.copytree(saved_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def refused(path) -> str:
    """The one-line message of the ModelLoadError ``load_model(path)`` raises."""
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(path, device="cpu")
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def assert_cli_refuses(path, fragment: str) -> None:
    result = runner.invoke(app, ["generate", "--model", path, "w1"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.output


def test_correct_tiny_model_loads_its_own_weights(saved_dir):
    model, tokenizer = load_model(saved_dir, device="cpu")
    reference = tiny_llama(0)  # what save_tiny_model_dir saved
    assert model.config.num_hidden_layers == 2
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert tokenizer("w1 w2")["input_ids"][-2:] == [1, 2]


def test_tied_embeddings_without_lm_head_weight_load(tmp_path):
    """A tied model's checkpoint has no lm_head.weight: legitimately absent, not a mismatch."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    path = tmp_path / "tied"
    save_tiny_model_dir(path)
    config = tiny_llama(0).config
    config.tie_word_embeddings = True
    LlamaForCausalLM(config).save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        assert "lm_head.weight" not in weights.keys()
    model, _ = load_model(str(path), device="cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_old_rotary_inv_freq_buffers_in_checkpoint_load(saved_dir, tmp_path):
    """Old LLaMA checkpoints store rotary ``inv_freq`` per layer; transformers ignores them, and so do we."""
    from safetensors.torch import load_file, save_file

    path = copy_with_config(saved_dir, tmp_path)
    weights = load_file(f"{path}/model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    model, _ = load_model(path, device="cpu")
    reference, _ = load_model(saved_dir, device="cpu")
    assert model.state_dict().keys() == reference.state_dict().keys()  # the stale buffer is not taken in
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert not torch.equal(model.model.rotary_emb.inv_freq, torch.ones(16))  # computed from the config
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=0, rtol=0)


def test_config_with_more_layers_than_weights_is_refused(saved_dir, tmp_path):
    path = copy_with_config(saved_dir, tmp_path, num_hidden_layers=4)
    message = refused(path)
    assert message.startswith(f"cannot load model {path!r}: its config.json does not match its weights"), message
    # layers 2 and 3: 9 weights each, the first named in order
    assert "18 weight(s) the config asks for are missing" in message, message
    assert "initialised randomly (model.layers.2.input_layernorm.weight, " in message, message
    assert "and 15 more" in message and "allowed: use the config.json saved with these weights" in message
    assert_cli_refuses(path, "18 weight(s) the config asks for are missing")


def test_config_with_fewer_layers_than_weights_is_refused(saved_dir, tmp_path):
    path = copy_with_config(saved_dir, tmp_path, num_hidden_layers=1)
    message = refused(path)
    assert message.startswith(f"cannot load model {path!r}: its config.json does not match its weights"), message
    assert "9 weight(s) in the checkpoint are not part of the model" in message, message
    assert "would be dropped (model.layers.1.input_layernorm.weight, " in message, message
    assert "missing" not in message, message


CONTENTS = "a model directory (as save_pretrained writes it) needs config.json, weights"


def test_empty_directory_says_what_a_model_directory_needs(tmp_path):
    path = tmp_path / "m_empty"
    path.mkdir()
    message = refused(str(path))
    assert message.startswith(f"cannot load model {str(path)!r}: the directory is empty; {CONTENTS}"), message
    assert "tokenizer.json" in message and "model.safetensors" in message, message
    assert "backend tokenizer" not in message, message
    assert_cli_refuses(str(path), "the directory is empty")


@pytest.mark.parametrize("kept,lacking", [
    # config first, then weights, then tokenizer: the first missing one is named
    ({"model.safetensors", "tokenizer.json", "tokenizer_config.json"}, "has no config.json"),
    ({"tokenizer.json"}, "has no config.json"),
    ({"config.json"}, "has no weights (none of model.safetensors, "),
    ({"config.json", "tokenizer.json", "tokenizer_config.json"}, "has no weights"),
    ({"config.json", "model.safetensors", "generation_config.json"}, "has no tokenizer files"),
])
def test_incomplete_directory_names_what_it_lacks(saved_dir, tmp_path, kept, lacking):
    path = tmp_path / "partial"
    path.mkdir()
    for name in kept:
        shutil.copy(f"{saved_dir}/{name}", path / name)
    message = refused(str(path))
    assert message.startswith(f"cannot load model {str(path)!r}: the directory {lacking}"), message
    assert CONTENTS in message, message
