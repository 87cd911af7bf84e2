"""h2o-compress: H2O eviction + 4/8-bit quantization of the transformers KV cache.

Quick start:

```python
from h2o_compress import CompressionConfig, load_model, generate
model, tokenizer = load_model()  # the embedded SmolLM2-135M
result = generate(model, tokenizer, "Explain what a KV cache is.", CompressionConfig(budget=0.2, kv_bits=4))
print(result.text, result.kv_bytes / result.kv_bytes_full_fp16)
```

"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from h2o_compress.utils.version import __version__

#: Where each public name lives: imported on first use (PEP 562), so that ``import h2o_compress`` (and the CLI's
#: ``--help``/``--version``) does not load torch and transformers.
_EXPORTS = {
    "h2o_compress.runtime.ask": ("ASK_DEFAULTS", "CompressedContext", "ask", "compress"),
    "h2o_compress.cache": ("CompressedCache", "CompressedLayer"),
    "h2o_compress.config": ("CompressionConfig",),
    "h2o_compress.config_file": ("load_config",),
    "h2o_compress.utils.errors": (
        "CacheFileError", "CacheStateError", "ConfigError", "H2OCompressError", "InputError", "ModelLoadError",
        "UnsupportedModelError",
    ),
    "h2o_compress.runtime.generation": ("GenerationResult", "generate", "make_cache", "stream"),
    "h2o_compress.runtime.batch": ("BatchRequest", "BatchResult", "BatchStats", "generate_batch"),
    "h2o_compress.models": ("DEFAULT_MODEL", "load_model", "model_dims"),
    "h2o_compress.persistence": ("load_cache", "save_cache"),
    "h2o_compress.planner": ("PlanReport", "PlanRow", "choose", "choose_for_prompt", "plan"),
    "h2o_compress.jobs": (
        "AskJob", "AskReport", "BatchJob", "BatchReport", "GenerateJob", "GenerateReport", "run_ask", "run_batch",
        "run_generate",
    ),
    "h2o_compress.serving": ("serve",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from h2o_compress.runtime.ask import ASK_DEFAULTS, CompressedContext, ask, compress
    from h2o_compress.cache import CompressedCache, CompressedLayer
    from h2o_compress.config import CompressionConfig
    from h2o_compress.config_file import load_config
    from h2o_compress.utils.errors import (
        CacheFileError, CacheStateError, ConfigError, H2OCompressError, InputError, ModelLoadError,
        UnsupportedModelError,
    )
    from h2o_compress.runtime.generation import GenerationResult, generate, make_cache, stream
    from h2o_compress.runtime.batch import BatchRequest, BatchResult, BatchStats, generate_batch
    from h2o_compress.models import DEFAULT_MODEL, load_model, model_dims
    from h2o_compress.persistence import load_cache, save_cache
    from h2o_compress.planner import PlanReport, PlanRow, choose, choose_for_prompt, plan
    from h2o_compress.jobs import (
        AskJob, AskReport, BatchJob, BatchReport, GenerateJob, GenerateReport, run_ask, run_batch, run_generate,
    )
    from h2o_compress.serving import serve


def __getattr__(name: str):
    """A public name, imported from its module on first use (then kept in this module's namespace).

    Raises:
        AttributeError: ``name`` is not one of the package's exports (nor a subpackage).
    """
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names and its lazy exports (for ``dir()`` and completion)."""
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "CompressedCache",
    "CompressedLayer",
    "CompressionConfig",
    "GenerationResult",
    "generate",
    "stream",
    "generate_batch",
    "BatchRequest",
    "BatchResult",
    "BatchStats",
    "make_cache",
    "save_cache",
    "load_cache",
    "compress",
    "ask",
    "CompressedContext",
    "ASK_DEFAULTS",
    "run_generate",
    "run_batch",
    "BatchJob",
    "BatchReport",
    "GenerateJob",
    "GenerateReport",
    "run_ask",
    "AskJob",
    "AskReport",
    "serve",
    "load_model",
    "model_dims",
    "plan",
    "choose",
    "choose_for_prompt",
    "PlanReport",
    "PlanRow",
    "DEFAULT_MODEL",
    "H2OCompressError",
    "ConfigError",
    "ModelLoadError",
    "UnsupportedModelError",
    "InputError",
    "CacheStateError",
    "CacheFileError",
    "load_config",
    "__version__",
]
