"""The compressed KV cache: fixed buffers a compiled decode step can replay.

- :mod:`.layer`: :class:`CompressedLayer`, one attention layer built from parts: its :mod:`.setting`
  (:class:`LayerSetting`), its store (:mod:`.slots`: :class:`SlotStore`, kept tokens in stored form in fixed slots
  per KV head; :mod:`.slot_pool`: :class:`SlotPool`, one pool shared by the heads, Ada-KV's head-adaptive budgets;
  :mod:`.refinement`: :class:`RefinedPlanes`, the low planes of the top-ranked tokens, mixed precision), its ring
  (:mod:`.ring`: :class:`RingWindow`, the newest tokens in full precision, KIVI's residual), its span (:mod:`.span`:
  :class:`LayerSpan`, full, sliding or chunked attention) and its decode backend (:mod:`.backends`).
- :mod:`.decode` and :mod:`.chunk`: a layer's one-token step in torch form and its multi-token step.
- :mod:`.state`: what a layer learns at its first token and the counters it keeps.
- :mod:`.container`: :class:`CompressedCache`, the transformers ``Cache`` over the layers.
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
