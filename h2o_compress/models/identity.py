"""Model identity (a leaf module): which model a cache belongs to, as a short name and as a fingerprint."""

from __future__ import annotations

import hashlib
import json
import weakref

import torch

from h2o_compress.utils.errors import CacheStateError, short
from h2o_compress.models.dims import model_dims
from h2o_compress.models.int4_linear import Int4Linear
from h2o_compress.models.int8_linear import Int8Linear

# Config entries that name a checkpoint or a runtime switch, not the model: left out of the fingerprint.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "attn_implementation",
}


#: Values of each parameter a fingerprint reads besides its first and last 4: evenly spaced over all of it.
SPREAD_SAMPLES = 256


def _ends(flat: torch.Tensor) -> torch.Tensor:
    return torch.cat((flat[:4], flat[-4:]))


def _spread(flat: torch.Tensor) -> torch.Tensor:
    step = max(1, -(-flat.numel() // SPREAD_SAMPLES))
    return torch.cat((flat[:4], flat[::step], flat[-4:]))


def model_fingerprint(model) -> str:
    """A 32-hex-digit SHA-256 of ``model``'s config, parameter names, shapes and dtypes, and a sample of values
    (packed int8 weights and their scales count as parameters: `_weights`).

    Cheap (about 264 elements per parameter are read: the first and last 4 and `SPREAD_SAMPLES` evenly spaced over
    the whole of it), stable across devices and processes, and different for two models that differ in
    architecture, dtype or weights (two trainings or fine-tunes of one architecture differ nearly everywhere, so at
    the sampled values; the first and last 4 alone, as earlier versions read, missed weights that differ elsewhere).
    Checkpoint names, the transformers version and the attention implementation are left out; parameters
    offloaded by accelerate (on the ``meta`` device here) are read from the offload (disk or CPU) through their
    module's hook, so a model split by ``device_map`` has the fingerprint of the same model in one piece.
    Raises CacheStateError when ``model`` is not a transformers model (e.g. ``None``).
    """
    return _fingerprint(model, _spread)


def legacy_fingerprint(model) -> str:
    """The fingerprint cache files saved by earlier versions hold (the first and last 4 values of each parameter only):
    `load_cache` still takes such a file for a model it matches. A file saved now holds
    `model_fingerprint`, which equals this one only by chance (2**-128)."""
    return _fingerprint(model, _ends)


def _fingerprint(model, sample) -> str:
    """SHA-256 (32 hex digits) of the config, parameter names, shapes and dtypes, and ``sample(flat parameter)``."""
    if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "to_dict"):
        raise CacheStateError(
            f"model={short(model)} is not a transformers model; allowed: the model the cache belongs to"
        )
    digest = hashlib.sha256()
    config = model.config.to_dict()
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in _weights(model):
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            if param.device.type == "meta":  # offloaded by accelerate: the value is in its hook's weights map
                param = _offloaded_value(model, name)
                if param is None:  # nowhere to read it from: name, shape and dtype only
                    continue
            values = sample(param.detach().reshape(-1)).to("cpu", copy=True).contiguous()
            digest.update(values.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def _weights(model):
    """``(name, tensor)`` of what a fingerprint reads: every parameter, then the packed int8 weights and scales of
    each [`Int8Linear`][h2o_compress.models.int8_linear.Int8Linear] and the packed codes, scales and zeros of each
    [`Int4Linear`][h2o_compress.models.int4_linear.Int4Linear] (buffers, not parameters: without them two
    int8 models differing only in their Linear layers would share a fingerprint). A model without packed layers
    reads its parameters only, as before."""
    yield from model.named_parameters()
    for path, module in model.named_modules():
        if isinstance(module, Int8Linear):
            yield f"{path}.weight_int8", module.weight_int8
            yield f"{path}.scales", module.scales
        if isinstance(module, Int4Linear):
            yield f"{path}.weight_int4", module.weight_int4
            yield f"{path}.scales_and_zeros", module.scales_and_zeros


def record_model(cache, model, fingerprint: str | None = None) -> None:
    """Record on ``cache`` the model it belongs to: ``cache.model_fingerprint`` (``fingerprint``, or computed) and
    ``cache.model_ref``, a weak reference that `filled_elsewhere` checks the cache's layers against."""
    cache.model_fingerprint = model_fingerprint(model) if fingerprint is None else fingerprint
    cache.model_ref = weakref.ref(model)


def filled_elsewhere(cache, model=None) -> int | None:
    """The first layer of ``cache`` whose keys came from an attention module that is not ``model``'s (default: the
    model recorded by `record_model`), or ``None``: a cache made for one model and filled by another of the same
    shapes holds the other's keys under the first one's fingerprint. ``None`` too when no model is known."""
    if model is None:
        model = getattr(cache, "model_ref", lambda: None)()
    if model is None:
        return None
    modules = {id(module) for module in model.modules()}
    for layer in cache.layers:
        ref = getattr(getattr(layer, "link", None), "module", None)
        if ref is not None and (ref() is None or id(ref()) not in modules):  # a dead module is no module of model
            return layer.layer_idx
    return None


def _offloaded_value(model, name: str):
    """The value of parameter ``name`` that accelerate offloaded (its module hook's ``weights_map``), or None."""
    path, _, local = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    hook = getattr(module, "_hf_hook", None)
    for one in getattr(hook, "hooks", [hook]):
        weights = getattr(one, "weights_map", None)
        if weights is not None and local in weights:
            return weights[local]
    return None


def model_identity(model) -> str:
    """A short string naming the model's architecture and KV geometry (guards against cache reuse)."""
    dims = model_dims(model.config)
    return f"{model.config.model_type}:{dims.num_layers}x{dims.kv_heads}x{dims.head_dim}"
