"""8-bit weights on CPU through torch's own packed int8 kernel (a leaf module).

[`Int8Linear`][h2o_compress.models.int8_linear.Int8Linear] replaces an ``nn.Linear``: its weight is stored as
per-output-channel symmetric int8 (``weight_int8 [out, in]``, ``scales [out]``: ``w ~= weight_int8 * scales[:, None]``,
``scales = max |w_row| / 127``) and its forward calls ``torch.ops.aten._weight_int8pack_mm(x, weight_int8, scales)``,
which dequantizes inside the matmul, so each decoded token reads 1 byte per weight instead of 4.

The kernel takes activations in bf16, fp16 or fp32 and the scales in the activation's dtype. On a decode row, with fp32
activations it is several times *slower* than an fp32 matmul, with bf16 activations several times faster
(``benchmarks/results/cpu_weights_int8.md``). So the module computes in bf16 (`COMPUTE_DTYPE`) and casts only
inside itself: the input to bf16, the output back to the input's dtype; the rest of the model and the KV cache
keep their dtype.

bitsandbytes stays the 8/4-bit path on CUDA ([`h2o_compress.models.weights`][h2o_compress.models.weights]); this
one is [`load_model`][h2o_compress.load_model]'s for ``weights_bits=8`` on CPU.
"""

from __future__ import annotations

import ctypes
import gc

import torch
from torch import nn

COMPUTE_DTYPE = torch.bfloat16  # activations inside the kernel, and the scales' dtype

#: A multi-token forward (a prompt's prefill, a chunk of it) of at least this many rows multiplies in bf16 with the
#: weight dequantized (int8 values are exact in bf16; the scales applied after): a dense GEMM (oneDNN, AMX where the CPU
#: has it) beats the packed kernel there, which is built for few rows. Chosen with ``benchmarks/cpu_weights.py``.
DENSE_ROWS = 64

#: A one-row product (a decode step) over an int8 weight smaller than this runs on one thread: waking a second thread
#: costs more than it saves on so little work. SmolLM2 decoded fastest with its decoder layers' products (at most
#: 0.9 MB each) on one thread and its 28 MB output head on two.
ONE_THREAD_BYTES = 4 << 20


def one_row_product(one_thread: bool, product, rows: torch.Tensor, *weights):
    """``product(rows, *weights)``, on one thread when ``rows`` is one row (a decode step) and ``one_thread`` (the
    weight is under `ONE_THREAD_BYTES`), outside a ``torch.compile`` trace; on torch's threads otherwise."""
    if rows.shape[0] != 1 or not one_thread or torch.compiler.is_compiling():
        return product(rows, *weights)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return product(rows, *weights)
    finally:
        torch.set_num_threads(threads)


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with per-output-channel symmetric int8 weights, run by ``aten._weight_int8pack_mm``.

    Buffers (so ``model.buffers()`` counts them, to the byte): ``weight_int8`` ``[out, in]`` int8, ``scales``
    ``[out]`` in `COMPUTE_DTYPE`, and ``bias`` ``[out]`` in the original dtype when the layer had one.

    Attributes:
        in_features, out_features: as ``nn.Linear``'s.
        one_thread: a one-row product runs on one thread (the weight is under `ONE_THREAD_BYTES`).
    """

    PACKED = True  # its buffers are packed weights (`release_source_weights` leaves them alone)

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.one_thread = weight_int8.numel() < ONE_THREAD_BYTES

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize ``linear``'s weight row by row: ``scale = max |row| / 127`` rounded to `COMPUTE_DTYPE` (up, so
        no weight clips; an all-zero row gets scale 1 and stays zero), then ``q = round(w / scale)`` in [-127, 127]
        against that rounded scale. Rounding against the bf16 scale the kernel really uses matters: quantizing
        against the fp32 scale and storing it in bf16 scales each output row by up to 2**-9, which about
        doubled the perplexity lost to fp32 (``benchmarks/results/cpu_weights_int8.md``).
        Computed in fp32 whatever the weight's dtype."""
        weight = linear.weight.detach().float()
        exact = weight.abs().amax(dim=1) / 127.0
        exact = torch.where(exact > 0, exact, torch.ones_like(exact))
        scales = exact.to(COMPUTE_DTYPE)
        scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, float("inf"))),
                             scales)
        q = torch.round(weight / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., tokens, in_features]`` -> ``[..., tokens, out_features]`` in ``x``'s dtype. A decode step
        (one token per sequence, whatever the batch) runs the packed kernel, so a sequence's tokens do not depend
        on the rows beside it; a multi-token forward of at least `DENSE_ROWS` rows runs the dense bf16 product."""
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if x.dim() > 2 and shape[-2] > 1 and rows.shape[0] >= DENSE_ROWS:
            out = (rows @ self.weight_int8.to(COMPUTE_DTYPE).T).float() * self.scales.float()  # one bf16 rounding
        else:
            out = one_row_product(self.one_thread, torch.ops.aten._weight_int8pack_mm, rows, self.weight_int8,
                                  self.scales)
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this module computes with (``weight_int8 * scales``), for checks."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(model: nn.Module, head: bool = True) -> int:
    """Replace every ``nn.Linear`` under ``model.model`` (the decoder layers; embeddings are not Linear) with an
    [`Int8Linear`][h2o_compress.models.int8_linear.Int8Linear], and the output head too when ``head``.

    A head tied to the input embeddings is untied only for the head's copy: the head gets its own int8 weight, the
    embedding keeps its fp weight unchanged (``config.tie_word_embeddings`` is set False so nothing re-ties them).
    Returns how many layers were replaced.
    """
    replaced = 0
    body = getattr(model, "model", model)
    for name, module in list(body.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8Linear.from_linear(child))
                replaced += 1
    out = model.get_output_embeddings() if head and hasattr(model, "get_output_embeddings") else None
    if head and type(out) is nn.Linear:
        for name, module in model.named_children():
            if module is out:
                setattr(model, name, Int8Linear.from_linear(out))
                replaced += 1
                break
        config = getattr(model, "config", None)
        if config is not None:
            config.tie_word_embeddings = False
            text = getattr(config, "get_text_config", lambda: config)()
            text.tie_word_embeddings = False
    return replaced


def pack_int8(model: nn.Module) -> int:
    """What ``load_model(weights_bits=8)`` does to a CPU model: `quantize_linears` (every Linear layer and the head),
    then `release_source_weights`. Returns how many layers were packed."""
    packed = quantize_linears(model, head=True)
    release_source_weights(model)
    return packed


def release_source_weights(model: nn.Module) -> None:
    """After `quantize_linears`: copy the weights left in their source dtype (the embedding, the norms) out of the
    converted checkpoint's memory map into memory of their own, and hand the freed heap back to the system, so the
    fp32 file the int8 weights were packed from no longer counts in the process's resident set. The values are
    unchanged."""
    with torch.no_grad():
        for module in model.modules():
            if getattr(type(module), "PACKED", False):  # Int8Linear, Int4Linear: fresh packed buffers
                continue
            for name, parameter in list(module._parameters.items()):
                if parameter is not None:
                    parameter.data = parameter.data.clone()
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.clone()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap pages otherwise
    except (OSError, AttributeError):  # not glibc: the pages are reused by later allocations instead
        pass


def int8_layers(model: nn.Module) -> list[Int8Linear]:
    """The `Int8Linear` modules of ``model``."""
    return [m for m in model.modules() if isinstance(m, Int8Linear)]
