"""h2o-compress: H2O eviction + 4/8-bit quantization of the transformers KV cache.

Quick start:

```python
from h2o_compress import CompressionConfig, load_model, generate
model, tokenizer = load_model()  # the embedded SmolLM2-135M
result = generate(model, tokenizer, "Explain what a KV cache is.", CompressionConfig(budget=0.2, kv_bits=4))
print(result.text, result.kv_bytes / result.kv_bytes_full_fp16)
```

"""

from h2o_compress.runtime.ask import ASK_DEFAULTS, CompressedContext, ask, compress
from h2o_compress.cache import CompressedCache, CompressedLayer
from h2o_compress.config import CompressionConfig
from h2o_compress.config_file import load_config
from h2o_compress.utils.errors import (
    CacheFileError,
    CacheStateError,
    ConfigError,
    H2OCompressError,
    InputError,
    ModelLoadError,
    UnsupportedModelError,
)
from h2o_compress.runtime.generation import GenerationResult, generate, make_cache
from h2o_compress.runtime.batch import BatchRequest, BatchResult, BatchStats, generate_batch
from h2o_compress.models import DEFAULT_MODEL, load_model, model_dims
from h2o_compress.persistence import load_cache, save_cache
from h2o_compress.planner import PlanReport, PlanRow, choose, choose_for_prompt, plan
from h2o_compress.jobs import (
    AskJob, AskReport, BatchJob, BatchReport, GenerateJob, GenerateReport, run_ask, run_batch, run_generate,
)

from h2o_compress.utils.version import __version__

__all__ = [
    "CompressedCache",
    "CompressedLayer",
    "CompressionConfig",
    "GenerationResult",
    "generate",
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
