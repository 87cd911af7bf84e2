"""The state a saved cache holds: one [`CompressedCache`][h2o_compress.cache.CompressedCache] in one safetensors file.

File format (``format_version`` 3: the slot layout of [`h2o_compress.cache`][h2o_compress.cache]; older files are refused):

- tensors, per layer ``i``: ``layers.{i}.{name}`` for every buffer of
  [`tensors`][h2o_compress.cache.CompressedLayer.tensors] (the slot store: stored keys/values parts, positions,
  scores; the ring window: keys, values, positions, scores; ``seen``, ``first_real``, ``finite``); optionally ``prompt.token_ids`` (int64 ``[batch, tokens]``) and
  ``prompt.next_logits`` (``[batch, vocab]``), the prompt the cache holds and the logits of its next token,
  so a loaded cache continues exactly like the live one.
- metadata (strings): ``format``, ``format_version``, ``library_version``, ``model_fingerprint`` (see
  `model_fingerprint`), ``model_id``, ``model_dtype`` (the keys' dtype, e.g. ``float16``; named when a
  model in another dtype loads the file), ``config`` (JSON of [`CompressionConfig`][h2o_compress.config.CompressionConfig]), ``capacity``,
  ``tokens`` (tokens seen), ``layers`` (JSON list of per-layer state) and ``checksum``: SHA-256 over every
  other metadata field and every tensor's name, dtype, shape and bytes. The checksum catches truncation and
  accidental damage, not a deliberate edit (anyone can recompute it): every structural field and every invariant
  a layer can be checked for is checked on load as well (``_check_structure``, ``_check_prompt``,
  ``_check_layer_values``; fuzzed by ``tests/persistence/test_cache_file_fuzz.py``).

Writes are atomic: the file is written to a temporary name in the target directory, flushed to disk and
renamed over the target, so an interrupted save leaves either the old file or the new one, never half a file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
import torch
from h2o_compress.formats.calibrated import CalibratedKeyQuantizer
from h2o_compress.utils.checks import is_integer
from h2o_compress.utils.errors import CacheFileError, CacheStateError, ConfigError, short
from h2o_compress.utils.files import parse_json
from h2o_compress.persistence.calibration_file import calibration_for
from h2o_compress.models.identity import (
    filled_elsewhere, legacy_fingerprint, model_fingerprint, model_identity, record_model,
)
from h2o_compress.models.weights import attention_devices, floating_dtype, input_device
from h2o_compress.models.int8_linear import int8_layers
from h2o_compress.attention import use_h2o_attention
from h2o_compress.cache import CompressedCache, CompressedLayer, build_layers
from h2o_compress.config import LAYER_BUDGETS, CompressionConfig
from h2o_compress.models import model_dims, torch_decode_reason
from h2o_compress.policies.base import NO_POSITION
from h2o_compress.persistence.file_format import (
    check_cache_source, check_save_target, read_cache_file, write_cache_file,
)


# Tensors of a layer's geometry (`h2o_compress.cache.state.Geometry`) rebuilt from the config on load: never saved.
DERIVED_LAYER_TENSORS = ("key_basis", "value_basis")


# Config fields that change how attention runs, not what the cache holds: a file loads under any value.
RUNTIME_CONFIG_FIELDS = {"attention_kernel", "prefill_chunk_size"}


@dataclass
class PromptState:
    """The prompt a cache holds: ``token_ids`` int64 ``[batch, tokens]`` (CPU) and ``next_logits``
    ``[batch, vocab]`` (the model's logits for the token after the prompt; ``None`` when unknown)."""

    token_ids: torch.Tensor
    next_logits: torch.Tensor | None = None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CacheFileError(f"unknown dtype {name!r} in cache file")
    return dtype


def _check_saveable(cache) -> int:
    """Tokens seen by every layer; raises CacheStateError for an empty, mid-step or inconsistent cache, or a
    hybrid model's (linear-attention/SSM states are not saved)."""
    if not isinstance(cache, CompressedCache):
        raise CacheStateError(f"cannot save {type(cache).__name__}; allowed: a CompressedCache (make_cache)")
    if cache.state_layers:
        raise CacheStateError("saving a cache with linear-attention/SSM states is not supported (a hybrid model's "
                              f"{len(cache.state_layers)} state layers); allowed: caches of attention-only models")
    if not all(layer.is_initialized for layer in cache.layers):
        raise CacheStateError("cannot save an empty cache: run the prompt through the model first")
    cache.check()
    if any(layer.link.awaiting for layer in cache.layers):
        raise CacheStateError("cannot save a cache in the middle of a forward pass (attention has not run yet)")
    seen = {int(layer.counters.seen) for layer in cache.layers}
    if len(seen) != 1:
        raise CacheStateError(f"cannot save: layers have seen different token counts {sorted(seen)} (a failed step?)")
    if any(isinstance(layer.setting.key_quantizer, CalibratedKeyQuantizer) for layer in cache.layers):
        raise CacheStateError("cannot save a cache whose keys are stored around a key calibration (the file format "
                              "does not record the offsets); allowed: a cache made with key_offsets='none' (and "
                              "without use_key_calibration)")
    return seen.pop()


#: Buffers derived from others (VATP's value norms, from the stored values): not saved, recomputed on load.
DERIVED = frozenset({"store.value_norms"})


def _saved_tensors(layer) -> dict[str, torch.Tensor]:
    """The buffers of ``layer`` a cache file holds: every one but the `DERIVED`."""
    return {name: t for name, t in layer.tensors().items() if name not in DERIVED}


def _cache_contents(cache, tokens: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        tensors |= {f"layers.{i}.{name}": t.contiguous() for name, t in _saved_tensors(layer).items()}
        geometry, setting = layer.geometry, layer.setting
        layers.append(
            {
                "seen_tokens": int(layer.counters.seen), "batch": geometry.batch, "kv_heads": geometry.kv_heads,
                "head_dim": geometry.head_dim, "dtype": str(geometry.dtype),
                "residual_dtype": str(geometry.residual_dtype), "capacity": setting.capacity,
                "residual": setting.residual, "max_tokens": setting.max_tokens,
            }
        )
    state = getattr(cache, "prompt_state", None)
    if isinstance(state, PromptState) and state.token_ids.shape == (layers[0]["batch"], tokens):
        tensors["prompt.token_ids"] = state.token_ids.to(torch.int64)
        if state.next_logits is not None:
            tensors["prompt.next_logits"] = state.next_logits
    return tensors, layers


def save_cache(cache, path, model=None, overwrite: bool = False) -> Path:
    """Write ``cache`` to ``path`` (safetensors, atomically: temp file + fsync + rename).

    Args:
        cache: a [`CompressedCache`][h2o_compress.cache.CompressedCache] that has seen at least one token (all layers at the same count).
        path: target file; its directory must exist. An existing cache file is replaced only once the new one
            is complete; any other existing file only with ``overwrite`` (see [`check_save_target`][h2o_compress.persistence.check_save_target]).
        overwrite: also replace an existing regular file that is not a cache file of this library.
        model: the model the cache belongs to; its `model_fingerprint` is stored. ``None`` uses the
            fingerprint recorded on the cache by [`load_cache`][h2o_compress.persistence.load_cache]/`h2o_compress.runtime.prefill.prefill`
            (``cache.model_fingerprint``).

    Returns:
        The path written.

    Raises:
        CacheStateError: not a CompressedCache, empty, mid-step or inconsistent cache, no model fingerprint, or
            ``model`` differs from the one recorded on the cache.
        CacheFileError: bad path, missing or unwritable directory, a target that is not a regular file or
            (without ``overwrite``) not a cache file, or a write that fails (full disk, file size limit).
    """
    target = check_save_target(path, overwrite)
    tokens = _check_saveable(cache)
    recorded = getattr(cache, "model_fingerprint", None)
    fingerprint = model_fingerprint(model) if model is not None else recorded
    if fingerprint is None:
        raise CacheStateError("cannot save: pass model= so the file records which model the cache belongs to")
    if recorded is not None and fingerprint != recorded:
        raise CacheStateError("cannot save: model= is not the model this cache was filled with")
    layer = filled_elsewhere(cache, model)
    if layer is not None:
        raise CacheStateError(
            f"cannot save: layer {layer} of this cache was filled by another model than the one it was made for "
            f"({cache.model_id}, fingerprint {fingerprint[:12]}), so the file would name a model whose keys it does "
            "not hold; allowed: a cache made and filled by one model (make_cache(model, ...), then that model)"
        )
    tensors, layers = _cache_contents(cache, tokens)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    metadata = {
        "model_fingerprint": fingerprint, "model_id": str(cache.model_id),
        "config": json.dumps(cache.config.to_dict(), sort_keys=True), "capacity": json.dumps(cache.capacity),
        "tokens": str(tokens), "layers": json.dumps(layers),
        "model_dtype": str(cache.layers[0].geometry.dtype).removeprefix("torch."),
    }
    write_cache_file(target, metadata, tensors)
    return target


def _saved_config(metadata: dict[str, str], source: Path):
    fields = _metadata_json(metadata, "config", source)
    try:
        budgets = fields.get("layer_budgets") if isinstance(fields, dict) else None
        if isinstance(budgets, str) and budgets not in LAYER_BUDGETS:  # a path: a crafted file names no other file
            raise CacheFileError(f"cache file {str(source)!r} names layer_budgets {short(budgets)}; allowed in a cache "
                                 f"file: {', '.join(LAYER_BUDGETS)} or the per-layer weights themselves (numbers)")
        if isinstance(fields, dict) and fields.get("key_offsets", "none") != "none":  # save_cache refuses them
            raise CacheFileError(f"cache file {str(source)!r} names key_offsets {short(fields['key_offsets'])}, which "
                                 "no cache file holds; allowed in a cache file: key_offsets 'none'")
        return CompressionConfig(**fields)
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFileError(f"cache file {str(source)!r} holds an unusable config ({exc})") from None


def _check_config(saved, expected, source: Path) -> None:
    """Refuse ``expected`` (a CompressionConfig, or a dict of fields) where it differs from ``saved``."""
    if expected is None:
        return
    if isinstance(expected, CompressionConfig):
        expected = expected.to_dict()
    if not isinstance(expected, dict):
        raise ConfigError(f"config={short(expected)} is invalid; allowed: None, a CompressionConfig or a dict of fields")
    expected, saved_values = _flat_options(expected), _flat_options(saved.to_dict())
    unknown = sorted(set(expected) - set(saved_values))
    if unknown:
        raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; allowed: {', '.join(saved_values)}")
    diffs = [
        f"{k}={expected[k]!r} (file: {saved_values[k]!r})"
        for k in expected
        if expected[k] != saved_values[k] and k not in RUNTIME_CONFIG_FIELDS
    ]
    if diffs:
        raise CacheStateError(
            f"cache file {str(source)!r} was saved with a different config: {', '.join(diffs)}; "
            "allowed: the file's config (leave these settings out to use it)"
        )


def _flat_options(values: dict) -> dict:
    """``values`` with the entries of its ``policy_options`` (a policy's options without a field of their own) as
    settings of their own, as the command line and config files give them."""
    options = values.get("policy_options")
    if not isinstance(options, dict):
        return values
    return {**{k: v for k, v in values.items() if k != "policy_options"}, **options}


def _check_dtype(metadata: dict[str, str], model, source: Path) -> None:
    """Name the dtypes when the file was saved from a model of this one's architecture in another dtype (the
    fingerprint covers the parameters' dtype, so it cannot tell whether the weights differ too; a file saved before
    ``model_dtype`` was recorded keeps the fingerprint message).

    Raises:
        CacheStateError: naming both dtypes and the one to load the model in.
    """
    saved, current = metadata.get("model_dtype"), str(floating_dtype(model)).removeprefix("torch.")
    if saved is None or saved == current or metadata.get("model_id") != model_identity(model):
        return
    raise CacheStateError(
        f"cache file {str(source)!r} was saved from {metadata.get('model_id')!r} in {saved}, and this model is "
        f"{current} (the fingerprints differ); allowed: the model that saved it, in the dtype it was saved with "
        f"(--dtype {saved}, or load_model(..., dtype=torch.{saved}))"
    )


def load_cache(path, model, config=None):
    """Load a cache saved by [`save_cache`][h2o_compress.persistence.save_cache] for ``model``, on the model's device.

    Args:
        path: the file.
        model: the model to use the cache with; must be the model that saved it (same
            `model_fingerprint`). It is switched to the ``h2o_compress`` attention function.
        config: ``None`` (use the saved config), a [`CompressionConfig`][h2o_compress.config.CompressionConfig] that must equal the saved one,
            or a dict of config fields that must match it.

    Returns:
        A [`CompressedCache`][h2o_compress.cache.CompressedCache] in the saved state (tokens, scores, capacity), with ``prompt_state`` set
        when the file holds the prompt's token ids.

    Raises:
        CacheFileError: missing, truncated, tampered or unknown-version file.
        CacheStateError: a different model, or a config that differs from the saved one.
        UnsupportedModelError: the model's attention cannot be scored.
    """

    source = check_cache_source(path)
    metadata, tensors = read_cache_file(source)
    fingerprint = _check_model(metadata, model, source)
    saved = _saved_config(metadata, source)
    _check_config(saved, config, source)
    dims = model_dims(model.config)
    layer_states, capacity, max_tokens = _check_structure(metadata, dims, source)
    _check_capacity(saved, capacity, max_tokens, source)
    _check_prompt(tensors, layer_states[0], model, source)
    use_h2o_attention(model)
    device = input_device(model)
    devices = attention_devices(model, dims.num_layers)  # each layer's storage where its attention runs
    capacities = _global_capacities(saved, layer_states, capacity, dims, source)
    # the layers make_cache builds for this model: its spans (sliding, chunked) and decode form (soft-cap, sinks, MLA)
    calibration = calibration_for(saved, model)
    layers = build_layers(saved, dims.num_layers, dims.head_dim, capacity, max_tokens=max_tokens,
                          capacities=capacities, spans=dims.spans, torch_decode=torch_decode_reason(model, dims),
                          calibration=calibration, value_dim=dims.value_head_dim)
    for i, (layer, state) in enumerate(zip(layers, layer_states)):
        if layer.setting.capacity != state["capacity"]:
            raise CacheFileError(
                f"cache file {str(source)!r}: layer {i} holds capacity {short(state['capacity'])} but the file's "
                f"config ({saved.layer_budgets} layer budgets of {capacity}) gives {layer.setting.capacity}"
            )
        _check_sizes(layer, i, state, tensors, source)  # every layer, before any of them allocates
    for i, (layer, state) in enumerate(zip(layers, layer_states)):
        _restore_layer(layer, i, state, tensors, devices[i])
    cache = CompressedCache(layers, saved, model_id=model_identity(model), capacity=capacity)
    record_model(cache, model, fingerprint)
    if "prompt.token_ids" in tensors:
        logits = tensors.get("prompt.next_logits")
        cache.prompt_state = PromptState(tensors["prompt.token_ids"], None if logits is None else logits.to(device))
    return cache


def _check_model(metadata: dict[str, str], model, source: Path) -> str:
    """The model's fingerprint, when the file was saved for this model: its `model_fingerprint`, or for a file
    saved by an earlier version its `legacy_fingerprint` (which sampled fewer values).

    Raises:
        CacheStateError: another model (naming both), or this one in another dtype (`_check_dtype`).
    """
    fingerprint, saved = model_fingerprint(model), metadata.get("model_fingerprint")
    if saved != fingerprint and saved != legacy_fingerprint(model):
        _check_dtype(metadata, model, source)
        raise CacheStateError(
            f"cache file {str(source)!r} was saved for model {metadata.get('model_id')!r} (fingerprint "
            f"{str(saved)[:12]}), not this one ({model_identity(model)}, fingerprint {fingerprint[:12]}); "
            f"allowed: the model that saved it{_weights_hint(metadata, model)}"
        )
    return fingerprint


def _weights_hint(metadata: dict[str, str], model) -> str:
    """What to add to the refusal of a file saved for this architecture when ``model`` has packed int8 CPU weights
    (`h2o_compress.models.int8_linear`, the CPU default of the embedded model): a cache saved with
    fp32 weights, as every earlier default saved, needs them again. Empty otherwise."""
    if metadata.get("model_id") != model_identity(model) or not int8_layers(model):
        return ""
    return (" (this model has 8-bit weights, the CPU default for the embedded model: a cache saved with fp32 weights "
            "loads into the model loaded with --weights-bits 16, or load_model(..., weights_bits=16))")


def _metadata_json(metadata: dict[str, str], field: str, source: Path):
    """The JSON value of metadata ``field``: nested too deeply, ``NaN``/``Infinity``, numbers beyond a float and
    integers of more than 18 digits are refused as they are read.

    Raises:
        CacheFileError: the field is missing or not such JSON, naming it.
    """
    if not isinstance(metadata.get(field), str):
        raise CacheFileError(f"cache file {str(source)!r} has no metadata {field!r}; allowed: a file written by "
                             "save_cache()")
    return parse_json(metadata[field], f"cache file {str(source)!r}: metadata {field!r}", CacheFileError, bounded=True)


def _tokens(metadata: dict[str, str], source: Path) -> int:
    """Metadata ``tokens``: 1 to 10 ASCII digits (``int()`` would also take ``'٨٠'``, ``' 80 '`` or ``'8_0'``).

    Raises:
        CacheFileError: naming the value.
    """
    text = metadata.get("tokens")
    if not (isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 10):
        raise CacheFileError(f"cache file {str(source)!r}: metadata tokens={short(text)}; allowed: a count of tokens "
                             "in ASCII digits (at most 10)")
    return int(text)


def _check_capacity(saved, capacity: int | None, max_tokens: int | None, source: Path) -> None:
    """Refuse a capacity or ``max_tokens`` the file's config cannot give (as `make_cache` takes them): a
    fractional budget below 1 needs the length the cache was made for (``max_tokens``) and keeps
    ``max(ceil(budget x length), floor)`` tokens, at most ``length``, or everything (``null``) under the floor; a
    budget in tokens keeps that many, at most ``max_tokens``; budget 1.0 and ``policy="full"`` keep everything.

    Raises:
        CacheFileError: naming the value and what the config allows.
    """
    where = f"cache file {str(source)!r}"
    if saved.policy == "full" or (saved.budget_is_fraction and saved.budget >= 1):
        expected = None
    elif saved.budget_is_fraction:
        if max_tokens is None:
            raise CacheFileError(f"{where}: max_tokens=null with the fractional budget {saved.budget}, which needs "
                                 "the length the cache was made for; allowed: an integer >= 1")
        lowest = min(max(1, math.ceil(saved.budget * max_tokens)), max_tokens)
        if capacity is not None and not lowest <= capacity <= max_tokens:
            raise CacheFileError(f"{where}: capacity={capacity} but budget {saved.budget} of max_tokens={max_tokens} "
                                 f"keeps more; allowed: {lowest} to {max_tokens} (with the floor), or null")
        return
    else:
        expected = int(saved.budget) if max_tokens is None else min(int(saved.budget), max_tokens)
    if capacity != expected:
        raise CacheFileError(f"{where}: capacity={capacity} but budget {saved.budget} (policy {saved.policy}) of "
                             f"max_tokens={max_tokens} keeps {expected}; allowed: the capacity the config gives")


def _global_capacities(saved, layer_states: list[dict], capacity: int | None, dims, source: Path) -> list[int] | None:
    """The layers' capacities of a file saved with global layer budgets (sized by the scores: the file says how), or
    ``None`` for any other split (the config gives them). They sum to ``num_layers x capacity``, or less where a
    sliding or chunked layer holds its whole window (its share beyond ``window - 1`` is not held).

    Raises:
        CacheFileError: capacities that global layer budgets of ``capacity`` cannot give.
    """
    if saved.layer_budgets != "global" or capacity is None:
        return None
    capacities = [state["capacity"] for state in layer_states]
    total = sum(capacities)
    capped = any(cap == span.cap(None) for cap, span in zip(capacities, dims.spans) if span.windowed)
    if total > capacity * dims.num_layers or (total < capacity * dims.num_layers and not capped):
        raise CacheFileError(
            f"cache file {str(source)!r}: its layers' capacities sum to {total}, not the {dims.num_layers} x "
            f"{capacity} that global layer budgets of {capacity} hold (less only where a sliding or chunked layer "
            "holds its whole window)"
        )
    return capacities


_LAYER_KEYS = {"seen_tokens": int, "batch": int, "kv_heads": int, "head_dim": int, "dtype": str,
               "residual_dtype": str, "residual": int}


_LAYER_FIELDS = set(_LAYER_KEYS) | {"capacity", "max_tokens"}  # what save_cache writes per layer


_MAX_COUNT = 2**31 - 1


def _is_count(value, minimum: int = 0) -> bool:
    return is_integer(value) and minimum <= value <= _MAX_COUNT


def _check_structure(metadata: dict, dims, source: Path) -> tuple[list[dict], int | None, int | None]:
    """The metadata's layer list, capacity and max_tokens, checked against the model before any tensor is used.

    Raises:
        CacheFileError: missing or mistyped fields, counts out of range, or a geometry that is not the model's.
    """
    where = f"cache file {str(source)!r}"
    layer_states = _metadata_json(metadata, "layers", source)
    capacity = _metadata_json(metadata, "capacity", source)
    tokens = _tokens(metadata, source)
    if not isinstance(layer_states, list) or not all(isinstance(state, dict) for state in layer_states):
        raise CacheFileError(f"{where}: metadata 'layers' must be a list of objects")
    for i, state in enumerate(layer_states):
        unknown = sorted(set(state) - _LAYER_FIELDS)
        if unknown:
            raise CacheFileError(f"{where}: layer {i} has field(s) {short(', '.join(unknown))}; allowed: "
                                 f"{', '.join(sorted(_LAYER_FIELDS))}")
    if len(layer_states) != dims.num_layers:
        raise CacheStateError(f"cache file has {len(layer_states)} layers, the model {dims.num_layers}")
    if capacity is not None and not _is_count(capacity, 1):
        raise CacheFileError(f"{where}: capacity={short(capacity)}; allowed: null or an integer >= 1")
    first = layer_states[0]
    for i, state in enumerate(layer_states):
        for key, kind in _LAYER_KEYS.items():
            if not (is_integer(state.get(key)) if kind is int else isinstance(state.get(key), kind)):
                raise CacheFileError(f"{where}: layer {i} field {key!r} is {short(state.get(key))}; allowed: {kind.__name__}")
        max_tokens = state.get("max_tokens")
        if max_tokens is not None and not _is_count(max_tokens, 1):
            raise CacheFileError(f"{where}: layer {i} max_tokens={short(max_tokens)}; allowed: null or an integer >= 1")
        layer_capacity = state.get("capacity")  # a sliding layer of an unbounded cache holds its window at most
        if (layer_capacity is not None and not _is_count(layer_capacity, 1)) or (
            layer_capacity is None and capacity is not None
        ) or max_tokens != first.get("max_tokens"):
            raise CacheFileError(f"{where}: layer {i} capacity/max_tokens differ from the cache's")
        if not _is_count(state["seen_tokens"]) or state["seen_tokens"] != tokens:
            raise CacheFileError(f"{where}: layer {i} has seen {short(state['seen_tokens'])} tokens, the file {tokens}")
        if not 1 <= state["batch"] <= 2**20:
            raise CacheFileError(f"{where}: layer {i} batch={state['batch']}; allowed: 1 to {2**20}")
        if (state["kv_heads"], state["head_dim"]) != (dims.kv_heads, dims.head_dim) or state["batch"] != first["batch"]:
            raise CacheStateError(
                f"{where}: layer {i} holds kv_heads={state['kv_heads']}, head_dim={state['head_dim']}; the model "
                f"has kv_heads={dims.kv_heads}, head_dim={dims.head_dim}"
            )
        if max_tokens is not None and tokens > max_tokens:
            raise CacheFileError(f"{where}: {tokens} tokens seen by a cache built for {max_tokens}")
    return layer_states, capacity, first.get("max_tokens")


def _check_prompt(tensors: dict, state: dict, model, source: Path) -> None:
    """``prompt.token_ids`` int64 ``[batch, tokens]`` within the vocabulary, ``prompt.next_logits`` finite
    ``[batch, vocab]``, each present only with the other's shape rules.

    Raises:
        CacheFileError: naming the tensor and what is allowed.
    """
    where = f"cache file {str(source)!r}"
    ids, logits = tensors.get("prompt.token_ids"), tensors.get("prompt.next_logits")
    vocab = getattr(model.config, "vocab_size", None) or model.get_output_embeddings().weight.shape[0]
    if ids is not None:
        if ids.dtype != torch.int64 or tuple(ids.shape) != (state["batch"], state["seen_tokens"]):
            raise CacheFileError(
                f"{where}: prompt.token_ids is {tuple(ids.shape)} {ids.dtype}; allowed: int64 "
                f"[{state['batch']}, {state['seen_tokens']}]"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise CacheFileError(f"{where}: prompt.token_ids outside the vocabulary [0, {vocab})")
    if logits is not None:
        if ids is None or not logits.is_floating_point() or tuple(logits.shape) != (state["batch"], vocab):
            raise CacheFileError(
                f"{where}: prompt.next_logits is {tuple(logits.shape)} {logits.dtype}; allowed: float "
                f"[{state['batch']}, {vocab}] beside prompt.token_ids"
            )
        if not bool(torch.isfinite(logits).all()):
            raise CacheFileError(f"{where}: prompt.next_logits holds NaN or Inf")


def _check_sizes(layer, i: int, state: dict, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Refuse, before anything is allocated, a layer whose metadata (capacity, max_tokens, batch, residual) implies
    buffers of other shapes than the tensors the file holds: a layer of known size is sized on the ``meta`` device
    (no memory) and its buffers compared with the file's, so a crafted capacity of 50M tokens beside a few saved
    slots costs nothing instead of gigabytes. (An unbounded layer of unknown length starts small and grows to the
    saved store, which is already in memory.)

    Raises:
        CacheFileError: naming the layer, the tensor and both shapes.
    """
    if layer.setting.growable:
        return
    probe = CompressedLayer(layer.layer_idx, **layer.setting.arguments())
    shape = (state["batch"], state["kv_heads"], 0, state["head_dim"])
    empty = torch.empty(shape, dtype=_dtype(state["dtype"]), device="meta")
    probe.lazy_initialization(empty, empty)
    expected = _saved_tensors(probe)
    prefix = f"layers.{i}."
    saved = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
    if set(saved) != set(expected):
        raise CacheFileError(f"cache file {str(source)!r}: layer {i} holds tensors {sorted(saved)}, its metadata "
                             f"implies {sorted(expected)}")
    for name, tensor in saved.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CacheFileError(
                f"cache file {str(source)!r}: layer {i} tensor {name} is {tuple(tensor.shape)} but its metadata "
                f"(capacity {short(state.get('capacity'))}, max_tokens {short(state.get('max_tokens'))}, batch "
                f"{state['batch']}) implies {tuple(expected[name].shape)}; allowed: the sizes of the saved tensors"
            )


def _restore_layer(layer, i: int, state: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    if layer.setting.residual != state["residual"] or layer.setting.capacity != state["capacity"]:
        raise CacheFileError(f"layer {i}: saved residual/capacity do not match its config (saved by another version?)")
    # The layer's own lazy initialisation allocates the buffers, as on a first update; the file must fill them all.
    shape = (state["batch"], state["kv_heads"], 0, state["head_dim"])
    empty = torch.empty(shape, dtype=_dtype(state["dtype"]), device=device)
    layer.lazy_initialization(empty, empty)
    if str(layer.geometry.residual_dtype) != state["residual_dtype"]:
        raise CacheFileError(f"layer {i}: saved residual dtype {state['residual_dtype']} is not "
                             f"{layer.geometry.residual_dtype}")
    prefix = f"layers.{i}."
    saved = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
    if layer.setting.growable:  # an unbounded store grew as it went: as large as the saved one (already in memory)
        positions = saved.get("store.positions")
        if positions is not None and positions.dim() == 3 and positions.shape[2] > layer.store.slots:
            layer.store.resize(positions.shape[2])
        layer.counters.grown_to = state["seen_tokens"]
    expected = _saved_tensors(layer)
    if set(saved) != set(expected):
        raise CacheFileError(f"layer {i}: the file holds tensors {sorted(saved)}, the config implies {sorted(expected)}")
    for name, tensor in saved.items():
        if tensor.shape != expected[name].shape or tensor.dtype != expected[name].dtype:
            raise CacheFileError(
                f"layer {i}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, the config implies "
                f"{tuple(expected[name].shape)} {expected[name].dtype}"
            )
    _check_layer_values(saved, i, state["seen_tokens"], layer)
    held = layer.tensors()  # the layer's own buffers, filled in place
    for name, tensor in saved.items():
        held[name].copy_(tensor.to(device))
    _check_dequantized(layer, i)
    layer.store.refresh_norms()


def _check_dequantized(layer, i: int) -> None:
    """Every held token of the store dequantizes to finite keys and values in the layer's dtype: a finite scale or
    zero point can still overflow it (an fp16 scale of 65504 on a 4-bit code), which no live cache holds (its
    scales come from finite keys).

    Raises:
        CacheFileError: naming the layer and the part.
    """
    store = layer.store
    keys, values = store.held(layer.geometry.dtype, store.positions.shape[1])
    held = store.positions >= 0
    for name, tensor in (("keys", keys), ("values", values)):
        if not bool(torch.isfinite(tensor[held]).all()):
            raise CacheFileError(
                f"layer {i}: its stored {name} dequantize to NaN or Inf in {str(layer.geometry.dtype).removeprefix('torch.')} "
                "(a scale or zero point beyond that dtype); allowed: scales of a cache save_cache wrote"
            )


def _check_layer_values(saved: dict[str, torch.Tensor], i: int, seen: int, layer) -> None:
    """Every invariant a layer's buffers can be checked for: positions within what was seen (each at most once
    per sequence and head; the ring holding exactly the newest positions in their slots), at most ``capacity``
    held, scores finite and >= 0, ``first_real`` a held position or none, both flags set, ``seen`` as saved.

    Raises:
        CacheFileError: naming the layer and the broken invariant.
    """
    def fail(what: str):
        raise CacheFileError(f"layer {i}: {what}")

    if int(saved["seen"]) != seen:
        fail(f"seen={int(saved['seen'])} but the metadata says {seen}")
    if not (bool(saved["finite"]) and bool(saved["consistent"])):
        fail("the cache was saved poisoned (non-finite keys/values or a half-way failure)")
    store = saved["store.positions"].long()
    if int(store.min()) < -1 or int(store.max()) >= max(seen, 1):
        fail(f"store positions outside [-1, {seen})")
    limit = layer.setting.capacity
    if "store.owner" in saved:  # a head-adaptive slot pool: per-head positions, kv_heads x capacity per sequence
        owner, heads = saved["store.owner"].long(), layer.geometry.kv_heads
        if bool(((owner < 0) | (owner >= heads))[store >= 0].any()):
            fail(f"store.owner outside [0, {heads})")
        store = torch.where(owner == torch.arange(heads).view(1, -1, 1), store, -1)
    held = store
    if "ring.positions" in saved:
        ring = saved["ring.positions"].long()
        size = ring.shape[1]
        expected = torch.arange(seen - size, seen)
        expected = expected[torch.remainder(expected, size).argsort()]  # slot r holds the position = r (mod size)
        if not bool(((ring == expected) | (ring == -1)).all()):
            fail("ring positions are not the newest positions in their slots")
        held = torch.cat((store, ring.unsqueeze(1).expand(-1, store.shape[1], -1)), dim=2)
    valid = held.masked_fill(held < 0, -1).sort(-1).values
    if bool(((valid[..., 1:] == valid[..., :-1]) & (valid[..., 1:] >= 0)).any()):
        fail("a position is held twice")
    if "store.owner" in saved and limit is not None:
        if int((held >= 0).sum((1, 2)).max()) > layer.geometry.kv_heads * limit:
            fail(f"holds more than kv_heads x the capacity {limit}")
    elif limit is not None and int((held >= 0).sum(-1).max()) > limit:
        fail(f"holds more than the capacity {limit}")
    for name, tensor in saved.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            fail(f"{name} holds NaN or Inf")
    for name in ("store.scores", "ring.scores"):
        if name in saved and not bool((torch.isfinite(saved[name]) & (saved[name] >= 0)).all()):
            fail(f"{name} must be finite and >= 0")
    first = saved["first_real"]
    if not bool(((first >= 0) & (first <= seen) | (first == NO_POSITION)).all()):
        fail(f"first_real outside [0, {seen}]")
    if "refine.slots" in saved:  # mixed precision: each 8-bit row names one store slot, or -1 (free)
        rows = saved["refine.slots"].long()
        if int(rows.min()) < -1 or int(rows.max()) >= store.shape[2]:
            fail(f"refine.slots outside [-1, {store.shape[2]})")
        taken = rows.masked_fill(rows < 0, -1).sort(-1).values
        if bool(((taken[..., 1:] == taken[..., :-1]) & (taken[..., 1:] >= 0)).any()):
            fail("two 8-bit rows name the same slot")

