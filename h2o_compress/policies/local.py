"""``local``: keep only the most recent tokens (a sliding window over the KV cache)."""

from dataclasses import dataclass
from typing import ClassVar

from h2o_compress.policies.base import EvictionPolicy


@dataclass
class LocalPolicy(EvictionPolicy):
    """Recent window only: the newest ``capacity`` tokens (the "local" baseline of H2O, arXiv 2306.14048 §5).

    ``sink_tokens`` is ignored: this is the window-only baseline.
    """

    summary: ClassVar[str] = "recent window only"

    def __post_init__(self):
        self.sink_tokens = 0
