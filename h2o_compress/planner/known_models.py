"""Model descriptions for the memory planner, without loading weights.

A model is named by a local directory holding ``config.json``, by the name of a well-known model whose
architecture ships with the package (``data/known_models.json``: OPT, LLaMA, Llama-2, Llama-3, Mistral,
GPT-NeoX, Pythia, SmolLM2), by a transformers config, or by a loaded model. Parameter counts come from
building the model on PyTorch's ``meta`` device (no memory, exact for every architecture transformers knows).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from h2o_compress.utils.errors import ModelLoadError, short
from h2o_compress.models import ModelDims, check_config_values, check_model_dir, model_dims
from h2o_compress.models.weights import floating_dtype, loaded_weight_bytes
from h2o_compress.planner.states import StateTensor, model_states


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know of a model.

    Attributes:
        name: the name it was asked for.
        dims: KV geometry (layers, query heads, KV heads, head_dim).
        hidden_size: activation widths (elements).
        intermediate_size: activation widths (elements).
        vocab_size: activation widths (elements).
        max_context: the model's context window in tokens (``max_position_embeddings``), ``None`` if unknown.
        num_parameters: all parameters, tied weights counted once.
        linear_parameters: parameters of the ``nn.Linear`` layers except the output head (what 8/4-bit weight
            quantization such as bitsandbytes' ``load_in_8bit``/``load_in_4bit`` converts).
        linear_rows: output features summed over those layers (one 8-bit scale each).
        head_parameters: parameters of the output head when it is an ``nn.Linear`` (0 otherwise).
        head_rows: its output features (the vocabulary).
        head_tied: whether the head shares its weight with the input embeddings (then ``num_parameters`` counts
            it once, as the embedding).
        loaded_bytes: exact bytes of a loaded model's parameters and buffers (``None`` when not loaded).
        dtype: the loaded model's dtype (``None`` when not loaded).
        states: a hybrid model's constant state tensors over all its layers
            ([`model_states`][h2o_compress.planner.model_states]; ``()`` for attention-only models).
    """

    name: str
    dims: ModelDims
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_context: int | None
    num_parameters: int
    linear_parameters: int
    linear_rows: int
    loaded_bytes: int | None = None
    dtype: torch.dtype | None = None
    head_parameters: int = 0
    head_rows: int = 0
    head_tied: bool = False
    states: tuple[StateTensor, ...] = ()


def _key(name: str) -> str:
    """Lookup key: lower case, no org prefix, no ``-hf`` suffix or ``meta-`` prefix, no ``-``/``_``/spaces."""
    name = name.strip().lower().rsplit("/", 1)[-1]
    name = name.removesuffix("-hf").removeprefix("meta-")
    return re.sub(r"[-_ ]", "", name)


@functools.lru_cache(maxsize=1)
def known_models() -> dict[str, dict]:
    """The shipped table: canonical name -> ``{"hf_id", "aliases", "config"}`` (config.json fields)."""
    text = resources.files("h2o_compress").joinpath("data/known_models.json").read_text(encoding="utf-8")
    return json.loads(text)["models"]


@functools.lru_cache(maxsize=1)
def _index() -> dict[str, str]:
    index = {}
    for name, entry in known_models().items():
        for alias in (name, entry["hf_id"], *entry["aliases"]):
            index[_key(alias)] = name
    return index


