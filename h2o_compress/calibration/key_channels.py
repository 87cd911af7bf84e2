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

from h2o_compress.utils.errors import UnsupportedModelError

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
