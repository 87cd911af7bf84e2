"""Which kernel runs a layer's decode attention (one rule, decided once per layer at its first token)."""

from __future__ import annotations

import torch

from h2o_compress.utils.errors import ConfigError
from h2o_compress.attention import cpu


def decode_kernel(attention_kernel: str, device: torch.device, dtype: torch.dtype, storage_dtype: torch.dtype,
                  head_dim: int, formats, layer_idx: int = 0) -> str:
    """The decode kernel of a layer on ``device`` with model ``dtype``, window / 16-bit storage ``storage_dtype``,
    ``head_dim`` and key/value quantizers ``formats``, for the ``attention_kernel`` the user asked for (``auto``,
    ``torch`` or ``triton``; [`CompressionConfig`][h2o_compress.CompressionConfig]):

    - ``"cpu"``: the whole step in one native call (`h2o_compress.attention.cpu`), for ``auto`` on a CPU where the kernel builds;
    - ``"triton"``: the op of `h2o_compress.attention.slot_attention`, for ``auto`` on CUDA where Triton imports and reads the
      formats, and always for ``triton`` (or an error);
    - ``"torch"``: torch code that ``torch.compile`` fuses, otherwise (and on ``meta``, sizing a cache).

    Raises:
        ConfigError: ``attention_kernel='triton'`` for a layer the op cannot run, naming why.
    """
    if attention_kernel == "auto" and cpu.supported(device, dtype, storage_dtype, head_dim, formats):
        return "cpu"
    if device.type == "meta" or attention_kernel == "torch":
        return "torch"
    if attention_kernel == "auto" and device.type != "cuda":
        return "torch"
    reason = _triton_reason(device, head_dim, formats)
    if reason is None:
        return "triton"
    if attention_kernel == "triton":
        raise ConfigError(f"attention_kernel='triton' cannot run layer {layer_idx}: {reason}; allowed: "
                          "attention_kernel='auto' or 'torch'")
    return "torch"


def check_kernel(attention_kernel: str, device: torch.device | str, head_dim: int | None = None, formats=()) -> None:
    """Refuse ``attention_kernel='triton'`` where the Triton op cannot run: on ``device`` at all (not CUDA, without
    ``TRITON_INTERPRET=1``; or Triton does not import), or, when given, with ``head_dim`` and the key/value
    quantizers ``formats``. Called before a model is loaded (the device alone) and when a cache is made, so the
    error comes before the work, not at the first token.

    Raises:
        ConfigError: naming the device (or what it cannot read) and what is allowed.
    """
    device = torch.device(device)
    if attention_kernel != "triton" or device.type == "meta":
        return
    reason = _triton_reason(device, head_dim, formats)
    if reason is not None:
        raise ConfigError(f"attention_kernel='triton' cannot run: {reason}; allowed: attention_kernel='auto' or "
                          "'torch'" + ("" if device.type == "cuda" else ", or a CUDA device"))


def _triton_reason(device: torch.device, head_dim: int | None = None, formats=()) -> str | None:
    """Why the Triton op cannot run on ``device`` (with ``head_dim`` and ``formats`` when given), or ``None``."""
    try:
        from h2o_compress.attention import slot_attention  # deferred: needs triton, an optional dependency
    except ImportError as exc:
        return f"Triton does not import ({exc})"
    if head_dim is None:
        return slot_attention.device_reason(device)
    return slot_attention.supported(device, head_dim, formats)
