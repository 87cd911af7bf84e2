"""Persisted compressed caches: one :class:`~h2o_compress.cache.CompressedCache` in one safetensors file.

File format (``format_version`` 3: the slot layout of :mod:`h2o_compress.cache`; older files are refused):

- tensors, per layer ``i``: ``layers.{i}.{name}`` for every buffer of
  :meth:`~h2o_compress.cache.CompressedLayer.tensors` (the slot store: stored keys/values parts, positions,
  scores; the ring window: keys, values, positions, scores; ``seen``, ``first_real``, ``finite``); optionally ``prompt.token_ids`` (int64 ``[batch, tokens]``) and
  ``prompt.next_logits`` (``[batch, vocab]``), the prompt the cache holds and the logits of its next token,
  so a loaded cache continues exactly like the live one.
- metadata (strings): ``format``, ``format_version``, ``library_version``, ``model_fingerprint`` (see
  :func:`model_fingerprint`), ``model_id``, ``config`` (JSON of :class:`CompressionConfig`), ``capacity``,
  ``tokens`` (tokens seen), ``layers`` (JSON list of per-layer state) and ``checksum``: SHA-256 over every
  other metadata field and every tensor's name, dtype, shape and bytes, so a truncated or edited file is
  refused.

Writes are atomic: the file is written to a temporary name in the target directory, flushed to disk and
renamed over the target, so an interrupted save leaves either the old file or the new one, never half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CacheFileError, CacheStateError, ConfigError
from .identity import model_fingerprint, model_identity

FORMAT = "h2o-compress-kv-cache"
FORMAT_VERSION = "3"
# Layer tensors rebuilt from the config on load, or only alive inside one forward step: never saved.
DERIVED_LAYER_TENSORS = ("key_basis", "value_basis")
# Config fields that change how attention runs, not what the cache holds: a file loads under any value.
RUNTIME_CONFIG_FIELDS = {"attention_kernel"}


@dataclass
class PromptState:
    """The prompt a cache holds: ``token_ids`` int64 ``[batch, tokens]`` (CPU) and ``next_logits``
    ``[batch, vocab]`` (the model's logits for the token after the prompt; ``None`` when unknown)."""

    token_ids: torch.Tensor
    next_logits: torch.Tensor | None = None


def _checksum(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    body = {k: v for k, v in metadata.items() if k != "checksum"}
    digest.update(json.dumps(body, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _as_path(path) -> Path:
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise CacheFileError(f"cache path {path!r} is invalid; allowed: a file path (str or os.PathLike)")
    return Path(path)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CacheFileError(f"unknown dtype {name!r} in cache file")
    return dtype


def _check_saveable(cache) -> int:
    """Tokens seen by every layer; raises CacheStateError for an empty, mid-step or inconsistent cache."""
    from .cache import CompressedCache

    if not isinstance(cache, CompressedCache):
        raise CacheStateError(f"cannot save {type(cache).__name__}; allowed: a CompressedCache (make_cache)")
    if not all(layer.is_initialized for layer in cache.layers):
        raise CacheStateError("cannot save an empty cache: run the prompt through the model first")
    cache.check()
    if any(layer.awaiting_attention for layer in cache.layers):
        raise CacheStateError("cannot save a cache in the middle of a forward pass (attention has not run yet)")
    seen = {int(layer.seen) for layer in cache.layers}
    if len(seen) != 1:
        raise CacheStateError(f"cannot save: layers have seen different token counts {sorted(seen)} (a failed step?)")
    return seen.pop()


def _cache_contents(cache, tokens: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(cache.layers):
        tensors |= {f"layers.{i}.{name}": t.contiguous() for name, t in layer.tensors().items()}
        layers.append(
            {
                "seen_tokens": int(layer.seen), "batch": layer.batch, "kv_heads": layer.kv_heads,
                "head_dim": layer.head_dim, "dtype": str(layer.dtype), "residual_dtype": str(layer.residual_dtype),
                "capacity": layer.capacity, "residual": layer.residual, "max_tokens": layer.max_tokens,
            }
        )
    state = getattr(cache, "prompt_state", None)
    if isinstance(state, PromptState) and state.token_ids.shape == (layers[0]["batch"], tokens):
        tensors["prompt.token_ids"] = state.token_ids.to(torch.int64)
        if state.next_logits is not None:
            tensors["prompt.next_logits"] = state.next_logits
    return tensors, layers


def save_cache(cache, path, model=None) -> Path:
    """Write ``cache`` to ``path`` (safetensors, atomically: temp file + fsync + rename).

    Args:
        cache: a :class:`CompressedCache` that has seen at least one token (all layers at the same count).
        path: target file; its directory must exist. An existing file is replaced only once the new one is
            complete.
        model: the model the cache belongs to; its :func:`model_fingerprint` is stored. ``None`` uses the
            fingerprint recorded on the cache by :func:`load_cache`/:func:`h2o_compress.prompt_cache.prefill`
            (``cache.model_fingerprint``).

    Returns:
        The path written.

    Raises:
        CacheStateError: not a CompressedCache, empty, mid-step or inconsistent cache, no model fingerprint, or
            ``model`` differs from the one recorded on the cache.
        CacheFileError: bad path or missing directory.
    """
    from safetensors.torch import save_file

    from . import __version__

    target = _as_path(path)
    tokens = _check_saveable(cache)
    recorded = getattr(cache, "model_fingerprint", None)
    fingerprint = model_fingerprint(model) if model is not None else recorded
    if fingerprint is None:
        raise CacheStateError("cannot save: pass model= so the file records which model the cache belongs to")
    if recorded is not None and fingerprint != recorded:
        raise CacheStateError("cannot save: model= is not the model this cache was filled with")
    if not target.parent.is_dir():
        raise CacheFileError(
            f"directory {str(target.parent)!r} does not exist; allowed: a path in an existing directory"
        )
    tensors, layers = _cache_contents(cache, tokens)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "library_version": __version__,
        "model_fingerprint": fingerprint, "model_id": str(cache.model_id),
        "config": json.dumps(cache.config.to_dict(), sort_keys=True), "capacity": json.dumps(cache.capacity),
        "tokens": str(tokens), "layers": json.dumps(layers),
    }
    metadata["checksum"] = _checksum(metadata, tensors)
    _atomic_write(lambda tmp: save_file(tensors, tmp, metadata=metadata), target)
    return target


def _atomic_write(write, target: Path) -> None:
    """Run ``write(temp_path)`` then rename the temp file over ``target``; on any failure remove the temp file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where the platform allows it
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_cache_file(path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Read and verify a saved cache: ``(metadata, tensors on CPU)``.

    Raises:
        CacheFileError: missing file, not a safetensors file, truncated, unknown format or version, or a
            checksum that does not match (the file was modified).
    """
    from safetensors import SafetensorError, safe_open

    source = _as_path(path)
    if not source.is_file():
        raise CacheFileError(f"cache file {str(source)!r} does not exist; allowed: a file written by cache.save()")
    try:
        with safe_open(str(source), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CacheFileError(f"cache file {str(source)!r} is truncated or not a safetensors file ({reason})") from None
    if metadata.get("format") != FORMAT:
        raise CacheFileError(f"{str(source)!r} is not an h2o-compress cache file (format={metadata.get('format')!r})")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(
            f"cache file {str(source)!r} has format version {metadata.get('format_version')!r}; "
            f"allowed: {FORMAT_VERSION} (save it again with this version)"
        )
    if metadata.get("checksum") != _checksum(metadata, tensors):
        raise CacheFileError(f"cache file {str(source)!r} fails its checksum: it was truncated or modified")
    return metadata, tensors


def _saved_config(metadata: dict[str, str], source: Path):
    from .config import CompressionConfig

    try:
        return CompressionConfig(**json.loads(metadata["config"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFileError(f"cache file {str(source)!r} holds an unusable config ({exc})") from None


def _check_config(saved, expected, source: Path) -> None:
    """Refuse ``expected`` (a CompressionConfig, or a dict of fields) where it differs from ``saved``."""
    from .config import CompressionConfig

    if expected is None:
        return
    if isinstance(expected, CompressionConfig):
        expected = expected.to_dict()
    if not isinstance(expected, dict):
        raise ConfigError(f"config={expected!r} is invalid; allowed: None, a CompressionConfig or a dict of fields")
    saved_values = saved.to_dict()
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


def load_cache(path, model, config=None):
    """Load a cache saved by :func:`save_cache` for ``model``, on the model's device.

    Args:
        path: the file.
        model: the model to use the cache with; must be the model that saved it (same
            :func:`model_fingerprint`). It is switched to the ``h2o_compress`` attention function.
        config: ``None`` (use the saved config), a :class:`CompressionConfig` that must equal the saved one,
            or a dict of config fields that must match it.

    Returns:
        A :class:`CompressedCache` in the saved state (tokens, scores, capacity), with ``prompt_state`` set
        when the file holds the prompt's token ids.

    Raises:
        CacheFileError: missing, truncated, tampered or unknown-version file.
        CacheStateError: a different model, or a config that differs from the saved one.
        UnsupportedModelError: the model's attention cannot be scored.
    """
    from .attention import use_h2o_attention
    from .cache import CompressedCache, build_layers
    from .models import model_dims

    source = _as_path(path)
    metadata, tensors = read_cache_file(source)
    fingerprint = model_fingerprint(model)
    if metadata.get("model_fingerprint") != fingerprint:
        raise CacheStateError(
            f"cache file {str(source)!r} was saved for model {metadata.get('model_id')!r} (fingerprint "
            f"{metadata.get('model_fingerprint', '')[:12]}), not this one ({model_identity(model)}, fingerprint "
            f"{fingerprint[:12]}); allowed: the model that saved it"
        )
    saved = _saved_config(metadata, source)
    _check_config(saved, config, source)
    try:
        layer_states = json.loads(metadata["layers"])
        capacity = json.loads(metadata["capacity"])
    except (KeyError, ValueError) as exc:
        raise CacheFileError(f"cache file {str(source)!r} has unreadable metadata ({exc})") from None
    use_h2o_attention(model)
    dims = model_dims(model.config)
    if len(layer_states) != dims.num_layers:
        raise CacheStateError(f"cache file has {len(layer_states)} layers, the model {dims.num_layers}")
    device = next(model.parameters()).device
    max_tokens = layer_states[0].get("max_tokens") if layer_states and isinstance(layer_states[0], dict) else None
    layers = build_layers(saved, dims.num_layers, dims.head_dim, capacity, max_tokens=max_tokens)
    for i, (layer, state) in enumerate(zip(layers, layer_states)):
        _restore_layer(layer, i, state, tensors, device)
    cache = CompressedCache(layers, saved, model_id=model_identity(model))
    cache.model_fingerprint = fingerprint
    if "prompt.token_ids" in tensors:
        logits = tensors.get("prompt.next_logits")
        cache.prompt_state = PromptState(tensors["prompt.token_ids"], None if logits is None else logits.to(device))
    return cache


def _restore_layer(layer, i: int, state: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    if layer.residual != state["residual"] or layer.capacity != state["capacity"]:
        raise CacheFileError(f"layer {i}: saved residual/capacity do not match its config (saved by another version?)")
    # The layer's own lazy initialisation allocates the buffers, as on a first update; the file must fill them all.
    shape = (state["batch"], state["kv_heads"], 0, state["head_dim"])
    empty = torch.empty(shape, dtype=_dtype(state["dtype"]), device=device)
    layer.lazy_initialization(empty, empty)
    if str(layer.residual_dtype) != state["residual_dtype"]:
        raise CacheFileError(f"layer {i}: saved residual dtype {state['residual_dtype']} is not {layer.residual_dtype}")
    prefix = f"layers.{i}."
    saved = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
    expected = layer.tensors()
    if set(saved) != set(expected):
        raise CacheFileError(f"layer {i}: the file holds tensors {sorted(saved)}, the config implies {sorted(expected)}")
    for name, tensor in saved.items():
        if tensor.shape != expected[name].shape or tensor.dtype != expected[name].dtype:
            raise CacheFileError(
                f"layer {i}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, the config implies "
                f"{tuple(expected[name].shape)} {expected[name].dtype}"
            )
    layer.load_tensors({name: t.to(device) for name, t in saved.items()})
    if int(layer.seen) != state["seen_tokens"]:
        raise CacheFileError(f"layer {i}: seen={int(layer.seen)} but the metadata says {state['seen_tokens']}")
