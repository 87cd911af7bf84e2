"""The server's prefix cache: the compressed cache of a finished chat turn, kept for the conversation's next turn.

A chat client sends the whole history every turn. When a chat request ends (not cancelled, not cut by a stop
string), `PrefixCache.keep` copies its row of the batch cache into a one-row cache of its own, keyed by the token
ids that row has seen (its prompt and every generated token but the last, which was never fed). A later chat
request of the same setting whose prompt starts with those ids (and has at least one token more) starts from a
copy of that cache (`PrefixCache.resume`) and prefills only the rest. Entries are kept under a byte budget of
their own, least recently used dropped first; an entry whose ids are a prefix of a newer one of the same setting
(the same conversation, one turn back) is dropped when the newer one is kept.

The copy is what [`take_rows`][h2o_compress.cache.CompressedCache.take_rows] does the other way round: a sequence
moved out of a batch row rather than into one. ``runtime`` and ``cache`` have no helper for that direction, so it
is built here from the layer's public parts, as ``frozen_layer`` copies a layer: an empty one-row cache of the
batch's setting (``make_cache``) is initialised (``lazy_initialization``) and its buffers filled from the row, then
its positions are moved back from the batch's frame to the sequence's own (`h2o_compress.cache.rows.shift`, by the
difference of the two ``seen`` counts). The same copy, from the entry into a cache of the new batch's setting,
resumes a request. Buffers of another shape (a batch of another capacity or ring) are copied only where the store
grows or the slots dropped are empty; otherwise the request is prefilled afresh. Policies that score the prompt in
a pass of their own (``snapkv``, ``kvzip``, ``lookahead``) and models with linear-attention or SSM states are
never resumed: their caches are not a function of the tokens fed alone.

What a resumed answer sees: the cached history is the compressed cache of the earlier turn, so what it evicted is
gone (a fresh prefill of the whole history would rank every token again with the new question among them); at
budget 1.0 and 16 bits nothing is evicted or quantized and the answer is a fresh prefill's.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from h2o_compress.cache.layer import CompressedLayer
from h2o_compress.cache.rows import copy_row, shift
from h2o_compress.config import CompressionConfig
from h2o_compress.runtime.generation import make_cache


@dataclass(eq=False)
class Entry:
    """One kept conversation.

    Attributes:
        ids: int64 ``[tokens]`` (CPU), the token ids ``cache`` has seen.
        config: the compression setting of the request it came from (before a fractional budget was taken of its
            batch's longest request).
        cache: the one-row [`CompressedCache`][h2o_compress.cache.CompressedCache], in the sequence's own positions.
        nbytes: ``cache.nbytes()``.
    """

    ids: torch.Tensor
    config: CompressionConfig
    cache: object
    nbytes: int


def resumable(batch) -> bool:
    """Whether rows of ``batch`` (a running `_Batch`) can be kept and resumed: a policy without a scoring pass of
    its own, a model without linear-attention/SSM states."""
    return not batch.scored and not batch.cache.state_layers


class PrefixCache:
    """Compressed caches of finished chat turns under a byte budget, least recently used dropped first.

    Args:
        budget: bytes the entries may hold together (0: nothing is kept).
    """

    def __init__(self, budget: int = 0):
        self.budget, self.held = budget, 0
        self.entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # oldest use first
        self._ids = 0

    def keep(self, batch, row: int, ids: torch.Tensor, config: CompressionConfig) -> Entry | None:
        """Copy ``row`` of ``batch`` (having seen ``ids``, int64 ``[tokens]``) into a new entry for ``config``,
        dropping the entries it supersedes and the least recently used until it fits; ``None`` where nothing is
        kept (no budget, a row too large for it, or a batch that cannot be resumed)."""
        if not self.budget or not resumable(batch):
            return None
        ids = ids.detach().to("cpu")
        for key in [k for k, e in self.entries.items() if e.config == config and _starts(ids, e.ids)]:
            self._drop(key)
        row_bytes = batch.cache.nbytes() // batch.size
        if row_bytes > self.budget:
            return None
        self._fit(self.budget - row_bytes)
        cache = make_cache(batch.model, batch.config, batch.longest, layer_capacities=batch.capacities)
        if not copy_sequence(batch.cache, row, cache, seen=ids.numel()):
            return None
        entry = Entry(ids, config, cache, cache.nbytes())
        self._ids += 1
        self.entries[self._ids] = entry
        self.held += entry.nbytes
        self._fit(self.budget)
        return entry if self.held <= self.budget else None

    def resume(self, batch, ids: torch.Tensor, config: CompressionConfig):
        """A one-row cache of ``batch``'s setting holding the longest entry of ``config`` whose ids ``ids`` (int64
        ``[tokens]``) extends by at least one token, and how many tokens it holds; ``None`` where there is none
        (or its buffers do not fit ``batch``'s)."""
        if not self.entries or not resumable(batch):
            return None
        ids = ids.detach().to("cpu")
        found = [(e.ids.numel(), k) for k, e in self.entries.items()
                 if e.config == config and e.ids.numel() < ids.numel() and _starts(ids, e.ids)]
        if not found:
            return None
        tokens, key = max(found)
        self.entries.move_to_end(key)
        part = make_cache(batch.model, batch.config, batch.longest, layer_capacities=batch.capacities)
        if not copy_sequence(self.entries[key].cache, 0, part, seen=tokens):
            return None
        return part, tokens

    def _fit(self, room: int) -> None:
        """Drop the least recently used entries until they hold at most ``room`` bytes."""
        while self.entries and self.held > room:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.held -= self.entries.pop(key).nbytes


def _starts(ids: torch.Tensor, prefix: torch.Tensor) -> bool:
    """Whether ``ids`` starts with ``prefix`` (both int64 ``[tokens]``)."""
    return prefix.numel() <= ids.numel() and torch.equal(ids[: prefix.numel()], prefix)


def copy_sequence(source, row: int, target, seen: int) -> bool:
    """Copy sequence ``row`` of ``source`` into ``target``, an empty one-row cache of the same model, layer by
    layer ([`copy_row`][h2o_compress.cache.rows.copy_row]), then move its positions so that it has seen ``seen`` tokens (the sequence's own count:
    a batch row's positions are counted in the batch's frame). ``source`` is not changed.

    Returns:
        Whether every layer was copied (``False``: ``target`` is partly filled and must be dropped).
    """
    if len(source.layers) != len(target.layers) or source.state_layers:
        return False
    for mine, theirs in zip(target.layers, source.layers):
        if not isinstance(mine, CompressedLayer) or not copy_row(theirs, row, mine):
            return False
        shift(mine, seen - int(mine.counters.seen))
    return True
