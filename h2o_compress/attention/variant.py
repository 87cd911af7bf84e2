"""Attention variants of today's models that change the softmax itself: logit soft-capping (Gemma 2, Team Gemma
2024, arXiv 2408.00118 §2: ``softcap x tanh(logits / softcap)``) and learned sink logits (GPT-OSS, OpenAI 2025:
one extra logit per query head in the softmax's denominator, attending to nothing; Xiao et al., arXiv 2309.17453).

They reach the attention function as keyword arguments (``softcap=``, ``s_aux=``), as transformers' own eager
attention of those models receives them; `softmax_probabilities` is the one softmax every torch form of the
``h2o_compress`` attention uses (decode, chunk and the H2O scorer), so the output and the scores see the same
probabilities. The native CPU kernel and the Triton op do not implement them: layers of such models decode in
torch ([`h2o_compress.cache.container.build_layers`][h2o_compress.cache.build_layers]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_compress.utils.errors import UnsupportedModelError


@dataclass(frozen=True)
class AttentionVariant:
    """What a layer's softmax adds to plain scaled dot-product attention.

    Attributes:
        softcap: ``softcap x tanh(logits / softcap)`` before the mask (``None``: none).
        sinks: learned sink logits, one per query head, ``[q_heads]`` (``None``: none).
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def from_call(cls, kwargs: dict, kernel: str = "torch", layer_idx: int = 0) -> "AttentionVariant | None":
        """The variant in an attention call's keyword arguments (popped: SDPA refuses them), or ``None``.

        Raises:
            UnsupportedModelError: a variant for a layer whose decode ``kernel`` (``"cpu"``, ``"triton"``) does not
                run it ([`h2o_compress.make_cache`][h2o_compress.make_cache] picks the torch form for such models).
        """
        softcap, sinks = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
        if softcap is None and sinks is None:
            return None
        if kernel != "torch":
            raise UnsupportedModelError(
                f"layer {layer_idx}: this model's attention has a soft-cap or sink logits, which the {kernel} decode "
                "kernel does not run; build the cache with h2o_compress.make_cache(model, ...), which picks the torch "
                "form for such layers")
        return cls(softcap, sinks)


def softmax_probabilities(logits: torch.Tensor, visible: torch.Tensor | None, variant: AttentionVariant | None,
                          heads: tuple[int, ...] = ()) -> torch.Tensor:
    """fp32 attention probabilities from fp32 scaled ``logits`` ``[..., keys]``, with ``visible`` (bool,
    broadcastable, ``None``: all) and the ``variant``'s soft-cap and sink logit. ``heads``: the view of the sink
    logits ``[q_heads]`` that broadcasts against ``logits`` (e.g. ``(1, kv_heads, group, 1)``)."""
    if variant is not None and variant.softcap is not None:
        logits = torch.tanh(logits / variant.softcap) * variant.softcap
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    if variant is None or variant.sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = variant.sinks.float().view(heads).expand(*logits.shape[:-1], 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.amax(-1, keepdim=True)
    return torch.softmax(combined, dim=-1)[..., :-1]
