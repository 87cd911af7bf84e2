"""The multi-token step of a [`CompressedLayer`][h2o_compress.cache.CompressedLayer]: prefill, chunked prefill, and a
saved prompt continued (eager; DESIGN.md §2 and §5).

`update` returns what the chunk's attention reads: the held tokens (store dequantized, ring oldest first)
followed by the chunk. `attend` runs SDPA over them with a mask from the slots' validity and the model's own
causal + padding mask of the chunk, sums the probabilities each held and new token received (the policy's
[`chunk_scores`][h2o_compress.policies.EvictionPolicy.chunk_scores]; for the default plain sum and a plain softmax, output and
sums come from one pass, `attention_with_sums`), and `evict_and_lay_out` keeps the top ``capacity`` by the
policy's priority, then lays the survivors out: the newest ``residual`` in the ring, the older ones quantized once
into empty slots (the store's [`place_tokens`][h2o_compress.cache.SlotStore.place_tokens]). The store's methods
([`SlotStore`][h2o_compress.cache.SlotStore] and the head-adaptive [`SlotPool`][h2o_compress.cache.SlotPool]:
``held``, ``head_positions``, ``head_scores``, ``keep``, ``keep_only``, ``place_tokens``) let head-adaptive and
mixed-precision stores share this code.
"""

from __future__ import annotations

import torch

from h2o_compress.attention.decode_step import per_kv_head
from h2o_compress.attention.interface import masked_attention
from h2o_compress.attention.prefill import attention_with_sums
from h2o_compress.utils.errors import CacheStateError, InputError
from h2o_compress.policies.base import NO_POSITION as NO_REAL_TOKEN
from h2o_compress.policies.base import EvictionPolicy
from h2o_compress.cache.refinement import stored_rank
from h2o_compress.cache.ring import held_positions
from h2o_compress.cache.setting import GROWTH
from h2o_compress.cache.slots import in_model_basis


def begin(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start a multi-token step of ``keys``/``values`` ``[batch, kv_heads, n, head_dim]`` in the model's basis and
    dtype: refuse non-finite ones, then `update` with them in the layer's storage bases.

    Raises:
        InputError: non-finite keys or values (a non-finite token would poison every later step).
    """
    if not bool(layer.counters.note_finite(keys, values)):
        raise InputError(f"layer {layer.layer_idx}: keys or values are not finite (NaN or Inf); check the inputs "
                         "and the model weights: a non-finite token would poison every later step")
    return update(layer, *layer.geometry.to_storage(keys, values))


def update(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Take a chunk's ``keys``/``values`` ``[batch, kv_heads, n, head_dim]`` (in the layer's bases and residual
    dtype); return what its attention reads, ``[batch, kv_heads, held + n, head_dim]`` in the model dtype: the held
    tokens (store dequantized, ring oldest first) followed by the chunk. A cache that holds nothing yet returns the
    chunk alone, exactly as DynamicCache would. Keeps the chunk in ``layer.chunk`` for `attend` (one host
    read of ``seen``: eager only)."""
    seen = int(layer.counters.seen)
    layer.chunk = {"seen": seen, "keys": keys, "values": values, "held": seen > 0}
    if layer.setting.growable:
        layer.counters.grown_to = seen + keys.shape[2]
    if not layer.chunk["held"]:
        return keys.to(layer.geometry.dtype), values.to(layer.geometry.dtype)
    held_keys, held_values = layer.store.held(layer.geometry.dtype, layer.geometry.kv_heads)
    used = layer.chunk["used"] = occupied_slots(layer.store)  # the empty slots after the last held are not read
    parts_k, parts_v = [held_keys[:, :, :used]], [held_values[:, :, :used]]
    if layer.ring is not None:
        order = layer.ring.order(seen)
        parts_k.append(layer.ring.keys.index_select(2, order).to(layer.geometry.dtype))
        parts_v.append(layer.ring.values.index_select(2, order).to(layer.geometry.dtype))
    parts_k.append(keys.to(layer.geometry.dtype))
    parts_v.append(values.to(layer.geometry.dtype))
    return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)


def occupied_slots(store) -> int:
    """The store's slots up to its last occupied one (by any sequence or KV head; one host read): a chunk's
    attention reads only those, so an unbounded or not yet full layer (a long prompt prefilled in chunks into a cache
    sized for all of it) attends over the tokens it holds, not over every slot, and a layer that never evicted reads
    its tokens exactly as transformers' ``DynamicCache`` holds them."""
    occupied = (store.head_positions() >= 0).flatten(0, 1).any(0)
    slot = torch.arange(1, occupied.shape[0] + 1, device=occupied.device)
    return int(torch.where(occupied, slot, 0).max()) if occupied.numel() else 0


