"""Eviction stage: one small policy class per file, found by name in :data:`POLICIES`."""

from __future__ import annotations

from h2o_compress.policies.a2sf import A2SFPolicy
from h2o_compress.policies.base import EvictionPolicy
from h2o_compress.policies.full import FullPolicy
from h2o_compress.policies.h2o import H2OPolicy
from h2o_compress.policies.h2o_mean import H2OMeanPolicy
from h2o_compress.policies.kvzip import KVzipPolicy
from h2o_compress.policies.local import LocalPolicy
from h2o_compress.policies.lookahead import LookaheadPolicy
from h2o_compress.policies.sink import SinkPolicy
from h2o_compress.policies.snapkv import SnapKVPolicy
from h2o_compress.policies.strided import StridedPolicy
from h2o_compress.policies.tova import TOVAPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "h2o": H2OPolicy,
    "h2o-mean": H2OMeanPolicy,
    "local": LocalPolicy,
    "sink": SinkPolicy,
    "full": FullPolicy,
    "snapkv": SnapKVPolicy,
    "tova": TOVAPolicy,
    "a2sf": A2SFPolicy,
    "strided": StridedPolicy,
    "kvzip": KVzipPolicy,
    "lookahead": LookaheadPolicy,
}

__all__ = [
    "A2SFPolicy", "EvictionPolicy", "FullPolicy", "H2OMeanPolicy", "H2OPolicy", "LocalPolicy", "SinkPolicy", "SnapKVPolicy",
    "TOVAPolicy", "StridedPolicy", "KVzipPolicy", "LookaheadPolicy", "POLICIES", "make_policy",
]


def make_policy(name: str, heavy_ratio: float = 0.5, sink_tokens: int | None = None,
                request: str | None = None, forgetting_factor: float | None = None,
                evict_chat_header: bool = False) -> EvictionPolicy:
    """Instantiate the policy registered as ``name`` (see :data:`POLICIES`); ``request``: ``lookahead``'s request,
    ``forgetting_factor``: ``a2sf``'s (``None``: their defaults); ``evict_chat_header``: ``kvzip``/``lookahead``
    score the chat template's header 0."""
    cls = POLICIES[name]
    kwargs = {"heavy_ratio": heavy_ratio}
    if sink_tokens is not None:
        kwargs["sink_tokens"] = sink_tokens
    if request is not None:
        kwargs["request"] = request
    if forgetting_factor is not None:
        kwargs["forgetting_factor"] = forgetting_factor
    if evict_chat_header:
        kwargs["evict_chat_header"] = True
    return cls(**kwargs)
