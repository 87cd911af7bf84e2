"""Sequences moved between caches of one setting: a prompt prefilled alone, placed into a row of a running batch
(continuous batching, [`h2o_compress.generate_batch`][h2o_compress.generate_batch]).

Positions in a layer are only ever compared with each other and with ``seen`` (the recent window, sliding windows,
chunks counted from ``first_real``, the sinks, the ring's slot ``position % size``), so a layer whose every position,
``first_real`` and ``seen`` move by the same ``delta`` (and whose ring turns by ``delta``) holds the same tokens with
the same futures: `shift`. Two layers that have seen different counts are aligned that way, then rows are
copied buffer by buffer (`take_rows`; `copy_row` copies one out, for the server's prefix cache). Eager code run
once per prompt placed, never in a decode step.

`map_batch`: a function of the batch dim applied to every buffer of a layer (beam reordering, a batch selected or
repeated: the layer's transformers batch operations).
"""

from __future__ import annotations

import torch

from h2o_compress.attention.launch import mark_static_address
from h2o_compress.policies.base import NO_POSITION
from h2o_compress.utils.errors import CacheStateError


def map_batch(layer, fn, in_place: bool) -> None:
    """Apply ``fn`` (acting on dim 0) to every batch-major buffer of ``layer`` (a
    [`CompressedLayer`][h2o_compress.cache.CompressedLayer]), after its deferred eviction: in place when the batch
    keeps its size (beam reordering keeps the static addresses), else by re-building the parts' buffers. No-op before
    the layer's first token."""
    if not layer.is_initialized:
        return
    layer.run_deferred_eviction()
    if in_place:  # every buffer but the 0-dim counters and flags
        for tensor in (t for t in layer.tensors().values() if t.dim()):
            tensor.copy_(fn(tensor))
        return
    layer.store.map_batch(fn)
    if layer.ring is not None:
        layer.ring.map_batch(fn)
    layer.counters.first_real = fn(layer.counters.first_real)
    layer.geometry.batch = layer.counters.first_real.shape[0]


def shift(layer, delta: int) -> None:
    """Move every position of ``layer`` (held tokens of the store and ring, ``first_real``, ``seen``) by ``delta``
    tokens, turning the ring with them. In place. A negative ``delta`` moves a row back to its own numbering (the
    prefix cache's copy of a batch row); it must not take a held position below 0."""
    if delta == 0 or not layer.is_initialized:
        return
    for name, tensor in layer.tensors().items():
        if name.endswith("positions"):
            tensor.copy_(torch.where(tensor >= 0, tensor + delta, tensor))
    first_real = layer.counters.first_real
    first_real.copy_(torch.where(first_real != NO_POSITION, first_real + delta, first_real))
    layer.counters.seen.add_(delta)
    ring = layer.ring
    turn = 0 if ring is None else delta % ring.size
    if turn:  # the token at position p sits in slot p % size
        for name, tensor in ring.tensors().items():
            tensor.copy_(tensor.roll(turn, dims=1 if name == "positions" else 2))


def take_rows(layer, rows: torch.Tensor, source, batch: int) -> None:
    """Copy every sequence of ``source`` (a layer of the same setting: same capacity, formats and ring) into rows
    ``rows`` (int64 ``[source batch]``) of ``layer``, which holds ``batch`` sequences; a layer that holds nothing yet
    is made from ``source`` (its other rows copies of ``source``'s first, to be overwritten). The layer that has seen
    fewer tokens is first `shift` ed to the other's ``seen``. ``source`` is left empty. Both layers' deferred
    evictions run first. Continuous batching, layer by layer
    ([`CompressedCache.take_rows`][h2o_compress.cache.CompressedCache.take_rows]).

    Raises:
        CacheStateError: ``source`` holds nothing, or its buffers do not match this layer's (another setting).
    """
    layer.run_deferred_eviction()
    source.run_deferred_eviction()
    if not source.is_initialized:
        raise CacheStateError(f"layer {layer.layer_idx}: the source cache holds nothing; prefill it first")
    mine, theirs = layer.setting, source.setting
    if (theirs.capacity, theirs.residual) != (mine.capacity, mine.residual):
        raise CacheStateError(f"layer {layer.layer_idx}: rows of a cache of capacity {theirs.capacity} (ring "
                              f"{theirs.residual}) cannot go into one of capacity {mine.capacity} (ring {mine.residual})")
    rows = rows.to(source.geometry.device)
    if not layer.is_initialized:
        index = torch.zeros(batch, dtype=torch.long, device=source.geometry.device)
        index[rows] = torch.arange(rows.numel(), device=source.geometry.device)
        map_batch(source, lambda t: t.index_select(0, index), in_place=False)
        for part in ("store", "ring", "geometry", "counters", "backend"):
            setattr(layer, part, getattr(source, part))
        layer.link.module = source.link.module
        layer.is_initialized = True
        mark_static_address(layer.tensors().values())
        _refresh_scratch(layer)
        source.reset()
        return
    gap = int(layer.counters.seen) - int(source.counters.seen)
    shift(layer if gap < 0 else source, abs(gap))
    mine = layer.tensors()
    for name, tensor in source.tensors().items():
        target = mine.get(name)
        if target is None or target.shape[1:] != tensor.shape[1:]:
            raise CacheStateError(f"layer {layer.layer_idx}: buffer {name} of the source does not match this cache's "
                                  "(another setting)")
        if name in ("finite", "consistent"):
            target &= tensor
        elif tensor.dim() and name != "seen":
            target.index_copy_(0, rows, tensor)
    source.reset()


def _refresh_scratch(layer) -> None:
    """A layer whose decode steps run the Triton op re-sizes that op's scratch for its new batch (eagerly, before a
    compiled step needs it)."""
    scratch = getattr(layer.backend, "scratch", None)
    if scratch is not None:
        layer.backend.scratch_for(layer, scratch.key[1])


def copy_row(source, row: int, target) -> bool:
    """Fill ``target`` (a layer holding nothing yet) with sequence ``row`` of ``source``, which is not changed (a
    row taken out of a batch, as `take_rows` puts one in; its positions stay in the batch's frame: `shift` them):
    every buffer copied, the store's slots narrowed or widened where the two settings differ in slots alone (a batch
    made for another length) and every slot dropped is empty.

    Returns:
        Whether it was copied (``False``: the buffers differ otherwise, or a dropped slot holds a token).
    """
    if not source.is_initialized or target.is_initialized:
        return False
    geometry = source.geometry
    empty = torch.empty(1, geometry.kv_heads, 0, geometry.head_dim, dtype=geometry.dtype, device=geometry.device)
    target.lazy_initialization(empty, empty)
    theirs, mine = source.tensors(), target.tensors()
    if theirs.keys() != mine.keys():
        return False
    held = theirs["store.positions"][row : row + 1]
    slots = mine["store.positions"].shape[2]
    if held.shape[2] > slots and bool((held[..., slots:] >= 0).any()):
        return False
    for name, tensor in theirs.items():
        part, into = (tensor[row : row + 1] if tensor.dim() else tensor), mine[name]
        if part.shape != into.shape:
            if not (name.startswith("store.") and part.dim() >= 3 and part.shape[:2] == into.shape[:2]
                    and part.shape[3:] == into.shape[3:]):
                return False
            width = min(part.shape[2], into.shape[2])
            part, into = part.narrow(2, 0, width), into.narrow(2, 0, width)
        into.copy_(part)
    return True
