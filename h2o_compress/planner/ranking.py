"""The measured quality ranking the planner recommends by when no profile report is given
(`rank`).

The table ships as ``data/quality_ranking.json``, built by ``python benchmarks/quality_ranking.py`` from the
streaming perplexity results in ``benchmarks/results/`` (SmolLM2-135M, 1,024 tokens read token by token): per
measured setting, its perplexity as a ratio to the uncompressed cache's on the worst text of the reporting corpus
it was measured on. A candidate is ranked by, in order:

1. its own entry (``measured``);
2. else the best entry it keeps at least as much as (``bound``: the same policy, or ``full``; no smaller budget;
   no fewer key or value bits; where quantized, the same format, no larger group, no shorter residual window and no
   smaller 8-bit share; the same heavy ratio, sinks, head and layer budgets), whose ratio it is taken not to
   exceed;
3. else it is unranked and comes after every ranked candidate (the planner orders those by cache bytes, largest
   first).

Policies that rank a token-by-token stream as another does (``same_as``: ``lookahead`` and ``snapkv`` as ``h2o``)
are looked up as that policy.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from importlib import resources

from h2o_compress.config import CompressionConfig
from h2o_compress.planner.settings import _setting_key, describe

RANKING_FILE = "data/quality_ranking.json"


@dataclass(frozen=True)
class Measured:
    """One entry of the table: ``config`` measured at ``ratio`` (perplexity / uncompressed) on ``worst_text``, the
    worst of ``texts`` (``None`` and empty for the reference itself)."""

    config: CompressionConfig
    ratio: float
    worst_text: str | None
    texts: tuple[str, ...]

    @property
    def label(self) -> str:
        return describe(self.config)


@dataclass(frozen=True)
class Ranking:
    """The shipped table: its ``entries``, the ``metric`` they give, the result files they come from (``sources``),
    and the policies looked up as another (``same_as``)."""

    metric: str
    model: str
    tokens: int
    sources: tuple[str, ...]
    same_as: dict
    entries: tuple[Measured, ...]

    @property
    def source(self) -> str:
        """Where the figures come from, in one phrase (the plan's ``quality ranking:`` line)."""
        return (f"h2o_compress/{RANKING_FILE} ({self.metric}; {self.model}, {self.tokens:,} tokens; from "
                f"{', '.join(self.sources)})")


@dataclass(frozen=True)
class Rank:
    """A candidate's place in the ranking: ``ratio`` (``None``: unranked), ``basis`` (``measured``, ``bound`` or
    ``unranked``) and the entry the ratio comes from."""

    ratio: float | None
    basis: str
    entry: Measured | None = None

    def note(self) -> str:
        """The figure in words, e.g. ``1.036x perplexity on the reporting corpus's worst text (python_reference of
        3 measured)``; empty when unranked."""
        entry = self.entry
        if entry is None:
            return ""
        if not entry.texts:
            return "the uncompressed cache itself (the reference, 1.000x)"
        figure = (f"{entry.ratio:.3f}x perplexity of uncompressed on the reporting corpus's worst text "
                  f"({entry.worst_text}, of {len(entry.texts)} measured)")
        if self.basis == "measured":
            return figure
        return f"at most {figure}: it keeps at least what {entry.label} keeps, measured"


@functools.lru_cache(maxsize=1)
def shipped_ranking() -> Ranking:
    """The table shipped in the package (read once)."""
    data = json.loads(resources.files("h2o_compress").joinpath(RANKING_FILE).read_text(encoding="utf-8"))
    entries = tuple(Measured(CompressionConfig(**e["setting"]), float(e["ratio"]), e["worst_text"], tuple(e["texts"]))
                    for e in data["entries"])
    return Ranking(data["metric"], data["model"], int(data["tokens"]), tuple(data["sources"]), dict(data["same_as"]),
                   entries)


def rank(config: CompressionConfig, ranking: Ranking | None = None) -> Rank:
    """``config``'s place in ``ranking`` (default: the shipped table), by the rules of this module's docstring."""
    ranking = ranking or shipped_ranking()
    own = _setting_key(_as_ranked(config, ranking.same_as))
    for entry in ranking.entries:
        if _setting_key(entry.config) == own:
            return Rank(entry.ratio, "measured", entry)
    kept = [entry for entry in ranking.entries if keeps_at_least(config, entry.config, ranking.same_as)]
    if not kept:
        return Rank(None, "unranked")
    best = min(kept, key=lambda entry: entry.ratio)
    return Rank(best.ratio, "bound", best)


def _as_ranked(config: CompressionConfig, same_as: dict) -> CompressionConfig:
    """``config`` with its policy looked up as ``same_as`` says (``lookahead`` as ``h2o``)."""
    if config.policy not in same_as:
        return config
    return replace(config, policy=same_as[config.policy])


def _is_full(config: CompressionConfig) -> bool:
    return config.policy == "full" or (config.budget_is_fraction and config.budget >= 1)


def keeps_at_least(config: CompressionConfig, other: CompressionConfig, same_as: dict | None = None) -> bool:
    """Whether ``config`` keeps at least what ``other`` keeps: every token ``other``'s eviction keeps (``full``, or
    the same policy and eviction options with no smaller budget of the same kind) at no fewer bits (where both
    quantize a tensor: the same format, no larger group, no shorter residual window, no smaller 8-bit share)."""
    same_as = same_as or {}
    if not _is_full(config):
        policy, theirs = same_as.get(config.policy, config.policy), same_as.get(other.policy, other.policy)
        if _is_full(other) or policy != theirs or config.budget_is_fraction != other.budget_is_fraction:
            return False
        if config.budget < other.budget or (config.heavy_ratio, config.sinks, config.head_budgets,
                                            config.layer_budgets) != (other.heavy_ratio, other.sinks,
                                                                      other.head_budgets, other.layer_budgets):
            return False
    if config.key_bits < other.key_bits or config.value_bits < other.value_bits:
        return False
    if min(config.key_bits, config.value_bits) == 16 or not other.quantized:
        return True
    return (config.quant == other.quant and config.group_size <= other.group_size
            and config.residual >= other.residual and config.high_bits_fraction >= other.high_bits_fraction)
