"""The compressed KV cache: fixed buffers a compiled decode step can replay.

- :mod:`.slots`: :class:`SlotStore`, kept tokens in stored form (quantized once) in fixed slots.
- :mod:`.ring`: :class:`RingWindow`, the newest tokens in full precision (KIVI's residual).
- :mod:`.layer`: :class:`CompressedLayer`, one attention layer: decode step, chunk step, eviction.
- :mod:`.container`: :class:`CompressedCache`, the transformers ``Cache`` over the layers.
"""

from .container import CompressedCache, build_layers
from .layer import CompressedLayer
from .ring import RingWindow
from .slots import SlotStore

__all__ = ["CompressedCache", "CompressedLayer", "RingWindow", "SlotStore", "build_layers"]
