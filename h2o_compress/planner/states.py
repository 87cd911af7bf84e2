"""Constant-size states of hybrid models: the conv and recurrent states of their linear-attention, SSM and
convolution layers, sized from the config per family (exact: `tests/planner/test_hybrid_states.py` checks every
formula against the states a real prefill leaves in the cache, to the byte).

A hybrid's state layers ([`LayerSpan`][h2o_compress.cache.LayerSpan] ``"state"``, or ``paired`` beside the keys
for Falcon-H1) hold per sequence one convolution window and, for most families, one recurrent state; neither
grows with the context. transformers' code keeps the conv window in the compute dtype and the recurrent state in
fp32 (its torch paths and the CUDA kernels it calls return fp32 final states; Bailing's and Kimi's cast to fp32
explicitly); MiniMax's lightning attention keeps one key-value state in the compute dtype. RecurrentGemma keeps both in its own modules, not in the cache (``in_cache=False``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h2o_compress.cache.span import layer_spans
from h2o_compress.utils.errors import UnsupportedModelError


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of one layer.

    Attributes:
        shape: its shape for one sequence (the cache's tensor is ``[batch, *shape]``).
        float32: held in fp32 whatever the model's dtype (else in the compute dtype).
        in_cache: held by the cache (``cache.nbytes()`` counts it); ``False``: by the model's own modules.
    """

    shape: tuple[int, ...]
    float32: bool = False
    in_cache: bool = True

    def nbytes(self, batch: int, dtype: torch.dtype) -> int:
        """Bytes of the tensor for ``batch`` sequences in a model computing in ``dtype``."""
        size = 4 if self.float32 else torch.empty((), dtype=dtype).element_size()
        return batch * math.prod(self.shape) * size


def _mamba2(c) -> tuple[StateTensor, ...]:
    """Mamba-2 mixer (Bamba, GraniteMoeHybrid, Falcon-H1): conv over x, B and C; state ``[heads, dim, d_state]``."""
    inner = getattr(c, "mamba_d_ssm", None) or int(c.mamba_expand * c.hidden_size)
    conv = inner + 2 * c.mamba_n_groups * c.mamba_d_state
    return (StateTensor((conv, c.mamba_d_conv)),
            StateTensor((c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state), float32=True))


def _nemotron_h(c) -> tuple[StateTensor, ...]:
    """Nemotron-H's Mamba-2 mixer (its own field names)."""
    conv = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
    return (StateTensor((conv, c.conv_kernel)),
            StateTensor((c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size), float32=True))


def _zamba2(c) -> tuple[StateTensor, ...]:
    """Zamba2's Mamba-2 mixer (its own field names)."""
    conv = int(c.mamba_expand * c.hidden_size) + 2 * c.mamba_ngroups * c.mamba_d_state
    return (StateTensor((conv, c.mamba_d_conv)),
            StateTensor((c.n_mamba_heads, c.mamba_headdim, c.mamba_d_state), float32=True))


def _zamba(c) -> tuple[StateTensor, ...]:
    """Zamba's multi-head Mamba-1 mixer: one ``[inner / heads, d_state]`` state per head."""
    inner = c.mamba_expand * c.hidden_size
    return (StateTensor((inner, c.mamba_d_conv)),
            StateTensor((c.n_mamba_heads, inner // c.n_mamba_heads, c.mamba_d_state), float32=True))


def _mamba1(c) -> tuple[StateTensor, ...]:
    """Mamba-1 mixer (Jamba): conv over the inner width; state ``[inner, d_state]``."""
    inner = c.mamba_expand * c.hidden_size
    return StateTensor((inner, c.mamba_d_conv)), StateTensor((inner, c.mamba_d_state), float32=True)


def _gated_delta(c) -> tuple[StateTensor, ...]:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid): conv over q, k, v; state ``[v_heads, k_dim, v_dim]``."""
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    return (StateTensor((conv, c.linear_conv_kernel_dim)),
            StateTensor((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), float32=True))


def _kimi_delta(c) -> tuple[StateTensor, ...]:
    """Kimi delta attention (Bailing hybrid, Kimi Linear): conv over q, k and v; state ``[heads, dim, dim]``."""
    heads, dim = c.linear_num_heads, c.linear_head_dim
    return StateTensor((3 * heads * dim, c.linear_conv_kernel_dim)), StateTensor((heads, dim, dim), float32=True)


def _short_conv(c) -> tuple[StateTensor, ...]:
    """LFM2's gated short convolution: one conv window over the hidden width, no recurrent state."""
    return (StateTensor((c.hidden_size, c.conv_L_cache)),)


def _lightning(c) -> tuple[StateTensor, ...]:
    """MiniMax's lightning attention: one key-value state ``[heads, head_dim, head_dim]`` in the compute dtype."""
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (StateTensor((c.num_attention_heads, dim, dim)),)


def _rg_lru(c) -> tuple[StateTensor, ...]:
    """RecurrentGemma's RG-LRU block: held by the block itself, not the cache (conv ``width - 1`` positions)."""
    return (StateTensor((c.lru_width, c.conv1d_width - 1), in_cache=False),
            StateTensor((c.lru_width,), float32=True, in_cache=False))


#: model type -> the states one of its state layers holds
FAMILIES = {
    "bamba": _mamba2, "granitemoehybrid": _mamba2, "falcon_h1": _mamba2, "nemotron_h": _nemotron_h,
    "zamba2": _zamba2, "zamba": _zamba, "jamba": _mamba1,
    "qwen3_next": _gated_delta, "qwen3_5_text": _gated_delta, "qwen3_5_moe_text": _gated_delta,
    "olmo_hybrid": _gated_delta, "bailing_hybrid": _kimi_delta, "kimi_linear": _kimi_delta, "lfm2": _short_conv, "lfm2_moe": _short_conv,
    "lfm3": _short_conv, "minimax": _lightning, "recurrent_gemma": _rg_lru,
}


def model_states(config) -> tuple[StateTensor, ...]:
    """Every constant-size state tensor of a transformers ``config``'s model, over all its layers (``()`` for a
    model without state layers).

    Raises:
        UnsupportedModelError: state layers in a family the planner has no formula for (one line naming it and the
            families it sizes).
    """
    text = getattr(config, "get_text_config", lambda: config)()
    spans = layer_spans(text, text.num_hidden_layers)
    layers = sum(span.stateful or span.paired for span in spans)
    if not layers:
        return ()
    family = FAMILIES.get(getattr(text, "model_type", None))
    if family is None:
        raise UnsupportedModelError(
            f"model type {getattr(text, 'model_type', '?')!r} has {layers} linear-attention/SSM/convolution layers "
            f"whose constant states the planner cannot size; planned hybrids: {', '.join(sorted(FAMILIES))}"
        )
    return family(text) * layers


def state_bytes(states: tuple[StateTensor, ...], batch: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(held by the cache, held by the model's modules)``: bytes of ``states`` for ``batch`` sequences of a model
    computing in ``dtype``."""
    cached = sum(s.nbytes(batch, dtype) for s in states if s.in_cache)
    return cached, sum(s.nbytes(batch, dtype) for s in states if not s.in_cache)
