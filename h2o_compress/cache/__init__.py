"""The compressed KV cache: fixed buffers a compiled decode step can replay.

- `h2o_compress.cache.layer`: [`CompressedLayer`][h2o_compress.cache.CompressedLayer], one attention layer built from parts: its `h2o_compress.cache.setting`
  ([`LayerSetting`][h2o_compress.cache.LayerSetting]), its store (`h2o_compress.cache.slots`: [`SlotStore`][h2o_compress.cache.SlotStore], kept tokens in stored form in fixed slots
  per KV head; `h2o_compress.cache.slot_pool`: [`SlotPool`][h2o_compress.cache.SlotPool], one pool shared by the heads, Ada-KV's head-adaptive budgets;
  `h2o_compress.cache.refinement`: [`RefinedPlanes`][h2o_compress.cache.RefinedPlanes], the low planes of the top-ranked tokens, mixed precision), its ring
  (`h2o_compress.cache.ring`: [`RingWindow`][h2o_compress.cache.RingWindow], the newest tokens in full precision, KIVI's residual), its span (`h2o_compress.cache.span`:
  [`LayerSpan`][h2o_compress.cache.LayerSpan], full, sliding or chunked attention) and its decode backend (`h2o_compress.cache.backends`).
- `h2o_compress.cache.decode` and `h2o_compress.cache.chunk`: a layer's one-token step in torch form and its multi-token step.
- `h2o_compress.cache.state`: what a layer learns at its first token and the counters it keeps.
- `h2o_compress.cache.container`: [`CompressedCache`][h2o_compress.cache.CompressedCache], the transformers ``Cache`` over the layers.
"""

from h2o_compress.cache.container import CompressedCache, build_layers
from h2o_compress.cache.layer import CompressedLayer
from h2o_compress.cache.refinement import RefinedPlanes
from h2o_compress.cache.ring import RingWindow
from h2o_compress.cache.setting import LayerSetting
from h2o_compress.cache.slot_pool import SlotPool
from h2o_compress.cache.slots import SlotStore
from h2o_compress.cache.span import LayerSpan

__all__ = [
    "CompressedCache", "CompressedLayer", "LayerSetting", "LayerSpan", "RefinedPlanes", "RingWindow", "SlotPool",
    "SlotStore", "build_layers",
]
