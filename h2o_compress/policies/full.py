"""``full``: no eviction (the uncompressed reference)."""

from dataclasses import dataclass
from typing import ClassVar

from h2o_compress.policies.base import EvictionPolicy


@dataclass
class FullPolicy(EvictionPolicy):
    """Keeps every token; the cache only grows. Quantization may still apply."""

    summary: ClassVar[str] = "no eviction: every token is kept (the reference)"
