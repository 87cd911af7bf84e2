"""What a [`CompressedLayer`][h2o_compress.cache.CompressedLayer] learns at its first token (`Geometry`: shapes, dtypes, the
storage bases) and the counters it keeps per step (`Counters`), each with the checks that belong to it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_compress.utils.errors import CacheStateError, UnsupportedModelError
from h2o_compress.policies.base import NO_POSITION as NO_REAL_TOKEN


def rotate(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``x @ basis`` in fp32: ``x`` ``[batch, kv_heads, tokens, head_dim]``, ``basis`` fp32 ``[head_dim, head_dim]``."""
    return x.float() @ basis


def rotate_token(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """`rotate` of one token per (sequence, KV head) as a product and a sum over ``head_dim`` (fp32; equal to
    the matmul to float reassociation): Inductor fuses it into the step's kernel that writes the ring instead of
    launching a ``[batch * kv_heads, head_dim] @ [head_dim, head_dim]`` matmul of its own (one kernel fewer per
    layer). Compiled fused (Triton) decode steps only: eagerly it would materialize ``[batch, kv_heads, 1, head_dim,
    head_dim]`` fp32, so eager steps, the torch path and the native CPU path keep the matmul."""
    return (x.float().unsqueeze(-1) * basis).sum(-2)


@dataclass
class Geometry:
    """A layer's shapes and dtypes, from its first keys ``[batch, kv_heads, tokens, head_dim]`` and its setting.

    Attributes:
        residual_dtype: dtype of the ring and of 16-bit storage (fp16 for an fp32 model's quantized cache: its
            bytes count, DESIGN.md §2).
        key_basis: fp32 ``[head_dim, head_dim]`` Hadamard bases tokens are held in, or ``None``.
        value_basis: fp32 ``[value_dim, value_dim]`` Hadamard bases tokens are held in, or ``None``.
        value_dim: the width values are held at (the setting's ``value_dim``; ``None`` given: ``head_dim``).
    """

    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    residual_dtype: torch.dtype
    key_basis: torch.Tensor | None
    value_basis: torch.Tensor | None
    value_dim: int | None = None

    def __post_init__(self):
        if self.value_dim is None:
            self.value_dim = self.head_dim

    @classmethod
    def of(cls, keys: torch.Tensor, setting) -> "Geometry":
        """The geometry of a layer of ``setting`` ([`LayerSetting`][h2o_compress.cache.LayerSetting]) whose first keys are ``keys``
        ``[batch, kv_heads, tokens, head_dim]``."""
        quantized, device = setting.quantized, keys.device
        residual_dtype = torch.float16 if quantized and keys.dtype == torch.float32 else keys.dtype
        return cls(keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype, device, residual_dtype,
                   setting.key_quantizer.rotation(device), setting.value_quantizer.rotation(device),
                   setting.value_dim or keys.shape[3])

    def check(self, keys: torch.Tensor, layer_idx: int) -> None:
        """Refuse keys of another batch, head count, head dim, dtype or device than the cache holds.

        Raises:
            CacheStateError: naming both.
        """
        batch, heads, _, head_dim = keys.shape
        if (batch, heads, head_dim) != (self.batch, self.kv_heads, self.head_dim):
            raise CacheStateError(
                f"layer {layer_idx}: cache holds batch={self.batch}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim} but got batch={batch}, kv_heads={heads}, "
                f"head_dim={head_dim}; use a new cache (or cache.reset())"
            )
        if keys.dtype != self.dtype or keys.device != self.device:
            raise CacheStateError(
                f"layer {layer_idx}: cache holds {self.dtype} keys on {self.device} but got {keys.dtype} on "
                f"{keys.device} (model.half() or .to() after the prefill?); use a new cache (or cache.reset())"
            )

    def to_storage(self, keys: torch.Tensor, values: torch.Tensor, fused: bool = False):
        """New ``keys`` ``[batch, kv_heads, n, head_dim]`` and ``values`` ``[batch, kv_heads, n, value_dim]`` in the
        storage bases and the residual dtype (``fused``: a compiled Triton step's one token, rotated as Inductor fuses
        it: `rotate_token`)."""
        turn = rotate_token if fused and keys.shape[2] == 1 and torch.compiler.is_compiling() else rotate
        if self.key_basis is not None:
            keys = turn(keys, self.key_basis)
        if self.value_basis is not None:
            values = turn(values, self.value_basis)
        return keys.to(self.residual_dtype), values.to(self.residual_dtype)

    def into_key_basis(self, query: torch.Tensor) -> torch.Tensor:
        """Keys are held as ``k @ H``: ``q.k = (q @ H).(k @ H)`` for an orthonormal ``H``."""
        return query if self.key_basis is None else (query.float() @ self.key_basis).to(query.dtype)

    def from_value_basis(self, output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values are held as ``v @ H``: ``P.v = (P.(v @ H)) @ H``; the output made contiguous."""
        output = output if self.value_basis is None else (output.float() @ self.value_basis).to(dtype)
        return output.contiguous()


@dataclass
class Counters:
    """Per-step counters of a layer (0-dim or ``[batch]`` tensors: no host sync to keep them).

    Attributes:
        seen: int64 0-dim, tokens seen (positions keep counting after eviction).
        first_real: int64 ``[batch]``, position of each sequence's first real (non-padding) token.
        finite: bool 0-dim, every key and value so far was finite (read once per generation).
        consistent: bool 0-dim, this layer saw every step layer 0 saw.
        grown_to: host count of tokens seen, kept only by an unbounded cache of unknown length.
    """

    seen: torch.Tensor
    first_real: torch.Tensor
    finite: torch.Tensor
    consistent: torch.Tensor
    grown_to: int = 0

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> "Counters":
        """The counters of a layer that has seen nothing, for ``batch`` sequences on ``device``."""
        return cls(torch.zeros((), dtype=torch.int64, device=device),
                   torch.full((batch,), NO_REAL_TOKEN, dtype=torch.int64, device=device),
                   torch.ones((), dtype=torch.bool, device=device), torch.ones((), dtype=torch.bool, device=device))

    def note_finite(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """bool 0-dim: ``keys`` and ``values`` are finite; noted in `finite` (no host sync)."""
        finite = torch.isfinite(torch.sum(keys, dtype=torch.float32) + torch.sum(values, dtype=torch.float32))
        self.finite &= finite
        return finite

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every counter tensor, by name (``seen``, ``first_real``, ``finite``, ``consistent``)."""
        return {"seen": self.seen, "first_real": self.first_real, "finite": self.finite, "consistent": self.consistent}


def pad_values(values: torch.Tensor, width: int, layer_idx: int, held_at: str = "the keys'") -> torch.Tensor:
    """Values ``[batch, kv_heads, tokens, value_dim]`` zero-padded to the ``width`` the layer holds them at,
    ``[batch, kv_heads, tokens, width]``: the keys' head dim, or the setting's ``value_dim`` (multi-head latent
    attention, DeepSeek-V2 arXiv 2405.04434 §2.1, as transformers computes it: keys and values of different head
    dims; zeros add nothing to the attention output, whose padding is dropped).

    Args:
        values: ``[batch, kv_heads, tokens, value_dim]``.
        width: the held width, ``>= value_dim``.
        layer_idx: the layer, for the message.
        held_at: what ``width`` is, for the message.

    Raises:
        UnsupportedModelError: values wider than ``width``.
    """
    if values.shape[-1] > width:
        raise UnsupportedModelError(f"layer {layer_idx}: values of head dim {values.shape[-1]} wider than {held_at} "
                                    f"{width}; h2o-compress holds values of at most that width (make_cache builds "
                                    "the layers for the model's value head dim)")
    return torch.nn.functional.pad(values, (0, width - values.shape[-1]))

