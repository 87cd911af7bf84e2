"""Per-channel statistics of the pre-RoPE keys, calibrated offline (KVQuant, Hooper et al. 2024, arXiv 2401.18079).

KVQuant §3.1 observes that keys have outlier *channels*: a few dimensions of every key are offset and wide, the
same for every token, and that this structure is clearest before the rotary embedding (RoPE mixes each pair of
channels by an angle that depends on the position, smearing a fixed offset over the pair). It therefore quantizes
keys per channel, pre-RoPE, with ranges fitted offline on calibration text. Here the same statistics are kept as
one vector per layer and KV head: the mean key and the spread of each channel around it. A per-token key format
can subtract the mean (rotated to the token's position, ``RoPE(pos) @ mean``) before quantizing and add it back
after, removing the channel bias that would otherwise widen every token's range.
"""

from __future__ import annotations

import dataclasses

import torch

from h2o_compress.formats.calibrated import CalibratedKeyQuantizer
from h2o_compress.formats.integer import IntQuantizer
from h2o_compress.utils.errors import ConfigError, UnsupportedModelError

#: The tensors :func:`key_channel_statistics` returns (names and shapes are the calibration file's format).
KEY_CHANNEL_TENSORS = ("key_channel_mean", "key_channel_scale")


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention module of each layer, in layer order: every module with a ``k_proj`` linear layer.

    Raises:
        UnsupportedModelError: no module of ``model`` has a ``k_proj`` (keys not computed by a projection the
            hooks can read), or their count is not the model's number of layers.
    """
    found = [m for m in model.modules() if isinstance(getattr(m, "k_proj", None), torch.nn.Module)]
    layers = getattr(model.config, "num_hidden_layers", len(found))
    if not found or len(found) != layers:
        raise UnsupportedModelError(
            f"key calibration needs one attention module with a k_proj per layer; {type(model).__name__} has "
            f"{len(found)} for {layers} layers")
    return found


def _key_shape(model) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` from the model's config."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return heads, head_dim


@torch.inference_mode()
def key_channel_statistics(model, input_ids: torch.Tensor, skip: int = 1) -> dict[str, torch.Tensor]:
    """Pre-RoPE per-channel key statistics of ``model`` over calibration text (KVQuant §3.1: per channel, pre-RoPE).

    Runs the uncompressed model once over ``input_ids`` and reads each layer's keys where they leave ``k_proj``
    (or the layer's ``k_norm``, where the model normalises keys per head as Qwen3 does), before the rotary
    embedding. The first ``skip`` tokens are left out (the first token is an attention sink whose key is unlike
    the others).

    Args:
        model: a causal LM whose attention modules have a ``k_proj``.
        input_ids: ``[1, tokens]`` or ``[tokens]`` calibration ids (the tuning text by default; never the
            reporting corpus), at least ``skip + 2`` tokens.
        skip: leading tokens not counted.

    Returns:
        ``"key_channel_mean"``: fp32 ``[layers, kv_heads, head_dim]``, the mean pre-RoPE key; and
        ``"key_channel_scale"``: fp32 ``[layers, kv_heads, head_dim]``, the standard deviation of each channel
        around that mean (at least 1e-6). Both on the CPU.

    Raises:
        UnsupportedModelError: the model's attention has no ``k_proj`` (see :func:`attention_modules`).
        ValueError: fewer than ``skip + 2`` tokens.
    """
    ids = input_ids.reshape(1, -1)
    if ids.shape[1] < skip + 2:
        raise ValueError(f"key calibration needs at least {skip + 2} tokens, got {ids.shape[1]}")
    modules = attention_modules(model)
    heads, head_dim = _key_shape(model)
    keys: list[torch.Tensor | None] = [None] * len(modules)

    def recorder(index: int):
        def hook(module, inputs, output):
            keys[index] = output.detach().float().reshape(-1, heads, head_dim)[skip:].cpu()
        return hook

    sources = [m.k_norm if isinstance(getattr(m, "k_norm", None), torch.nn.Module) else m.k_proj for m in modules]
    handles = [s.register_forward_hook(recorder(i)) for i, s in enumerate(sources)]
    try:
        model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    stacked = torch.stack(keys)  # [layers, tokens, kv_heads, head_dim]
    mean = stacked.mean(1)
    scale = stacked.std(1).clamp(min=1e-6)
    return {"key_channel_mean": mean.contiguous(), "key_channel_scale": scale.contiguous()}


def rope_frequencies(model) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of the model's rotary embedding: fp32 ``[head_dim / 2]`` radians per
    position, and the factor its ``cos``/``sin`` are multiplied by.

    Raises:
        UnsupportedModelError: no module with a fixed ``inv_freq`` (no RoPE), one whose frequencies change with
            the length (dynamic scaling), or layers with different frequencies (local and global layers).
    """
    rotaries = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    rotary = rotaries[0] if rotaries else None
    if rotary is None or "dynamic" in str(getattr(rotary, "rope_type", "")) or any(
            not torch.equal(r.inv_freq, rotary.inv_freq) for r in rotaries[1:]):
        raise UnsupportedModelError(f"key calibration needs one fixed rotary embedding for every layer; "
                                    f"{type(model).__name__} has {'none' if rotary is None else 'another'}")
    return rotary.inv_freq.detach().float().cpu(), float(getattr(rotary, "attention_scaling", 1.0))


def use_key_calibration(cache, model, statistics: dict[str, torch.Tensor]) -> None:
    """Store ``cache``'s integer keys around the calibrated mean (``key_channel_mean`` of
    :func:`key_channel_statistics`, rotated to each token's position;
    ``h2o_compress.formats.calibrated.CalibratedKeyQuantizer``).

    Call it on a fresh cache (``make_cache``), before its first token. The bytes per token do not change; the
    layers decode in the torch form (the fused kernels do not read the format), and the cache cannot be saved.

    Args:
        cache: a [`CompressedCache`][h2o_compress.cache.CompressedCache] with 4- or 8-bit ``int`` keys, no tokens yet.
        model: the model the statistics were taken of (its RoPE frequencies are read).
        statistics: ``{"key_channel_mean": fp32 [layers, kv_heads, head_dim], ...}``.

    Raises:
        ConfigError: keys not stored as ``int`` (16 bits, another format, mixed precision), a head-adaptive
            store, a cache that holds tokens, or statistics that do not fit the model.
        UnsupportedModelError: no fixed RoPE (see :func:`rope_frequencies`).
    """
    mean = statistics.get("key_channel_mean") if isinstance(statistics, dict) else None
    layers = list(getattr(cache, "layers", []))
    heads, head_dim = _key_shape(model)
    if not isinstance(mean, torch.Tensor) or tuple(mean.shape) != (len(layers), heads, head_dim):
        raise ConfigError(f"key_channel_mean must be a [{len(layers)}, {heads}, {head_dim}] tensor (layers, KV heads, "
                          "head_dim of the model); got "
                          f"{tuple(mean.shape) if isinstance(mean, torch.Tensor) else type(mean).__name__}")
    inv_freq, scaling = rope_frequencies(model)
    settings = []
    for layer, layer_mean in zip(layers, mean):
        quantizer, setting = layer.setting.key_quantizer, layer.setting
        if type(quantizer) is not IntQuantizer or setting.head_adaptive or setting.high_bits_fraction > 0 \
                or layer.is_initialized:
            raise ConfigError(f"layer {layer.layer_idx} cannot take a key calibration; allowed: a fresh cache with "
                              "4- or 8-bit int keys, head_budgets='uniform', high_bits_fraction=0")
        calibrated = CalibratedKeyQuantizer(quantizer.bits, quantizer.group_size, quantizer.head_dim, layer_mean,
                                            inv_freq, quantizer.rotate, scaling)
        settings.append(dataclasses.replace(setting, key_quantizer=calibrated))
    for layer, setting in zip(layers, settings):  # every layer checked first: all or none change
        layer.setting = setting