def attend(layer, module, query, keys, values, attention_mask, scaling, variant=None, **kwargs) -> torch.Tensor:
    """SDPA of ``query`` ``[batch, q_heads, n, head_dim]`` over what `update` returned (``keys``/``values``)
    with a mask built from the slot validity, the layer's span (sliding window or chunk: each query sees only its
    own, [`visible`][h2o_compress.cache.LayerSpan.visible]) and the model's own causal + padding mask for the chunk
    (``attention_mask`` ``[batch | 1, 1, n, n]`` or ``None``); torch attention instead of SDPA for a softmax
    ``variant`` (soft-cap, sink logits: `masked_attention`); the probability sums
    for the scores; then the chunk's eviction and layout (`evict_and_lay_out`). Returns ``[batch, q_heads, n,
    head_dim]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    chunk, layer.chunk = layer.chunk, None
    n, batch = query.shape[2], query.shape[0]
    if layer.backend.name == "triton":  # the decode steps' scratch, allocated eagerly before a compiled step needs it
        layer.backend.scratch_for(layer, query.shape[1])
    new_block = attention_mask  # [batch | 1, 1, n, n] from sdpa_mask over the chunk's positions, or None
    if new_block is not None and new_block.dtype != torch.bool:
        new_block = new_block > torch.finfo(new_block.dtype).min / 2
    # n x n: built only where a mask is (a causal chunk with no padding mask and no window needs none)
    windowed = layer.setting.span.windowed
    eye = torch.eye(n, dtype=torch.bool, device=query.device) if new_block is not None or windowed else None
    real = torch.ones(batch, n, dtype=torch.bool, device=query.device)
    if new_block is not None:
        real = new_block[:, 0].diagonal(dim1=-2, dim2=-1).expand(batch, n)
        new_block = new_block | eye  # a padding query sees itself: no fully masked row
    span, seen = layer.setting.span, chunk["seen"]
    queries = torch.arange(seen, seen + n, device=query.device)
    first_real = torch.minimum(layer.counters.first_real, first_real_of(real, seen))
    if span.windowed:  # the chunk's own tokens beyond each query's window or chunk
        own = span.visible(queries.expand(batch, 1, n), queries, first_real)[:, 0] & eye.logical_not().tril()
        new_block = (own.unsqueeze(1) if new_block is None else new_block & own.unsqueeze(1)) | eye
    mask = new_block
    if chunk["held"]:
        mask = held_mask(layer, chunk, queries, first_real, new_block, batch)
    sums = None
    if one_pass(layer, query, keys, values, variant, kwargs):  # output and scores from one softmax
        output, sums = attention_with_sums(query, keys, values, mask, scaling)
    elif variant is None:
        group = query.shape[1] // layer.geometry.kv_heads
        sdpa_mask = mask if mask is None or mask.shape[1] == 1 else mask.repeat_interleave(group, dim=1)
        kwargs.pop("sliding_window", None)  # the mask holds the window
        output, _ = sdpa_attention_forward(as_keys_group(module, query, keys), query, keys, values, sdpa_mask,
                                           scaling=scaling, **kwargs)
    else:
        visible = mask if mask is not None else torch.ones(1, 1, n, n, dtype=torch.bool, device=query.device).tril()
        output = masked_attention(query, keys, values, visible, scaling, variant)
        output = output.transpose(1, 2)
    if layer.setting.with_scores and sums is None:
        setting = layer.setting
        sums = per_kv_head(setting.policy.chunk_scores(query, keys, mask, scaling, setting.score_chunk_size, variant),
                           layer.geometry.kv_heads)
    evict_and_lay_out(layer, chunk, real, with_unread_slots(sums, chunk, layer.store.slots))
    return output.transpose(1, 2)


def held_mask(layer, chunk: dict, queries: torch.Tensor, first_real: torch.Tensor, new_block: torch.Tensor | None,
              batch: int) -> torch.Tensor:
    """What the chunk's queries see, bool ``[batch, kv_heads | 1, n, used + ring + n]``: the held tokens that are
    valid (and inside each query's span), then the chunk's own block (``new_block``, or causal). ``1`` head where every
    KV head holds the same positions (a layer that has not evicted yet): one mask, not one per head, so SDPA reads
    it broadcast as transformers' own mask (no copy per query head)."""
    n, seen, span = queries.shape[0], chunk["seen"], layer.setting.span
    order = None if layer.ring is None else layer.ring.order(seen)
    held = held_positions(layer.store, layer.ring, layer.geometry.kv_heads, order)
    held = torch.cat((held[..., : chunk["used"]], held[..., layer.store.slots :]), dim=2)  # as `update` cut it
    if held.shape[1] > 1 and torch.equal(held, held[:, :1].expand_as(held)):
        held = held[:, :1]
    held_valid = (held >= 0).unsqueeze(2).expand(-1, -1, n, -1)
    if span.windowed:
        held_valid = held_valid & span.visible(held, queries, first_real)
    causal = torch.ones(n, n, dtype=torch.bool, device=queries.device).tril() if new_block is None else new_block
    return torch.cat((held_valid, causal.expand(batch, held.shape[1], n, n)), dim=3)


def with_unread_slots(sums: torch.Tensor | None, chunk: dict, slots: int) -> torch.Tensor | None:
    """The probability sums fp32 ``[batch, kv_heads, used + ring + n]`` of a chunk whose attention read the store's
    first ``used`` slots only (`occupied_slots`), laid out over all ``slots`` again: the empty ones unread get 0."""
    if sums is None or not chunk["held"] or chunk["used"] >= slots:
        return sums
    cut = chunk["used"]
    return torch.cat((sums[..., :cut], sums.new_zeros(*sums.shape[:2], slots - cut), sums[..., cut:]), dim=2)


class _KeysGroup:
    """What transformers' SDPA reads of an attention module (``num_key_value_groups``, ``is_causal``,
    ``layer_idx``), with the query heads per key head that the tensors have."""

    def __init__(self, module, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = getattr(module, "is_causal", True)
        self.layer_idx = getattr(module, "layer_idx", None)


def as_keys_group(module, query: torch.Tensor, keys: torch.Tensor):
    """``module``, or what SDPA reads of it with the KV groups of the tensors (``query`` ``[batch, q_heads, n,
    head_dim]``, ``keys`` ``[batch, heads, n, head_dim]``) where the module declares others: a multi-head latent
    attention module expands its cached latents into a key per query head, while its config may give fewer
    ``num_key_value_heads`` (DeepSeek-V2/V3 in transformers then repeats the expanded keys again and fails with any
    cache; the query heads attend their own keys, as flash attention runs it); a module that tiles its KV heads
    itself (JetMoE) declares one group, and the attention function hands the untiled heads here."""
    groups = query.shape[1] // keys.shape[1]
    if getattr(module, "num_key_value_groups", 1) != groups:
        return _KeysGroup(module, groups)
    return module


def one_pass(layer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, variant, kwargs: dict) -> bool:
    """Whether `attend` takes the output and the scores from one softmax
    (`attention_with_sums`): a scored layer whose policy keeps the default
    [`chunk_scores`][h2o_compress.policies.EvictionPolicy.chunk_scores] (the plain sum of every query's probabilities), a
    plain softmax (no ``variant``), one key per KV head (not a latent expanded per query head), no dropout, nothing
    that autograd tracks (the one pass writes in place)."""
    if torch.is_grad_enabled() and (query.requires_grad or keys.requires_grad or values.requires_grad):
        return False
    return (layer.setting.with_scores and variant is None and not kwargs.get("dropout")
            and type(layer.setting.policy).chunk_scores is EvictionPolicy.chunk_scores
            and keys.shape[1] == layer.geometry.kv_heads)


def evict_and_lay_out(layer, chunk: dict, real: torch.Tensor, sums: torch.Tensor | None) -> None:
    """Evict down to the capacity over (store, ring, chunk) by the policy's priority, then lay the survivors
    out: the newest ``residual`` tokens in the ring, older kept ones from the ring and the chunk quantized
    once into empty slots. ``real`` bool ``[batch, n]``: chunk tokens that are not padding."""
    seen, keys, values = chunk["seen"], chunk["keys"], chunk["values"]
    n, slots, size = keys.shape[2], layer.store.slots, layer.setting.residual
    device, heads = layer.geometry.device, layer.geometry.kv_heads
    new_positions = torch.where(real, torch.arange(seen, seen + n, device=device), -1)
    tail_keys, tail_values, tail_positions = keys, values, new_positions
    tail_scores = torch.zeros(layer.geometry.batch, heads, n, device=device) if layer.setting.with_scores else None
    if layer.ring is not None:
        order = layer.ring.order(seen)
        tail_keys = torch.cat((layer.ring.keys.index_select(2, order), keys), dim=2)
        tail_values = torch.cat((layer.ring.values.index_select(2, order), values), dim=2)
        tail_positions = torch.cat((layer.ring.positions.index_select(1, order).long(), new_positions), dim=1)
        if layer.setting.with_scores:
            tail_scores = torch.cat((layer.ring.scores.index_select(2, order), tail_scores), dim=2)
    positions = torch.cat((layer.store.head_positions().long(), tail_positions.unsqueeze(1).expand(-1, heads, -1)), 2)
    scores = None
    if layer.setting.with_scores:
        scores = torch.cat((layer.store.head_scores(), tail_scores), dim=2)
        covered = scores[..., scores.shape[2] - sums.shape[2] :]
        decay = layer.setting.policy.score_decay
        if 0.0 < decay < 1.0:  # A2SF: what was held fades over the chunk's n queries (its own are weighted)
            scores.mul_(decay**n)
        covered.add_(sums) if layer.setting.policy.accumulates else covered.copy_(sums)
    seen += n
    layer.counters.first_real.copy_(torch.minimum(layer.counters.first_real, first_real_of(real, chunk["seen"])))
    # what the next query (at `seen`) cannot see leaves a sliding or chunked layer, whatever its score
    layer.setting.span.expire(positions, torch.tensor(seen, device=device), layer.counters.first_real)
    if layer.setting.evicts:
        norms = None
        if layer.setting.policy.weighs_values:  # VATP: the store's norms, the ring's and the chunk's tokens as they are
            tail_norms = layer.setting.policy.value_weight(in_model_basis(tail_values, layer.geometry.value_basis))
            norms = torch.cat((layer.store.head_value_norms(), tail_norms), dim=2)
        priority = layer.setting.policy.priority(scores, positions, seen, layer.counters.first_real,
                                                 layer.setting.capacity, norms)
        keep = layer.store.keep(priority, positions, layer.setting.capacity)
    else:
        keep = positions >= 0
    layer.store.keep_only(keep[..., :slots], scores[..., :slots] if layer.setting.with_scores else None)
    if layer.setting.with_scores:
        tail_scores = scores[..., slots:]
    if layer.ring is not None:  # the newest `size` positions, all inside the recent window
        ring_positions = torch.where(keep[:, 0, -size:], tail_positions[:, -size:], -1)
        layer.ring.write(
            tail_keys[:, :, -size:], tail_values[:, :, -size:], ring_positions,
            None if tail_scores is None else tail_scores[..., -size:], seen,
        )
    layer.store.place_tokens(keep[..., slots : slots + n], tail_keys[:, :, :n], tail_values[:, :, :n],
                             tail_positions[:, :n], None if tail_scores is None else tail_scores[..., :n],
                             lambda: stored_rank(layer.setting.policy, layer.store, layer.counters.seen),
                             lambda n: make_room(layer, n))
    layer.counters.seen.fill_(seen)


def fill(layer, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, q_heads: int) -> None:
    """Lay a whole prompt read by another cache into the empty ``layer``: its ``keys``/``values`` ``[batch,
    kv_heads, tokens, head_dim]`` (model basis and dtype, no padding), ranked by ``scores`` fp32 ``[batch, kv_heads,
    tokens]`` and evicted to the capacity once, as `evict_and_lay_out` does after a multi-token step; no attention runs (the
    reading pass gave the prompt's output). ``q_heads``: the model's query heads (the Triton decode scratch).

    Raises:
        CacheStateError: the layer already holds tokens.
        InputError: non-finite keys or values.
    """
    if layer.is_initialized and int(layer.counters.seen):
        raise CacheStateError(f"layer {layer.layer_idx}: a prompt is laid only into an empty layer")
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    begin(layer, keys, values)
    chunk, layer.chunk = layer.chunk, None
    if layer.backend.name == "triton":
        layer.backend.scratch_for(layer, q_heads)
    real = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
    evict_and_lay_out(layer, chunk, real, scores.to(device=keys.device, dtype=torch.float32) if layer.setting.with_scores else None)


def first_real_of(real: torch.Tensor, seen: int) -> torch.Tensor:
    """int64 ``[batch]``: the position of each sequence's first real token in a chunk starting at ``seen`` (bool
    ``real`` ``[batch, n]``: not padding), `NO_REAL_TOKEN` for a chunk of padding only."""
    return torch.where(real.any(1), real.to(torch.uint8).argmax(1) + seen, NO_REAL_TOKEN)


def make_room(layer, tokens: int) -> None:
    """A chunk brings ``tokens`` more than a row of the store has room for: an unbounded cache of unknown length
    grows (eager only).

    Raises:
        CacheStateError: any other cache (it was built for fewer tokens).
    """
    if not layer.setting.growable:
        raise CacheStateError(f"layer {layer.layer_idx}: more tokens than the cache was built for (max_length="
                              f"{layer.setting.max_tokens}); build the cache with the full length (prompt + new tokens)")
    layer.store.resize(layer.store.slots + tokens + GROWTH)
