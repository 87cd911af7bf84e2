"""The one check of a compression setting against where it runs: the model and the device.

Every entry point (``make_cache``, ``generate``, ``ask``, the CLI, the profile sweep) runs `check_setting`
before it allocates or writes anything, so a setting is refused by the same rule, with the same message, wherever
it comes from. What a setting allows on its own (bits, formats, policies and their options) is
[`CompressionConfig`][h2o_compress.config.CompressionConfig]'s check, run when it is built.
"""

from __future__ import annotations

import torch

from h2o_compress.attention.choice import check_kernel
from h2o_compress.attention.interface import check_attention_backend
from h2o_compress.config import CompressionConfig, check_usable
from h2o_compress.formats import check_group_size, make_quantizer
from h2o_compress.models import model_dims
from h2o_compress.models.weights import input_device
from h2o_compress.runtime.compiled import check_compile
from h2o_compress.utils.errors import ConfigError, short


def check_setting(config: CompressionConfig | None, *, model=None, device: torch.device | str | None = None,
                  capacity: int | None = None, frozen: bool = False, compile: bool | None = None,
                  usable: bool = True) -> CompressionConfig:
    """Check ``config`` against the ``model`` (when loaded) and the ``device`` it runs on; returns the config
    (``None``: no compression).

    Args:
        config: the setting.
        model: a loaded transformers causal LM: its attention must go through ``AttentionInterface`` and be one a
            compressed cache can follow, and ``group_size`` must divide its ``head_dim`` (when quantized).
            ``None``: the checks that need the model are left for when it is loaded.
        device: where the cache lives (default: the model's input device): ``attention_kernel='triton'`` must be
            able to run there (with the model's ``head_dim`` and the setting's formats, when the model is given).
        capacity: tokens per layer and KV head, when known (for the recent-window rule of [`check_usable`][h2o_compress.config.check_usable]).
        frozen: compress-then-ask (the context never evicts again; see [`check_usable`][h2o_compress.config.check_usable]).
        compile: the ``compile`` argument of the caller (``None``: auto): ``True`` must be traceable.
        usable: also refuse settings that are valid field by field but make no sense together
            ([`check_usable`][h2o_compress.config.check_usable]: what the CLI refuses; the Python API builds them for experiments).

    Raises:
        ConfigError: naming the value and what is allowed.
        UnsupportedModelError: the model's attention cannot be followed.
    """
    if config is None:
        config = CompressionConfig()
    if not isinstance(config, CompressionConfig):
        raise ConfigError(f"config={short(config)} is invalid; allowed: a CompressionConfig or None")
    if usable:
        check_usable(config, capacity, frozen=frozen)
    check_compile(compile, config)
    head_dim, formats = None, ()
    if model is not None:
        check_attention_backend(model)
        head_dim = model_dims(model.config).head_dim
        if config.quantized:
            check_group_size(config.group_size, head_dim)
        formats = tuple(make_quantizer(bits, config.quant, config.group_size, head_dim, config.rotate)
                        for bits in (config.key_bits, config.value_bits))
        device = input_device(model) if device is None else device
    if device is not None:
        check_kernel(config.attention_kernel, device, head_dim, formats)
    return config
