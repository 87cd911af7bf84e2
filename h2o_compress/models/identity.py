"""Model identity (a leaf module): which model a cache belongs to, as a short name and as a fingerprint."""

from __future__ import annotations

import hashlib
import json

import torch

from h2o_compress.utils.errors import CacheStateError, short
from h2o_compress.models.dims import model_dims

# Config entries that name a checkpoint or a runtime switch, not the model: left out of the fingerprint.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "attn_implementation",
}


def model_fingerprint(model) -> str:
    """A 32-hex-digit SHA-256 of ``model``'s config, parameter names, shapes and dtypes, and a sample of values.

    Cheap (a few elements per parameter are read), stable across devices and processes, and different for two
    models that differ in architecture, dtype or weights (the first and last 4 values of every parameter).
    Checkpoint names, the transformers version and the attention implementation are left out; parameters
    offloaded by accelerate (on the ``meta`` device here) are read from the offload (disk or CPU) through their
    module's hook, so a model split by ``device_map`` has the fingerprint of the same model in one piece.
    Raises CacheStateError when ``model`` is not a transformers model (e.g. ``None``).
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "to_dict"):
        raise CacheStateError(
            f"model={short(model)} is not a transformers model; allowed: the model the cache belongs to"
        )
    digest = hashlib.sha256()
    config = model.config.to_dict()
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            if param.device.type == "meta":  # offloaded by accelerate: the value is in its hook's weights map
                param = _offloaded_value(model, name)
                if param is None:  # nowhere to read it from: name, shape and dtype only
                    continue
            flat = param.detach().reshape(-1)
            sample = torch.cat((flat[:4], flat[-4:])).to("cpu", copy=True).contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


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
