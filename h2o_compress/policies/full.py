"""``full``: no eviction (the uncompressed reference)."""

from dataclasses import dataclass

from .base import EvictionPolicy


@dataclass
class FullPolicy(EvictionPolicy):
    """Keeps every token; the cache only grows. Quantization may still apply."""
