"""4-bit weights on CPU through torch's own packed int4 kernel (a leaf module).

[`Int4Linear`][h2o_compress.models.int4_linear.Int4Linear] replaces an ``nn.Linear``: its weight is stored as
asymmetric 4-bit codes in groups of `GROUP_SIZE` input features, ``w ~= (q - 8) * scale + zero`` with
``q`` in [0, 15] and one bf16 ``scale`` and ``zero`` per group and output channel (the layout of gpt-fast's and
torchao's int4 weight-only quantization), packed by ``aten._convert_weight_to_int4pack_for_cpu`` and run by
``aten._weight_int4pack_mm_for_cpu``, which dequantizes inside the matmul: each decoded token reads half a byte
per weight (+ 4 bytes of scale and zero per 32 weights).

Groups of 32 along the input features with a minimum and a step are also the layout of GGUF's Q4_1 blocks, in
which the embedded SmolLM2 ships its 210 decoder Linear layers: quantizing the dequantized file weights again
finds each block's own grid (its minimum and maximum are codes 0 and 15), so the codes come back exactly and
only the bf16 rounding of the block's step and minimum moves a weight.

Like [`Int8Linear`][h2o_compress.models.int8_linear.Int8Linear] the module computes in bf16 (with fp32 or fp16
activations torch's CPU int4 kernel measured several times slower) and casts only inside itself. The kernel
needs ``out_features`` divisible by 16 and ``in_features`` by `GROUP_SIZE`; `quantize_linears_int4` packs other
layers to int8 instead.
"""

from __future__ import annotations

import torch
from torch import nn

from h2o_compress.models.int8_linear import (
    COMPUTE_DTYPE, ONE_THREAD_BYTES, one_row_product, quantize_linears, release_source_weights,
)

GROUP_SIZE = 32  # input features per scale and zero: GGUF's Q4_1 block, so the embedded model's codes come back
OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs out_features divisible by 16


class Int4Linear(nn.Module):
    """An ``nn.Linear`` with group-wise asymmetric 4-bit weights, run by ``aten._weight_int4pack_mm_for_cpu``.

    Buffers (so ``model.buffers()`` counts them, to the byte): ``weight_int4`` ``[out, in / 2]`` uint8 (torch's
    packed CPU layout), ``scales_and_zeros`` ``[in / GROUP_SIZE, out, 2]`` in `COMPUTE_DTYPE`, and ``bias``
    ``[out]`` in the original dtype when the layer had one.

    Attributes:
        in_features, out_features: as ``nn.Linear``'s.
        one_thread: a one-row product runs on one thread (half a byte per weight under `ONE_THREAD_BYTES`).
    """

    PACKED = True  # its buffers are packed weights (`release_source_weights` leaves them alone)

    def __init__(self, weight_int4: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features = weight_int4.shape[0]
        self.in_features = weight_int4.shape[1] * 2
        self.register_buffer("weight_int4", weight_int4.contiguous())
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.one_thread = weight_int4.numel() < ONE_THREAD_BYTES

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        """Whether torch's int4 CPU kernel takes ``linear``'s shape (out by 16, in by `GROUP_SIZE`)."""
        return linear.out_features % OUT_MULTIPLE == 0 and linear.in_features % GROUP_SIZE == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        """Quantize ``linear``'s weight group by group (fp32 arithmetic): the step ``(max - min) / 15`` rounded up
        to `COMPUTE_DTYPE` (a constant group gets step 1), the zero ``min + 8 * step`` rounded to it, then
        ``q = round((w - zero) / step) + 8`` clamped to [0, 15] against those rounded values, as the kernel
        dequantizes.

        Raises:
            ValueError: a shape the kernel cannot take (see `fits`).
        """
        if not cls.fits(linear):
            raise ValueError(f"Int4Linear needs out_features divisible by {OUT_MULTIPLE} and in_features by "
                             f"{GROUP_SIZE}; got {linear.out_features} x {linear.in_features}")
        weight = linear.weight.detach().float()
        out, width = weight.shape
        groups = weight.reshape(out, width // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        exact = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
        step = exact.to(COMPUTE_DTYPE)
        step = torch.where(step.float() < exact, torch.nextafter(step, torch.full_like(step, float("inf"))), step)
        zero = (low + 8 * step.float()).to(COMPUTE_DTYPE)
        codes = torch.round((groups - zero.float()[..., None]) / step.float()[..., None]) + 8
        codes = codes.clamp_(0, 15).to(torch.int32).reshape(out, width)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return cls(packed, torch.stack([step, zero], dim=-1).transpose(0, 1), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        out = one_row_product(self.one_thread, torch.ops.aten._weight_int4pack_mm_for_cpu, rows, self.weight_int4,
                              GROUP_SIZE, self.scales_and_zeros)
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` this module computes with, for checks: the identity matrix through the kernel,
        so each value comes back rounded to `COMPUTE_DTYPE` (bf16), then widened to fp32."""
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.weight_int4, GROUP_SIZE, self.scales_and_zeros).float().t().contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears_int4(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model.model`` (the decoder layers) with an `Int4Linear`, or with an
    [`Int8Linear`][h2o_compress.models.int8_linear.Int8Linear] where the int4 kernel cannot take its shape, and
    the output head with an ``Int8Linear`` (a head tied to the input embeddings is untied for the head's copy
    only, as `h2o_compress.models.int8_linear.quantize_linears` does: the embedded SmolLM2's is GGUF Q8_0, and
    4 bits there would lose more than the decoder layers' exact codes gain). Returns how many layers were
    replaced."""
    replaced = 0
    body = getattr(model, "model", model)
    for module in list(body.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and Int4Linear.fits(child):
                setattr(module, child_name, Int4Linear.from_linear(child))
                replaced += 1
    return replaced + quantize_linears(model, head=True)


def pack_int4(model: nn.Module) -> int:
    """What ``load_model(weights_bits=4)`` does to a CPU model: `quantize_linears_int4`, then
    [`release_source_weights`][h2o_compress.models.int8_linear.release_source_weights]. Returns how many layers
    were packed."""
    packed = quantize_linears_int4(model)
    release_source_weights(model)
    return packed
