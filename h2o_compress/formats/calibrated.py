"""Integer keys quantized around a calibrated per-channel mean, rotated to each token's position.

Keys have a per-channel bias that is the same for every token before the rotary embedding (KVQuant, Hooper et al.
2024, arXiv 2401.18079 §3.1: quantize keys per channel, pre-RoPE, with ranges calibrated offline). A per-token
format pays for it in every token's range. Here the mean pre-RoPE key of each KV head (``key_channel_mean`` of
`h2o_compress.calibration.key_channels.key_channel_statistics`) is rotated to the token's position (``offset =
RoPE(pos) @ mean``, in the cache's Hadamard basis), subtracted before the per-token groups are quantized and added
back when they are read: the same bytes per token (the mean is one vector per head), about half the key range.
Some keys are far from the mean (attention sinks: the first token, and others the model parks attention on), and
subtracting it would widen them; each token takes the offset only where it narrows its widest group, and says so
in the sign of its fp16 scales (always positive otherwise), so the choice costs no byte. On the tuning text
(SmolLM2-135M, ``benchmarks/key_calibration.py --phase choose``, ``benchmarks/results/key_calibration_choose.md``)
the offset on every token but the first did not lower the 4-bit loss; the per-token choice did.

The offset of a position is ``[cos(pos * f), sin(pos * f)] @ M`` (``f`` the RoPE frequencies, ``M`` fp32
``[kv_heads, head_dim, head_dim]`` built once from the mean and the basis), so reading a store of fixed slots is a
fixed-shape batched product, no allocation that depends on the step. The fused kernels (native CPU, Triton) do not
read this format; a layer that stores it decodes in the torch form.
"""

from __future__ import annotations

import torch

from h2o_compress.formats.base import StoredTensor
from h2o_compress.formats.integer import IntQuantizer
from h2o_compress.utils.errors import ConfigError, UnsupportedModelError


