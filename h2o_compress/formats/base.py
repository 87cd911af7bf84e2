"""Storage container and quantizer interface shared by every KV quantization backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar
from dataclasses import dataclass

import torch

from h2o_compress.utils.errors import ConfigError


@dataclass
class StoredTensor:
    """The stored form of a key or value tensor ``[batch, kv_heads, seq, head_dim]``.

    ``parts`` maps names to tensors that all have the batch at dim 0, the KV head at dim 1 and the token at
    dim 2 (e.g. packed int4 data ``[batch, kv_heads, seq, head_dim // 2]`` and fp16 scale/zero pairs
    ``[batch, kv_heads, seq, groups, 2]``). Tokens are independent, so eviction is a gather along dim 2.
    """

    parts: dict[str, torch.Tensor]

    def __len__(self) -> int:
        return next(iter(self.parts.values())).shape[2]

    def nbytes(self) -> int:
        """Bytes held by every part."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def cat(self, other: "StoredTensor") -> "StoredTensor":
        """Tokens of ``self`` followed by tokens of ``other``."""
        return StoredTensor({k: torch.cat((v, other.parts[k]), dim=2) for k, v in self.parts.items()})

    def select(self, index: torch.Tensor, slots: int | None = None) -> "StoredTensor":
        """Keep tokens ``index``: ``[kept]`` (same for every sequence and head) or ``[batch, kv_heads, kept]``,
        in a new buffer of ``slots >= kept`` tokens (default ``kept``) whose first ``kept`` hold them."""
        return StoredTensor({k: _into_slots(gather_tokens(v, index), slots) for k, v in self.parts.items()})

    def resized(self, length: int, slots: int) -> "StoredTensor":
        """A new buffer of ``slots`` tokens whose first ``length`` are this one's first ``length``."""
        parts = {}
        for k, v in self.parts.items():
            parts[k] = v.new_empty(*v.shape[:2], slots, *v.shape[3:])
            parts[k][:, :, :length].copy_(v[:, :, :length])
        return StoredTensor(parts)

    def narrow(self, length: int) -> "StoredTensor":
        """Views of the first ``length`` tokens (no copy)."""
        return StoredTensor({k: v[:, :, :length] for k, v in self.parts.items()})

    def write(self, start: int, other: "StoredTensor") -> None:
        """Copy ``other``'s tokens into slots ``start .. start + len(other) - 1``, in place."""
        for k, v in self.parts.items():
            v[:, :, start : start + len(other)].copy_(other.parts[k])

    def move(self, source: int, target: torch.Tensor) -> None:
        """In place, per sequence and head: slot ``target[b, h]`` (``[batch, heads]`` int64) takes the token in slot
        ``source`` (the same slot for every sequence and head). O(batch x heads), whatever the length."""
        for v in self.parts.values():
            token = v[:, :, source : source + 1].clone()
            index = target.view(*target.shape, *([1] * (v.dim() - 2))).expand(token.shape)
            v.scatter_(2, index, token)

    def scatter_(self, slots: torch.Tensor, other: "StoredTensor") -> None:
        """In place: token ``i`` of ``other`` goes to slot ``slots[b, h, i]`` (int64 ``[batch, heads, n]``), per
        sequence and head. No host sync, no allocation beyond the index view: the decode step's write."""
        for k, v in self.parts.items():
            source = other.parts[k]
            index = slots.view(*slots.shape, *([1] * (v.dim() - 3))).expand(source.shape)
            v.scatter_(2, index, source)

    def put_(self, target: tuple[torch.Tensor, ...], other: "StoredTensor", source: tuple[torch.Tensor, ...]) -> None:
        """In place: ``self[b, h, slot] = other[b, h, i]`` for the index triples ``target = (b, h, slot)`` and
        ``source = (b, h, i)`` (1-D int64 tensors of one length; prefill writes)."""
        for k, v in self.parts.items():
            v[target] = other.parts[k][source].to(v.dtype)

    @classmethod
    def zeros_like_probe(
        cls, probe: "StoredTensor", batch: int, heads: int, slots: int, device: torch.device | str
    ) -> "StoredTensor":
        """A zero-filled buffer of ``slots`` tokens on ``device`` with the parts, trailing shapes and dtypes of
        ``probe`` (one quantized token)."""
        return cls(
            {k: torch.zeros(batch, heads, slots, *v.shape[3:], dtype=v.dtype, device=device) for k, v in probe.parts.items()}
        )

    def map_batch(self, fn) -> "StoredTensor":
        """Apply ``fn`` (a function of one tensor acting on dim 0) to every part."""
        return StoredTensor({k: fn(v) for k, v in self.parts.items()})


def _into_slots(tensor: torch.Tensor, slots: int | None) -> torch.Tensor:
    """``tensor`` ``[batch, heads, n, ...]`` at the head of a new ``[batch, heads, slots, ...]`` buffer (the rest
    uninitialised), or ``tensor`` itself when ``slots`` is ``None`` or ``n``."""
    if slots is None or slots == tensor.shape[2]:
        return tensor
    buffer = tensor.new_empty(*tensor.shape[:2], slots, *tensor.shape[3:])
    buffer[:, :, : tensor.shape[2]].copy_(tensor)
    return buffer


def gather_tokens(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather along the token dim (2) of ``tensor`` ``[batch, heads, seq, ...]``.

    ``index`` is ``[kept]`` (shared) or ``[batch, heads, kept]`` (per sequence and head). Returns a new tensor
    (never a view), so the evicted tokens' memory is released.
    """
    if index.dim() == 1:
        return tensor.index_select(2, index)
    shape = (*index.shape, *tensor.shape[3:])
    expanded = index.view(*index.shape, *([1] * (tensor.dim() - 3))).expand(shape)
    return torch.gather(tensor, 2, expanded)


#: Elements of ``head_dim`` that may share one scale (``group_size``; a block for bitsandbytes).
GROUP_SIZES = (32, 64, 128)


def check_group_size(group_size: int, head_dim: int) -> None:
    """Refuse a ``group_size`` that does not divide ``head_dim`` (ConfigError naming both and the sizes that do)."""
    if head_dim % group_size:
        allowed = ", ".join(str(g) for g in GROUP_SIZES if head_dim % g == 0) or "none (use 16 bits)"
        raise ConfigError(f"group_size={group_size} does not divide the model's head_dim={head_dim}; allowed: {allowed}")


class KVQuantizer(ABC):
    """Turns ``[batch, kv_heads, seq, head_dim]`` keys or values into a [`StoredTensor`][h2o_compress.formats.StoredTensor] and back.

    Each token is quantized independently (per-token groups along ``head_dim``), so tokens can be evicted
    by gathering their packed data and scales (DESIGN.md §2, Quantization).

    A format family declares what it supports in class variables, which the config's checks, the planner and
    the CLI read (`h2o_compress.formats.FORMATS`), and builds its quantizer for a bit width with
    [`create`][h2o_compress.formats.KVQuantizer.create].
    """

    bits: int = 16
    #: The bit widths below 16 the family stores.
    supported_bits: ClassVar[tuple[int, ...]] = ()
    #: It quantizes in a Hadamard-rotated basis when the config's ``rotate`` is on.
    rotates: ClassVar[bool] = False
    #: Some of its 4-bit tokens can keep 8 bits (``high_bits_fraction``, `h2o_compress.formats.split`).
    mixed_precision: ClassVar[bool] = False
    #: Its decode step can be traced by ``torch.compile`` (the bitsandbytes calls cannot).
    compilable: ClassVar[bool] = True

    @classmethod
    def create(cls, bits: int, group_size: int, head_dim: int, rotate: bool = True) -> "KVQuantizer":
        """The family's quantizer for ``bits``-bit tensors (one of `supported_bits`)."""
        raise NotImplementedError

    @classmethod
    def label(cls, bits: int) -> str:
        """The short name of the family's ``bits``-bit tensors in a setting's description (the planner's rows, the
        profile's labels): ``int4``, ``nf4``, ``bw8``... Default: the class name less ``Quantizer``, lower case, and
        the bits."""
        return f"{cls.__name__.removesuffix('Quantizer').lower()}{bits}"

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> StoredTensor:
        """Quantize ``x`` ``[batch, kv_heads, seq, head_dim]``."""

    @abstractmethod
    def dequantize(self, stored: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
        """Return ``[batch, kv_heads, seq, head_dim]`` in ``dtype``."""

    def dequantize_into(self, stored: StoredTensor, out: torch.Tensor) -> None:
        """Write the dequantized tokens into ``out`` ``[batch, kv_heads, seq, head_dim]`` (may be a strided
        view, e.g. the first ``seq`` tokens of a larger buffer), so no concatenation is needed after."""
        out.copy_(self.dequantize(stored, out.dtype))

    def rotation(self, device: torch.device) -> torch.Tensor | None:
        """The orthonormal, symmetric basis ``[head_dim, head_dim]`` this format expects its inputs in, or
        ``None``. The cache rotates tokens into it once, when they arrive, and the attention function folds it
        into the query and the output, so stored tokens are never rotated back (DESIGN.md §2)."""
        return None

    def bytes_per_token(self, head_dim: int) -> float:
        """Stored bytes of one token of one KV head (data, scales, zeros)."""
        probe = self.quantize(torch.zeros(1, 1, 1, head_dim))
        return probe.nbytes()
