"""``sink``: StreamingLLM, attention sinks + recent window (Xiao et al. 2024, arXiv 2309.17453 §3.2)."""

from dataclasses import dataclass
from typing import ClassVar

from h2o_compress.policies.base import EvictionPolicy


@dataclass
class SinkPolicy(EvictionPolicy):
    """Keeps the first ``sink_tokens`` tokens (default 4, as in the paper) and the newest ones."""

    summary: ClassVar[str] = "StreamingLLM: attention sinks (first tokens, default 4) + recent window"

    sink_tokens: int = 4
