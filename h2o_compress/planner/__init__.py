"""Memory-budget planner: a memory limit -> a compression setting, and a setting -> bytes.

- `h2o_compress.planner.sizes`: bytes of the KV cache (exact: the same layer and quantizer objects the cache is built from,
  [`h2o_compress.cache.build_layers`][h2o_compress.cache.build_layers], at the end state of a [`h2o_compress.generate`][h2o_compress.generate] run; DESIGN.md §2,
  Memory accounting), of the weights (exact for 16-bit, bitsandbytes' formats for 8/4-bit) and of the workspace
  (an estimate of the largest forward pass, the Triton op's scratch and a compiled step's CUDA-graph pool).
- `h2o_compress.planner.settings`: setting names, the candidate grid, quality read from a profile report.
- `h2o_compress.planner.plan`: [`plan`][h2o_compress.plan] (every candidate against a limit), [`choose`][h2o_compress.planner.choose] and [`choose_for_prompt`][h2o_compress.planner.choose_for_prompt].
- `h2o_compress.planner.states`: a hybrid model's constant linear-attention/SSM/convolution states, from its config
  per family ([`model_states`][h2o_compress.planner.model_states]).
- `h2o_compress.planner.known_models`: model shapes that plan offline (``data/known_models.json``), or a loaded model's.
- `h2o_compress.planner.units`: memory amounts, lists, headroom; `h2o_compress.planner.view`: the ``h2o-compress plan`` table (rich).
"""

from h2o_compress.planner.known_models import ModelSpec, resolve_model
from h2o_compress.planner.plan import (
    PlanReport, PlanRow, choose, choose_for_prompt, describe_choice, fit_batch, plan,
)
from h2o_compress.planner.settings import candidates, describe, load_quality
from h2o_compress.planner.sizes import (
    CacheBytes, cache_bytes, forward_peak_bytes, graph_pool_bytes, runs_decode_op, weight_bytes, workspace_bytes,
)
from h2o_compress.planner.states import StateTensor, model_states, state_bytes
from h2o_compress.planner.units import format_bytes, parse_headroom, parse_list, parse_memory

__all__ = [
    "CacheBytes", "ModelSpec", "PlanReport", "PlanRow", "StateTensor", "cache_bytes", "candidates", "choose",
    "choose_for_prompt", "describe", "describe_choice", "fit_batch", "format_bytes", "forward_peak_bytes",
    "graph_pool_bytes", "load_quality", "model_states", "parse_headroom", "parse_list", "parse_memory", "plan",
    "resolve_model", "runs_decode_op", "state_bytes", "weight_bytes", "workspace_bytes",
]
