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

import torch

from h2o_compress.formats.calibrated import key_shape as _key_shape, rope_frequencies
from h2o_compress.persistence.calibration_file import calibrate_key_layers, use_key_offsets  # noqa: F401 (here too)
from h2o_compress.utils.errors import UnsupportedModelError

#: The tensors `key_channel_statistics` returns (names and shapes are the calibration file's format).
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
        UnsupportedModelError: the model's attention has no ``k_proj`` (see `attention_modules`).
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


def key_statistics_of(model, pieces: list[torch.Tensor]) -> tuple[torch.Tensor | None, str]:
    """The mean pre-RoPE key over calibration segments, for the calibration file, or why there is none.

    Each segment is read on its own (`key_channel_statistics`, its first token left out); the mean is that of
    every counted token (the segments' means averaged, each weighed by its tokens).

    Args:
        model: the model being calibrated.
        pieces: ``[1, tokens]`` calibration ids, each at least 3 tokens.

    Returns:
        ``(mean, "")``, ``mean`` fp32 ``[layers, kv_heads, head_dim]`` on the CPU; or ``(None, reason)`` for a
        model whose keys cannot take the offsets (no fixed rotary embedding, no ``k_proj`` per layer, or one of
        another width than ``kv_heads x head_dim``: `rope_frequencies`, `attention_modules`), ``reason`` one line.
    """
    try:
        rope_frequencies(model)
        modules = attention_modules(model)
    except UnsupportedModelError as exc:
        return None, str(exc)
    heads, head_dim = _key_shape(model)
    widths = {getattr(m.k_proj, "out_features", heads * head_dim) for m in modules}
    if widths != {heads * head_dim}:
        return None, (f"key calibration needs keys of {heads} KV heads x {head_dim}; {type(model).__name__}'s k_proj "
                      f"gives {sorted(widths)} features")
    total, counted = None, 0
    for piece in pieces:
        mean = key_channel_statistics(model, piece)["key_channel_mean"]
        tokens = piece.shape[-1] - 1
        total = mean * tokens if total is None else total + mean * tokens
        counted += tokens
    return (total / counted).contiguous(), ""


def use_key_calibration(cache, model, statistics: dict[str, torch.Tensor]) -> None:
    """Store ``cache``'s integer keys around the calibrated mean (``key_channel_mean`` of
    `key_channel_statistics`, rotated to each token's position;
    ``h2o_compress.formats.calibrated.CalibratedKeyQuantizer``).

    Call it on a fresh cache (``make_cache``), before its first token. The bytes per token do not change; the
    layers decode in the torch form (the fused kernels do not read the format), and the cache cannot be saved.
    ``CompressionConfig(key_offsets="calibrated")`` does the same from the model's calibration file.

    Args:
        cache: a [`CompressedCache`][h2o_compress.cache.CompressedCache] with 4- or 8-bit ``int`` keys, no tokens yet.
        model: the model the statistics were taken of (its RoPE frequencies are read).
        statistics: ``{"key_channel_mean": fp32 [layers, kv_heads, head_dim], ...}``.

    Raises:
        ConfigError: keys not stored as ``int`` (16 bits, another format, mixed precision), a head-adaptive
            store, a cache that holds tokens, or statistics that do not fit the model.
        UnsupportedModelError: no fixed RoPE (see `rope_frequencies`).
    """
    mean = statistics.get("key_channel_mean") if isinstance(statistics, dict) else None
    calibrate_key_layers(getattr(cache, "layers", []), model, mean)
