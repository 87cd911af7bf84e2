"""Eviction stage: one small policy class per file, found by name in `POLICIES`."""

from __future__ import annotations

from collections.abc import Mapping

from h2o_compress.policies.a2sf import A2SFPolicy
from h2o_compress.policies.base import EvictionPolicy, PolicyOption, declared_options, policy_option
from h2o_compress.policies.calibrated import CalibratedPolicy
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
from h2o_compress.policies.vatp import VATPPolicy
from h2o_compress.utils.errors import ConfigError

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
    "vatp": VATPPolicy,
    "calibrated": CalibratedPolicy,
}

__all__ = [
    "A2SFPolicy", "CalibratedPolicy", "EvictionPolicy", "FullPolicy", "H2OMeanPolicy", "H2OPolicy", "LocalPolicy", "SinkPolicy", "SnapKVPolicy",
    "TOVAPolicy", "VATPPolicy", "StridedPolicy", "KVzipPolicy", "LookaheadPolicy", "POLICIES", "POLICY_OPTIONS", "make_policy",
    "policy_names", "policy_names_taking", "takes_option", "describe_policies", "PolicyOption", "policy_option",
    "declared_options", "option_declarations",
]


def option_declarations() -> dict[str, PolicyOption]:
    """Every policy option of the registered policies (`policy_option`), by config name, in registry order: the
    first policy declaring a name gives its flag and help."""
    options = {}
    for cls in POLICIES.values():
        for name, option in declared_options(cls).items():
            options.setdefault(name, option)
    return options


class _PolicyOptions(Mapping):
    """The config names of the registered policies' own options and the dataclass field each sets, read from the
    policies' fields (`policy_option`) whenever asked, so a policy registered later adds its own."""

    def _current(self) -> dict[str, str]:
        return {name: option.field for name, option in option_declarations().items()}

    def __getitem__(self, name: str) -> str:
        return self._current()[name]

    def __iter__(self):
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __repr__(self) -> str:
        return repr(self._current())


#: The config names of the policies' own options (the [`CompressionConfig`][h2o_compress.config.CompressionConfig]
#: field or ``policy_options`` key that sets each), and the dataclass field of the policy they set: derived from
#: the registered policies' fields declared with `policy_option`. A policy takes an option when it declares it.
POLICY_OPTIONS: Mapping[str, str] = _PolicyOptions()


def policy_names(**declared) -> tuple[str, ...]:
    """The registered names whose class declares every given value, in registry order: ``policy_names()`` all of
    them, ``policy_names(shares_heads=True)`` those that can share a layer's budget between heads. A declared value
    ``True`` for ``scorer`` means any scoring pass."""
    def matches(cls) -> bool:
        return all(bool(getattr(cls, key)) if want is True and key == "scorer" else getattr(cls, key) == want
                   for key, want in declared.items())
    return tuple(name for name, cls in POLICIES.items() if matches(cls))


def takes_option(name: str, option: str) -> bool:
    """Whether the policy registered as ``name`` takes the option of config name ``option`` (see `POLICY_OPTIONS`)."""
    return option in declared_options(POLICIES[name])


def describe_policies() -> str:
    """``name (summary), ...`` of every registered policy: the CLI's ``--policy`` help."""
    return "; ".join(f"{name}: {cls.summary}" if cls.summary else name for name, cls in POLICIES.items())


def make_policy(name: str, heavy_ratio: float = 0.5, sink_tokens: int | None = None, **options) -> EvictionPolicy:
    """Instantiate the policy registered as ``name`` (see `POLICIES`) with its capacity split and its own
    ``options``, given by their config names (`POLICY_OPTIONS`; ``None`` or ``False``: the policy's default).

    Raises:
        ConfigError: an option the policy does not take, or a value its ``__post_init__`` refuses.
    """
    cls = POLICIES[name]
    kwargs = {"heavy_ratio": heavy_ratio}
    if sink_tokens is not None:
        kwargs["sink_tokens"] = sink_tokens
    declared = declared_options(cls)
    for option, value in options.items():
        if value is None or value is False:
            continue
        if option not in declared:
            takers = policy_names_taking(option)
            if not takers:
                raise ConfigError(f"unknown policy option {option!r}; allowed: {', '.join(POLICY_OPTIONS)}")
            allowed = f"policy {takers[0]!r} only" if len(takers) == 1 else f"policies {', '.join(takers)}"
            raise ConfigError(f"{option} is set but policy={name!r}; allowed: {option} with {allowed}")
        kwargs[declared[option].field] = value
    return cls(**kwargs)


def policy_names_taking(option: str) -> tuple[str, ...]:
    """The registered policies that take the option of config name ``option``."""
    return tuple(name for name in POLICIES if takes_option(name, option))
