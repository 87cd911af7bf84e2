"""The compressed KV cache: fixed buffers a compiled decode step can replay.

- :mod:`.slots`: :class:`SlotStore`, kept tokens in stored form (quantized once) in fixed slots.
- :mod:`.ring`: :class:`RingWindow`, the newest tokens in full precision (KIVI's residual).
- :mod:`.layer`: :class:`CompressedLayer`, one attention layer: decode step, chunk step, eviction.
- :mod:`.mixed`: :class:`MixedPrecisionLayer`, a layer whose top-ranked stored tokens are 8-bit, the rest 4-bit;
  :mod:`.refinement`: :class:`RefinedPlanes`, its side buffer of low planes.
- :mod:`.container`: :class:`CompressedCache`, the transformers ``Cache`` over the layers.
"""

from .container import CompressedCache, build_layers
from .layer import CompressedLayer
from .mixed import MixedPrecisionLayer
from .refinement import RefinedPlanes
from .ring import RingWindow
from .slots import SlotStore

__all__ = [
    "CompressedCache", "CompressedLayer", "MixedPrecisionLayer", "RefinedPlanes", "RingWindow", "SlotStore", "build_layers",
]
