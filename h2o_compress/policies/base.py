"""Eviction policy interface: the priority by which a layer keeps tokens when it holds more than its capacity."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import ClassVar

import torch
from h2o_compress.attention import attention_probability_sums


NO_POSITION = 2**40  # sorts after every real position


def value_l1_norm(values: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., tokens]``: the L1 norm of each value ``[..., tokens, head_dim]`` (VATP's weight, arXiv 2406.12335
    §3)."""
    return values.float().abs().sum(-1)


def keep_top(priority: torch.Tensor, positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """bool ``[batch, kv_heads, tokens]``: the ``capacity`` tokens of highest ``priority`` (fp32, same shape),
    ties keeping the older position, never an empty slot or padding (``positions < 0``)."""
    by_position = positions.masked_fill(positions < 0, NO_POSITION).argsort(dim=-1, stable=True)
    ranked = torch.sort(priority.gather(-1, by_position), dim=-1, descending=True, stable=True).indices
    keep = torch.zeros(priority.shape, dtype=torch.bool, device=priority.device)
    keep.scatter_(-1, by_position.gather(-1, ranked[..., :capacity]), True)
    return keep & (positions >= 0)


#: The metadata key under which `policy_option` marks a policy's dataclass field as one of its own options.
OPTION_METADATA = "h2o_compress.policy_option"
#: The value types a policy option's CLI flag parses (any other annotation: text).
FLAG_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class PolicyOption:
    """A policy's own option, as its dataclass field declares it (`policy_option`).

    Attributes:
        name: its config name: the [`CompressionConfig`][h2o_compress.config.CompressionConfig] key and config file
            key that set it (the field's name unless declared).
        field: the policy's dataclass field it sets.
        flag: its CLI flag (``--`` and the config name with dashes unless declared).
        help: what it does, for the flag's help (the CLI prefixes ``With --policy X:``).
        default: the field's default (``None`` or ``False``: said by ``help`` itself, if at all).
        kind: the value type its flag parses: ``bool`` (a switch), ``int``, ``float`` or ``str``.
    """

    name: str
    field: str
    flag: str
    help: str
    default: object
    kind: type


def policy_option(default, *, flag: str | None = None, config_name: str | None = None, help: str = ""):
    """A dataclass field of a policy that is one of its own options (checked in the policy's ``__post_init__``).

    ``CompressionConfig`` and config files take it by ``config_name`` (default: the field's name), the CLI as
    ``flag`` (default: ``--`` and the config name with dashes), its help from ``help``; nothing else needs an edit.
    A ``bool`` option's default is ``False`` (its flag switches it on).

    Args:
        default: the field's default.
        flag: the CLI flag, e.g. ``"--lookahead-request"``.
        config_name: the config name, e.g. ``"lookahead_request"`` for `LookaheadPolicy`'s ``request``.
        help: one or two sentences, lower case first (after ``With --policy X:``).
    """
    return dataclasses.field(default=default, metadata={OPTION_METADATA: {"flag": flag, "config_name": config_name,
                                                                          "help": help}})


def _flag_type(cls, name: str, default) -> type:
    """The value type of ``cls``'s field ``name``: its annotation less ``None`` where it is one of `FLAG_TYPES`,
    else the default's type, else ``str``."""
    try:
        hint = typing.get_type_hints(cls).get(name)
    except (NameError, TypeError):  # an annotation that cannot be resolved
        hint = None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = kinds[0] if len(kinds) == 1 else None
    if hint in FLAG_TYPES:
        return hint
    return type(default) if type(default) in FLAG_TYPES else str


@functools.cache
def declared_options(cls) -> dict[str, PolicyOption]:
    """The options policy class ``cls`` declares on its fields (`policy_option`), by config name, in field order."""
    options = {}
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(OPTION_METADATA)
        if declared is None:
            continue
        name = declared["config_name"] or f.name
        options[name] = PolicyOption(name, f.name, declared["flag"] or "--" + name.replace("_", "-"),
                                     declared["help"], f.default, _flag_type(cls, f.name, f.default))
    return options


@dataclass
class EvictionPolicy:
    """Ranks the tokens of one layer, per sequence and KV head, for eviction (DESIGN.md §2).

    A policy states its ranking once, in [`rank`][h2o_compress.policies.EvictionPolicy.rank]; [`priority`][h2o_compress.policies.EvictionPolicy.priority] adds the rules every policy shares and
    is the one function prefill eviction (keep the top ``capacity``), decode eviction (evict the lowest) and the
    planner's window arithmetic ([`recent_window`][h2o_compress.policies.EvictionPolicy.recent_window]) read.

    Subclasses declare what they support in class variables (``summary``, ``needs_scores``, ``shares_heads``,
    ``scorer``, ``ranks_by``, ``accumulates``) and say how much of the capacity is the recent window
    ([`recent_window`][h2o_compress.policies.EvictionPolicy.recent_window]); their own options are dataclass fields
    declared with `policy_option` (config name, CLI flag and help), checked in ``__post_init__``. ``sink_tokens`` first real tokens are always kept
    (StreamingLLM's attention sinks); padding is never kept.
    """

    heavy_ratio: float = 0.5
    sink_tokens: int = 0
    # -- what the policy supports, declared once: config checks, CLI help, error messages and plots read these --
    #: One line saying how it ranks, for ``--policy``'s help.
    summary: ClassVar[str] = ""
    #: It ranks by accumulated attention scores, and splits its capacity into heavy hitters (``heavy_ratio``) and
    #: a recent window.
    needs_scores = False
    #: Its ranking compares tokens across KV heads (attention received), so a layer's budget can be shared
    #: between its heads (``head_budgets="adaptive"``, Ada-KV).
    shares_heads: ClassVar[bool] = False
    #: The scoring pass run over a context before its cache is built (a key of
    #: `h2o_compress.runtime.context_scores.SCORERS`); ``""``: none.
    scorer: ClassVar[str] = ""
    #: What [`rank`][h2o_compress.policies.EvictionPolicy.rank] returns, for kernels that apply [`priority`][h2o_compress.policies.EvictionPolicy.priority]'s shared rules themselves: ``"nothing"``
    #: (all equal, the default), ``"scores"`` (the accumulated scores themselves) or ``"custom"`` (anything else:
    #: kernels leave the eviction to [`priority`][h2o_compress.policies.EvictionPolicy.priority]) or
    #: ``"predicted"`` (a calibrated linear predictor: ``w_score log(score) + w_age log(age)`` plus a per-slot
    #: prior, [`CalibratedPolicy`][h2o_compress.policies.CalibratedPolicy], which the CPU kernel computes itself). ``tests/policies/test_policies.py`` checks it against [`rank`][h2o_compress.policies.EvictionPolicy.rank].
    ranks_by: ClassVar[str] = "nothing"
    #: Its [`priority`][h2o_compress.policies.EvictionPolicy.priority] is [`rank`][h2o_compress.policies.EvictionPolicy.rank] times the L1 norm of each token's stored value (``value_norms``), which
    #: the store keeps per slot from when the token enters (VATP); kernels that evict multiply their rank by them.
    weighs_values: ClassVar[bool] = False
    #: Scores add up over the queries that see a token (H2O's accumulated attention). ``False``: each step's
    #: attention replaces them (TOVA ranks by the current query's attention only).
    accumulates: ClassVar[bool] = True
    #: Its ranking has weights fitted once per model (a calibration file): each layer gets its own
    #: ([`for_layer`][h2o_compress.policies.EvictionPolicy.for_layer]), and a cache that would evict needs them.
    needs_calibration: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        """A subclass that overrides `rank` without declaring ``ranks_by`` ranks by something of its own: it is
        declared ``"custom"``, so no kernel substitutes its parent's ranking for it."""
        super().__init_subclass__(**kwargs)
        if "rank" in vars(cls) and "ranks_by" not in vars(cls):
            cls.ranks_by = "custom"

    def for_layer(self, weights: torch.Tensor | None) -> EvictionPolicy:
        """This policy for one model layer, given that layer's calibrated ``weights`` (fp32; ``None``: the
        calibration has none for it). Policies without calibration (`needs_calibration` False) are the same for
        every layer: themselves."""
        return self

    @property
    def score_decay(self) -> float:
        """How a token's score carries over to the next query: ``score = score_decay x score + this query's
        attention``. 1: summed (H2O), 0: replaced (TOVA, ``accumulates=False``), between: a forgetting factor
        (A2SF)."""
        return 1.0 if self.accumulates else 0.0

    def chunk_scores(self, query, keys, mask, scaling, chunk_size: int, variant=None) -> torch.Tensor:
        """What a multi-token step (prefill, a chunk) contributes to the scores of the keys it sees: fp32
        ``[batch, kv_heads, keys]``. Default: the probabilities every query of the chunk gives each key, GQA query
        heads summed per KV head (H2O, arXiv 2306.14048 §4). ``query`` ``[batch, q_heads, queries, head_dim]``,
        ``keys`` ``[batch, kv_heads, keys, head_dim]``, ``mask`` as
        [`attention_probability_sums`][h2o_compress.attention.attention_probability_sums] takes it."""
        return attention_probability_sums(query, keys, mask, scaling, chunk_size, variant=variant)

    def value_weight(self, values: torch.Tensor) -> torch.Tensor:
        """What the store keeps per slot for a policy that `weighs_values`, fp32 ``[batch, rows, tokens]``, of
        ``values`` ``[batch, rows, tokens, head_dim]`` in the model's basis, set once when a token enters: the L1
        norm (VATP, arXiv 2406.12335 §3). A policy with a per-token prior of its own overrides it."""
        return value_l1_norm(values)

    def recent_window(self, capacity: int) -> int:
        """Tokens of the recent window at ``capacity``: the newest tokens, never evicted."""
        return max(capacity - min(self.sink_tokens, capacity), 0)

    def rank(self, scores: torch.Tensor | None, positions: torch.Tensor, seen: int | torch.Tensor) -> torch.Tensor:
        """The policy's own ranking of evictable tokens (higher = kept longer), fp32, shaped like ``positions``.

        Args:
            scores: fp32 ``[batch, kv_heads, tokens]`` accumulated attention (``None`` unless ``needs_scores``).
            positions: int ``[batch, kv_heads, tokens]`` absolute positions (``-1``: empty slot).
            seen: tokens seen so far (int or 0-dim tensor).

        Default: all equal, so the tie rule (evict the older) makes it a recent window.
        """
        return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)

    def priority(
        self,
        scores: torch.Tensor | None,
        positions: torch.Tensor,
        seen: int | torch.Tensor,
        first_real: torch.Tensor,
        capacity: int,
        value_norms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Eviction priority, fp32 ``[batch, kv_heads, tokens]``: ``+inf`` for the recent window (positions
        ``>= seen - recent_window(capacity)``) and the sinks (the first ``sink_tokens`` real tokens, from
        ``first_real`` int64 ``[batch]``), ``-inf`` for empty slots and padding (``positions < 0``), else
        [`rank`][h2o_compress.policies.EvictionPolicy.rank]. Ties are broken by the caller towards keeping the older token. ``value_norms``: fp32 L1
        norms of the tokens' values, shaped like ``positions``, given only where `weighs_values` (a policy
        that weighs values reads them; the others ignore them).
        """
        return self.protect(self.rank(scores, positions, seen), positions, seen, first_real, capacity)

    def protect(self, priority: torch.Tensor, positions: torch.Tensor, seen: int | torch.Tensor,
                first_real: torch.Tensor, capacity: int) -> torch.Tensor:
        """The rules every policy shares, over its fp32 ``priority`` ``[batch, kv_heads, tokens]``: ``+inf`` for the
        recent window and the sinks, ``-inf`` for empty slots and padding (see
        [`priority`][h2o_compress.policies.EvictionPolicy.priority])."""
        recent, sinks = self.recent_window(capacity), min(self.sink_tokens, capacity)
        protected = positions >= seen - recent
        if sinks:
            start = first_real.view(-1, 1, 1)
            protected = protected | ((positions >= start) & (positions < start + sinks))
        return priority.masked_fill(protected, float("inf")).masked_fill(positions < 0, float("-inf"))

    def keep_indices(
        self, scores: torch.Tensor | None, length: int, capacity: int, leading_pads: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Indices of the tokens kept out of ``length`` tokens at positions ``0 .. length - 1`` (the rule a cache
        applies when it holds more than ``capacity``), int64 ``[batch, kv_heads, kept]``, ascending.

        Args:
            scores: fp32 ``[batch, kv_heads, length]`` (policies with ``needs_scores``), else ``None``.
            length: tokens held.
            capacity: tokens to keep.
            leading_pads: int ``[batch]`` left-padding tokens per sequence (never kept), or ``None``.

        Rows that keep fewer tokens than others (padding) end with `NO_POSITION`.
        """
        batch, heads = (1, 1) if scores is None else scores.shape[:2]
        if leading_pads is not None:
            batch = leading_pads.shape[0]
        positions = torch.arange(length).expand(batch, heads, length)
        first_real = torch.zeros(batch, dtype=torch.long) if leading_pads is None else leading_pads.long()
        positions = positions.masked_fill(positions < first_real.view(-1, 1, 1), -1)
        keep = keep_top(self.priority(scores, positions, length, first_real, capacity), positions, capacity)
        kept = int(keep.sum(-1).max())
        return torch.where(keep, torch.arange(length), NO_POSITION).sort(-1).values[..., :kept]