def offset_basis(mean: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``[kv_heads, head_dim, head_dim]``: ``M`` with ``RoPE(pos) @ mean @ basis = [cos, sin] @ M[h]`` for the
    half-split (``rotate_half``) RoPE convention, ``cos``/``sin`` ``[head_dim / 2]`` of the position's angles.

    Args:
        mean: fp32 ``[kv_heads, head_dim]``, the mean pre-RoPE key per KV head.
        basis: the orthonormal ``[head_dim, head_dim]`` basis keys are stored in, or ``None`` (the model's).
    """
    half = mean.shape[-1] // 2
    basis = torch.eye(mean.shape[-1]) if basis is None else basis.float().cpu()
    first, second = mean[:, :half, None].float(), mean[:, half:, None].float()  # [heads, half, 1]
    top, bottom = basis[:half], basis[half:]  # rows of the basis for channel j and j + half
    cos_rows = first * top + second * bottom  # o_j = m1 cos - m2 sin, o_{j+half} = m2 cos + m1 sin
    sin_rows = first * bottom - second * top
    return torch.cat((cos_rows, sin_rows), 1).contiguous()


class CalibratedKeyQuantizer(IntQuantizer):
    """[`IntQuantizer`][h2o_compress.formats.IntQuantizer] for keys, around a calibrated mean rotated to each token's
    position. The stored parts are those of ``IntQuantizer`` (the same bytes); what they hold is the key minus
    the offset, so they are read only with the positions (`quantize_at`, `dequantize_at`).

    Args:
        bits: 4 or 8.
        group_size: elements per (scale, zero) pair.
        head_dim: elements per key.
        mean: fp32 ``[kv_heads, head_dim]``, the layer's mean pre-RoPE key per KV head.
        inv_freq: fp32 ``[head_dim / 2]``, the model's RoPE frequencies (radians per position).
        rotate: quantize in the Hadamard basis (the cache rotates keys into it; the offset is built in it).
        attention_scaling: the factor the model's RoPE multiplies ``cos`` and ``sin`` by (1 for the default RoPE).

    Raises:
        ConfigError: ``mean`` or ``inv_freq`` of the wrong shape, or bits/group size as for ``IntQuantizer``.
    """

    def __init__(self, bits: int, group_size: int, head_dim: int, mean: torch.Tensor, inv_freq: torch.Tensor,
                 rotate: bool = True, attention_scaling: float = 1.0):
        super().__init__(bits, group_size, head_dim, rotate)
        if mean.dim() != 2 or mean.shape[1] != head_dim or tuple(inv_freq.shape) != (head_dim // 2,):
            raise ConfigError(f"key calibration of shape {tuple(mean.shape)} with {tuple(inv_freq.shape)} RoPE "
                              f"frequencies does not fit head_dim={head_dim}; allowed: [kv_heads, {head_dim}] and "
                              f"[{head_dim // 2}] (a RoPE over the whole head)")
        self.attention_scaling = float(attention_scaling)
        self.inv_freq = inv_freq.detach().float().cpu()
        self.basis = offset_basis(mean.detach().cpu(), self.rotation(torch.device("cpu")))
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inv_freq, basis)`` on ``device`` (copied once per device)."""
        if device not in self._on:
            self._on[device] = (self.inv_freq.to(device), self.basis.to(device))
        return self._on[device]

    def offset(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 ``[batch, kv_heads, n, head_dim]``: the offset of int ``positions`` ``[batch, kv_heads, n]`` in the
        stored basis (empty slots, ``-1``, get that of position -1: callers mask them)."""
        inv_freq, basis = self._tables(positions.device)
        angles = positions.unsqueeze(-1).float() * inv_freq  # [b, h, n, half]
        features = torch.cat((angles.cos(), angles.sin()), -1) * self.attention_scaling
        return torch.einsum("bhnk,hkd->bhnd", features, basis)

    def widest_group(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., 1]``: the largest range (max - min) among the groups of each token of ``x`` ``[..., head_dim]``."""
        groups = x.unflatten(-1, (self.head_dim // self.group_size, self.group_size))
        return (groups.amax(-1) - groups.amin(-1)).amax(-1, keepdim=True)

    def quantize_at(self, x: torch.Tensor, positions: torch.Tensor) -> StoredTensor:
        """Quantize keys ``x`` ``[batch, kv_heads, n, head_dim]`` (in the stored basis) at int ``positions``
        ``[batch, kv_heads, n]``: ``x - offset(positions)`` where that narrows the token's widest group (its
        scales then negative), else ``x``, in ``IntQuantizer``'s parts."""
        x = x.float()
        offset = self.offset(positions)
        shifted = self.widest_group(x - offset) < self.widest_group(x)  # [b, h, n, 1]
        stored = self.quantize(torch.where(shifted, x - offset, x))
        scale_zero = stored.parts["scale_zero"]
        sign = 1.0 - 2.0 * shifted.to(scale_zero.dtype)  # -1 where shifted
        scale_zero[..., 0].mul_(sign)
        return stored

    def dequantize_at(self, stored: StoredTensor, out: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the keys at ``positions`` ``[batch, kv_heads, n]`` into ``out`` ``[batch, kv_heads, n, head_dim]``:
        the stored differences plus the offset where the scales are negative."""
        self.dequantize_into(stored, out)
        shifted = stored.parts["scale_zero"][..., 0, 0].unsqueeze(-1) < 0  # [b, h, n, 1]
        out.add_((self.offset(positions) * shifted).to(out.dtype))

    def dequantize_into(self, stored: StoredTensor, out: torch.Tensor) -> None:
        """The stored differences (``codes x |scale| + zero``, without the offsets, which need the positions:
        `dequantize_at`) written into ``out``."""
        scale_zero = stored.parts["scale_zero"].float()
        codes = self._codes(stored.parts["data"])
        target = out.unflatten(-1, (self.head_dim // self.group_size, self.group_size))
        target.copy_(torch.addcmul(scale_zero[..., 1:], codes, scale_zero[..., :1].abs()))


def key_shape(model) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` from the model's config."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return heads, head_dim


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
