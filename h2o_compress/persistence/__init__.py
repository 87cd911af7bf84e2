"""Saving and loading a compressed cache: `h2o_compress.persistence.file_format` is the file on disk (one safetensors file, header
checks, checksum, atomic writes); `h2o_compress.persistence.cache_state` is what a cache saves and how it is rebuilt for a model."""

from h2o_compress.persistence.calibration_file import Calibration, load_calibration, read_calibration, save_calibration
from h2o_compress.persistence.cache_state import DERIVED_LAYER_TENSORS, PromptState, load_cache, save_cache
from h2o_compress.persistence.file_format import (
    check_cache_paths, check_save_target, is_cache_file, read_cache_file,
)

__all__ = ["Calibration", "load_calibration", "read_calibration", "save_calibration", "save_cache", "load_cache", "PromptState", "DERIVED_LAYER_TENSORS", "check_cache_paths",
           "check_save_target", "is_cache_file", "read_cache_file"]