def known_config(name: str):
    """The transformers config of a known model, or ``None`` if ``name`` is not one."""
    from transformers import AutoConfig

    canonical = _index().get(_key(name))
    if canonical is None:
        return None
    fields = dict(known_models()[canonical]["config"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _count(model) -> tuple[int, int, int, int, int, bool]:
    """(all parameters, Linear parameters except the output head, their output rows, the head's parameters, its
    rows, whether it is tied to the input embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = rows = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            linear += module.weight.numel()
            rows += module.out_features
    head_params = head_rows = 0
    tied = False
    if isinstance(head, torch.nn.Linear):
        head_params, head_rows = head.weight.numel(), head.out_features
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        tied = getattr(embeddings, "weight", None) is head.weight
    return sum(p.numel() for p in model.parameters()), linear, rows, head_params, head_rows, tied


@functools.lru_cache(maxsize=64)
def _meta_counts(config_json: str, model_type: str) -> tuple[int, int, int, int, int, bool]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    # transformers writes non-finite floats as {"__float__": "Infinity"} (Mamba-2's time_step_limit): read them back
    fields = json.loads(config_json, object_hook=lambda o: float(o["__float__"]) if set(o) == {"__float__"} else o)
    fields.pop("model_type", None)
    config = AutoConfig.for_model(model_type, **fields)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"cannot build a {short(model_type)} causal LM from its config: {str(exc)[:200]}") from None
    finally:
        logging.set_verbosity(verbosity)
    return _count(model)


def _checked_counts(config) -> tuple[int, int, int, int, int, bool]:
    """`_meta_counts` of ``config``, after its geometry and states are read (a model the cache cannot run, such as
    Gemma 4's head dim that varies by layer, is refused in one line before anything is built).

    Raises:
        UnsupportedModelError: from [`model_dims`][h2o_compress.models.model_dims] or
            [`model_states`][h2o_compress.planner.model_states].
        ModelLoadError: a config transformers cannot build a causal LM from.
    """
    model_dims(config)
    model_states(config)
    return _meta_counts(config.to_json_string(), config.model_type)


def _spec(name: str, config, counts: tuple, loaded_bytes=None, dtype=None) -> ModelSpec:
    text = getattr(config, "get_text_config", lambda: config)()
    hidden = text.hidden_size
    inner = getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None) or 4 * hidden
    return ModelSpec(
        name=name, dims=model_dims(config), hidden_size=hidden, intermediate_size=inner,
        vocab_size=text.vocab_size, max_context=getattr(text, "max_position_embeddings", None),
        num_parameters=counts[0], linear_parameters=counts[1], linear_rows=counts[2],
        loaded_bytes=loaded_bytes, dtype=dtype, head_parameters=counts[3], head_rows=counts[4], head_tied=counts[5],
        states=model_states(config),
    )


def resolve_model(model, trust_remote_code: bool = False) -> ModelSpec:
    """Describe ``model``: a name (local directory or known model), a transformers config or a loaded model.

    Raises:
        ModelLoadError: an unknown name (the message lists the known ones), an unreadable ``config.json``, a
            config no real model has ([`h2o_compress.models.check_config_values`][h2o_compress.models.check_config_values], checked before anything
            is built), custom code (``auto_map``) without ``trust_remote_code``, or a config transformers cannot
            build a causal LM from.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        name = getattr(model, "name_or_path_for_cache", None) or getattr(model.config, "_name_or_path", "") or "model"

        footprint = loaded_weight_bytes(model)  # with bitsandbytes' scales, which get_memory_footprint misses
        dtype = floating_dtype(model)  # 8/4-bit weights are integers: the compute dtype is the floating one
        return _spec(name, model.config, _count(model), loaded_bytes=footprint, dtype=dtype)
    if isinstance(model, PretrainedConfig):
        check_config_values(model.to_dict(), "the config")
        return _spec(model.model_type, model, _checked_counts(model))
    if not isinstance(model, str) or not model.strip():
        raise ModelLoadError(f"model {short(model)} is not a name, a transformers config or a loaded model")
    if Path(model).is_dir():
        check_model_dir(model, trust_remote_code, weights=False)  # sizes come from the config alone
        try:
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise ModelLoadError(f"cannot read the config of {short(model)}: {reason}") from None
        check_config_values(config.to_dict(), f"config.json of {short(model)}")
        return _spec(model, config, _checked_counts(config))
    config = known_config(model)
    if config is None:
        raise ModelLoadError(
            f"unknown model {short(model)}: not a local model directory and not a known model; known: "
            f"{', '.join(known_models())}"
        )
    return _spec(model, config, _checked_counts(config))
