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

from .container import CompressedCache, build_layers
from .layer import CompressedLayer
from .refinement import RefinedPlanes
from .ring import RingWindow
from .setting import LayerSetting
from .slot_pool import SlotPool
from .slots import SlotStore
from .span import LayerSpan

__all__ = [
    "CompressedCache", "CompressedLayer", "LayerSetting", "LayerSpan", "RefinedPlanes", "RingWindow", "SlotPool",
    "SlotStore", "build_layers",
]
