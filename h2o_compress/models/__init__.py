"""The model side: its attention geometry (`h2o_compress.models.dims`), loading it (`h2o_compress.models.loading`: the embedded SmolLM2
default, local directories, hub ids), its weights as loaded and where they live (`h2o_compress.models.weights`), and the
fingerprint that ties a saved cache to it (`h2o_compress.models.identity`)."""

from h2o_compress.models.dims import ModelDims, check_config_values, model_dims, torch_decode_reason
from h2o_compress.models.loading import (
    CPU_INT8_MODELS, DEFAULT_MODEL, DTYPES, check_model_dir, converted_dir, default_weights_bits, gguf_path, load_model,
    placement_options, resolve_device, resolve_dtype, resolve_weights_bits,
)

__all__ = [
    "ModelDims", "model_dims", "torch_decode_reason", "check_config_values",
    "DEFAULT_MODEL", "DTYPES", "load_model", "check_model_dir", "converted_dir", "gguf_path", "placement_options",
    "resolve_device", "resolve_dtype", "CPU_INT8_MODELS", "default_weights_bits", "resolve_weights_bits",
]
