"""The compressed KV cache: fixed buffers a compiled decode step can replay.

- :mod:`.slots`: :class:`SlotStore`, kept tokens in stored form (quantized once) in fixed slots.
- :mod:`.ring`: :class:`RingWindow`, the newest tokens in full precision (KIVI's residual).
- :mod:`.layer`: :class:`CompressedLayer`, one attention layer: decode step, eviction, transformers' layer API;
  :mod:`.chunk`: its multi-token step (prefill, chunked prefill).
- :mod:`.mixed`: :class:`MixedPrecisionLayer`, a layer whose top-ranked stored tokens are 8-bit, the rest 4-bit
  (:class:`AdaptiveMixedPrecisionLayer` on a head-adaptive pool); :mod:`.refinement`: :class:`RefinedPlanes`, its
  side buffer of low planes.
- :mod:`.slot_pool`, :mod:`.head_adaptive_layer`: :class:`SlotPool` and :class:`HeadAdaptiveLayer`, one layer's
  budget shared by its KV heads (Ada-KV, ``head_budgets="adaptive"``).
- :mod:`.container`: :class:`CompressedCache`, the transformers ``Cache`` over the layers.
"""

from .container import CompressedCache, build_layers
from .head_adaptive_layer import HeadAdaptiveLayer
from .layer import CompressedLayer
from .mixed import AdaptiveMixedPrecisionLayer, MixedPrecisionLayer
from .refinement import RefinedPlanes
from .ring import RingWindow
from .slot_pool import SlotPool
from .slots import SlotStore

__all__ = [
    "AdaptiveMixedPrecisionLayer", "CompressedCache", "CompressedLayer", "HeadAdaptiveLayer", "MixedPrecisionLayer",
    "RefinedPlanes", "RingWindow", "SlotPool", "SlotStore", "build_layers",
]
