"""What the cache needs to know about a model: its attention geometry ([`ModelDims`][h2o_compress.models.ModelDims]), read from the
transformers config, with every size checked before anything is allocated ([`check_config_values`][h2o_compress.models.check_config_values]).
"""

from __future__ import annotations

from dataclasses import dataclass

from h2o_compress.cache.span import FULL_SPAN, layer_spans
from h2o_compress.utils.checks import is_integer
from h2o_compress.utils.errors import ModelLoadError, UnsupportedModelError, short


@dataclass(frozen=True)
class ModelDims:
    """Attention geometry of a decoder: what the KV cache stores per token."""

    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    #: head dim of the values where it differs from the keys' (multi-head latent attention), else ``None``
    value_head_dim: int | None = None
    #: the attention module expands what it cached (multi-head latent attention caching its latents)
    expands_cache: bool = False
    #: each layer's [`LayerSpan`][h2o_compress.cache.LayerSpan] (full, sliding or chunked attention, or a hybrid's
    #: constant ``"state"`` layer); ``()``: all full
    spans: tuple = ()

    @property
    def fp16_bytes_per_token(self) -> int:
        """Bytes of one token's keys and values in fp16 over the layers that hold keys: ``layers x kv_heads x
        (head_dim + value_head_dim) x 2`` (``2 x layers x kv_heads x head_dim x 2`` where keys and values are alike;
        a hybrid's constant-state layers hold none)."""
        layers = self.num_layers - sum(span.stateful for span in self.spans)
        return layers * self.kv_heads * (self.head_dim + (self.value_head_dim or self.head_dim)) * 2


def model_dims(config) -> ModelDims:
    """KV geometry of a transformers config (LLaMA-like, OPT, GPT-NeoX and others using the usual names).

    Raises:
        ModelLoadError: not a transformers config (e.g. ``None``, a model name: pass ``model.config``), or a geometry
            value out of range (see [`check_config_values`][h2o_compress.models.check_config_values]).
    """
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise ModelLoadError(f"config={short(config)} is not a transformers config; allowed: a PretrainedConfig, e.g. "
                             "model.config of a loaded model")
    config = config.get_text_config()
    spans = tuple(layer_spans(config, config.num_hidden_layers))  # refuses non-attention and shared-KV layers first
    check_config_values(config.to_dict() if hasattr(config, "to_dict") else vars(config), "the model's config")
    try:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
    except RuntimeError as error:  # transformers' AmbiguousGlobalPerLayerAttributeError (Gemma 4)
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} has an attention geometry that varies by layer "
            f"({str(error).split('.')[0]}); h2o-compress needs one head dim and KV head count for every layer"
        ) from None
    value_head_dim, expands = None, False
    if getattr(config, "kv_lora_rank", None) and getattr(config, "qk_rope_head_dim", None):
        kv_heads, head_dim, value_head_dim, expands = _latent_attention_dims(config, heads)
        value_head_dim = None if value_head_dim == head_dim else value_head_dim
    spans = () if all(span == FULL_SPAN for span in spans) else spans
    return ModelDims(config.num_hidden_layers, heads, kv_heads, head_dim, value_head_dim, expands, spans)


def _latent_attention_dims(config, heads: int) -> tuple[int, int, int, bool]:
    """``(kv_heads, key head dim, value head dim, expands)`` that a multi-head latent attention model (DeepSeek-V2,
    arXiv 2405.04434 §2.1) hands its cache in transformers: the latents themselves (one head: ``kv_lora_rank`` wide
    "keys", the shared rotary key ``qk_rope_head_dim`` wide as "values"; the attention module expands them, its
    ``expand_kv``, into a key and a value per query head, whatever ``num_key_value_heads`` says: ``expands`` is
    ``True`` for any head count), or the expanded keys (``qk_nope_head_dim + qk_rope_head_dim``) and values
    (``v_head_dim``) of every query head (``expands`` ``False``)."""
    import importlib

    try:
        module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
        latent = any(hasattr(cls, "expand_kv") for cls in vars(module).values() if isinstance(cls, type))
    except ImportError:
        latent = False
    if latent:
        return 1, config.kv_lora_rank, config.qk_rope_head_dim, True
    head_dim = (getattr(config, "qk_nope_head_dim", None) or 0) + config.qk_rope_head_dim
    return heads, head_dim, getattr(config, "v_head_dim", None) or head_dim, False


def torch_decode_reason(model, dims: ModelDims) -> str | None:
    """Why ``model``'s layers decode in the torch form rather than the native CPU kernel or the Triton op, or
    ``None``: a softmax those kernels do not run (logit soft-cap, learned sink logits), a latent cache the
    attention module expands (the kernels attend over the store itself, not over the keys the module made of it) or
    values of another head dim than the keys (`h2o_compress.attention.variant`)."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    if getattr(config, "attn_logit_softcapping", None):
        return "logit soft-capping"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "learned sink logits"
    if dims.expands_cache:
        return "a latent cache expanded by the attention module (multi-head latent attention)"
    if dims.value_head_dim is not None:
        return "values of another head dim than the keys"
    return None


# What a real model can have (the largest known models are far inside these); a config outside is broken.
CONFIG_LIMITS = {
    "num_hidden_layers": 1024, "n_layer": 1024, "num_layers": 1024,
    "num_attention_heads": 1024, "n_head": 1024, "num_key_value_heads": 1024,
    "hidden_size": 2**17, "n_embd": 2**17, "d_model": 2**17, "head_dim": 4096,
    "intermediate_size": 2**20, "ffn_dim": 2**20, "n_inner": 2**20,
    "vocab_size": 2**24, "max_position_embeddings": 2**31 - 1,
}


def check_config_values(fields, source: str) -> None:
    """Refuse a model config whose geometry no real model has, before anything is built from it.

    Checks the fields of `CONFIG_LIMITS` (at top level and in a ``text_config``): each present one must
    be an integer from 1 to its limit; ``num_key_value_heads`` must divide ``num_attention_heads``; without
    ``head_dim``, ``hidden_size`` must be a multiple of ``num_attention_heads``.

    Args:
        fields: the config as a dict (``config.json``'s object or ``PretrainedConfig.to_dict()``).
        source: how messages name the config, e.g. ``"config.json of 'dir'"``.

    Raises:
        ModelLoadError: not an object, or a value out of range, naming the field, the value and what is allowed.
    """
    if not isinstance(fields, dict):
        raise ModelLoadError(f"{source} holds a {type(fields).__name__}; allowed: a JSON object of settings")
    text = fields.get("text_config")
    for part in (fields, text) if isinstance(text, dict) else (fields,):
        for name, limit in CONFIG_LIMITS.items():
            value = part.get(name)
            if value is None:
                continue
            if not is_integer(value) or not 1 <= value <= limit:
                raise ModelLoadError(
                    f"{source}: {name}={short(value)} is out of range; allowed: an integer from 1 to {limit}"
                )
        heads = part.get("num_attention_heads")
        kv_heads = part.get("num_key_value_heads")
        if heads and kv_heads and heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}; "
                "allowed: a divisor of it"
            )
        hidden = part.get("hidden_size")
        if heads and hidden and not part.get("head_dim") and hidden % heads:
            raise ModelLoadError(
                f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                "allowed: a multiple (or an explicit head_dim)"
            )
