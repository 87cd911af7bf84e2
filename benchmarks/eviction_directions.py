"""Directions the field has taken for streaming quality per byte, measured rather than assumed (issue 35).

    python benchmarks/eviction_directions.py --phase choose      # the tuning text only: picks each direction's option
    python benchmarks/eviction_directions.py --phase report      # the reporting corpus, with what `choose` picked

A reference simulation, independent of the library's cache: SmolLM2 reads a text token by token (the exact
decode semantics of ``eval perplexity --chunk-size 1``) through a plain ``DynamicCache`` that holds every token,
with an attention function (registered through transformers' ``AttentionInterface``) that hides the evicted
tokens of each KV head behind a mask and changes the held keys and values in place where a direction says so.
It is slow and holds the whole cache, but each direction is a few lines, and the ``h2o`` row (the same capacity,
heavy/recent split and tie rule as :class:`h2o_compress.policies.H2OPolicy`) and the ``token int4`` row (per-token
groups of 32 with the Hadamard rotation, fp16 scales and zeros, as ``quant="int"``) are checked against the
library's own figures, printed beside them.

Eviction directions (16-bit, so only the ranking differs), each ranking the tokens outside the recent window:

- ``h2o``: accumulated attention (Zhang et al. 2023, arXiv 2306.14048 §4).
- ``vatp``: accumulated attention x the L1 norm of the token's value (Guo et al. 2024, "Attention score is not all
  you need for token importance indicator in KV cache reduction: value also matters", arXiv 2406.12335 §3).
- ``keydiff``: query-agnostic; keeps the keys least similar (cosine) to the mean of the held normalised keys
  (Park et al. 2025, arXiv 2504.15364 §3).
- ``oracle`` (a bound, not a policy): ranks by the attention each token will receive from the queries still to come
  in the uncompressed model (known only afterwards). What no ranking of single tokens at this budget is likely to
  beat; where it misses a target, no eviction policy is expected to meet it.
- ``window W``: the attention a token got from the last W queries (predicting the next queries by the latest; W = 1
  is TOVA's rule, Oren et al. 2024, arXiv 2401.06104).
- ``ema-query b``: the attention a forecast query, the running mean of the queries (decay ``b``), would give each
  held token now: a stand-in for the oracle's future queries.
- ``expected-attention n F`` (training-free): the attention the future queries are expected to give each held
  token, the queries of each query head modelled as a Gaussian (mean and covariance of the pre-RoPE queries of the
  last ``n`` tokens, the first :data:`EA_SINK` excluded, recomputed at each eviction), the RoPE rotation averaged over
  the next ``F`` positions, in closed form ``exp(mu.k / sqrt(d) + k^T Sigma k / 2d)`` normalised over the held keys
  (a softmax), averaged over the query heads of the KV head and multiplied by the value's L2 norm (``no-vnorm``:
  not); the first :data:`EA_SINK` tokens are never evicted (Devoto et al. 2025, arXiv 2510.00636; kvpress's
  ``ExpectedAttentionPress`` with its defaults ``n_sink=4``, ``n_future_positions=512``, ``use_covariance``,
  ``use_vnorm``, ``epsilon=0``, but the future positions counted from the current one, where the decoding press
  counts them from the length of its buffer). ``expected-attention calibrated F``: the mean and covariance measured
  once, per layer and query head, over the first :data:`EA_CALIBRATION` tokens of the tuning text (kvpress's
  ``ExpectedAttentionStatsPress``, which measures them on booksum), not over the recent queries. Their choose run
  reads the tuning text from ``--start 4096`` on, past those tokens; ``chosen`` records the lowest mean ratio of each.
- ``merge``: ``h2o``, and the evicted token's value is merged into the held token whose key is most similar
  (cosine) when that similarity is at least ``tau``, weighted by the two tokens' accumulated attention
  (D2O, Wan et al. 2024, arXiv 2406.13035 §3.2, token-level merging; CaM, Zhang et al. ICML 2024, merges values
  only, as here). ``tau`` is chosen on the tuning text.

Quantization direction (budget 1.0 and with ``h2o``): ``kivi int4``: keys quantized per channel over groups of
32 tokens, values per token (Liu et al. 2024, KIVI, arXiv 2402.02750 §3), the same bytes as per-token groups of 32
(one fp16 scale and zero per 32 elements). A group of keys is quantized once its 32 tokens are all at least
``residual`` tokens old; younger tokens stay in full precision. ``shift int4``: per-token groups as ``token int4``
(Hadamard-rotated), of the keys minus a per-channel offset (each KV head's mean key over the first
:data:`CALIBRATION` tokens, fixed from then on; until then the tokens wait in full precision), added back after
dequantizing: the channel bias that makes KIVI quantize keys per channel, removed with one vector per head.
``smooth int4``: also divided per channel by those tokens' largest deviation (multiplied back after).

Writes ``--out`` (JSON, every row) and the same path with ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache

from h2o_compress import CompressionConfig, load_model, make_cache
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, load_text, tokenize_text
from h2o_compress.evaluation.perplexity import streaming_perplexity
from h2o_compress.formats.integer import hadamard_matrix

GROUP = 32  # elements (or tokens, per channel) sharing one fp16 scale and zero
RESIDUAL = 4  # newest tokens kept in full precision (the library's window holds 4..7 at residual=3)
CALIBRATION = 32  # tokens whose keys set the per-channel offset (and scale) of ``shift``/``smooth``


def quantize_in_range(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int = 4,
                      floor: float = 1e-8) -> torch.Tensor:
    """``x`` rounded to the ``bits``-bit grid from ``low`` to ``high`` (broadcast against it), fp16 scale (at least
    ``floor`` before the fp16 cast) and zero, dequantized in x's dtype."""
    scale = ((high - low) / (2**bits - 1)).clamp(min=floor).half().float()
    zero = low.half().float()
    return ((x.float() - zero) / scale).round().clamp(0, 2**bits - 1).mul(scale).add(zero).to(x.dtype)


def fake_quantize(x: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """Asymmetric round-to-nearest over ``dim`` (a group), fp16 scale and zero, dequantized in x's dtype."""
    return quantize_in_range(x, x.amin(dim, keepdim=True), x.amax(dim, keepdim=True), bits)


def per_token(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``x [..., tokens, head_dim]`` quantized per token in groups of :data:`GROUP` elements (rotated first)."""
    y = x @ rotation if rotation is not None else x
    shape = y.shape
    y = fake_quantize(y.reshape(*shape[:-1], shape[-1] // GROUP, GROUP), -1).reshape(shape)
    return y @ rotation.T if rotation is not None else y


@dataclass
class Direction:
    """One setting of the simulation: how tokens are ranked, merged and quantized."""

    name: str
    rank: str = "h2o"  # h2o | vatp | keydiff | oracle | full
    merge_tau: float | None = None
    quant: str = "none"  # none | token | kivi | slots | shift | smooth
    options: dict = field(default_factory=dict)


class Simulation:
    """Per-layer state of one streamed text: which tokens each KV head holds and their accumulated attention."""

    def __init__(self, direction: Direction, layers: int, kv_heads: int, tokens: int, capacity: int, recent: int,
                 head_dim: int):
        self.d, self.capacity, self.recent = direction, capacity, recent
        # ``expected-attention``: each layer's pre-RoPE queries of the last n tokens (a ring [n, q_heads, D]); the
        # model's rotary embedding, and (``calibrated``) fixed statistics, are set by :func:`simulate`
        self.recent_queries: dict[int, torch.Tensor] = {}
        self.rotary = None
        self.statistics: tuple[torch.Tensor, torch.Tensor] | None = None  # mean [layers, q_heads, D], cov [.., D, D]
        self.future_rotation: tuple[int, torch.Tensor] | None = None  # (n, the averaged rotation [D, D])
        self.held = torch.zeros(layers, kv_heads, tokens, dtype=torch.bool)
        self.scores = torch.zeros(layers, kv_heads, tokens)
        self.quantized = torch.zeros(layers, dtype=torch.long)  # tokens (per layer) already quantized
        self.rotation = hadamard_matrix(head_dim) if direction.quant in ("token", "shift", "smooth") else None
        self.offsets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer: (offset, scale) [kv_heads, 1, D]
        self.value_rotation = hadamard_matrix(head_dim) if direction.quant != "none" else None
        blocks = math.ceil(capacity / GROUP)
        # ``slots``: where each quantized token sits ([layers, kv_heads, tokens], -1 = none), which token each slot
        # holds ([layers, kv_heads, blocks * GROUP], -1 = free) and each block's per-channel range [.., blocks, D]
        self.slot_of = torch.full((layers, kv_heads, tokens), -1, dtype=torch.long)
        self.token_in = torch.full((layers, kv_heads, blocks * GROUP), -1, dtype=torch.long)
        self.low = torch.full((layers, kv_heads, blocks, head_dim), float("inf"))
        self.high = torch.full((layers, kv_heads, blocks, head_dim), float("-inf"))
        # ``window``: each layer's last W queries' probabilities (a ring); ``ema-query``: each layer's running mean
        # query and the attention it gives the held tokens now; ``oracle``: set by :func:`simulate`
        window = direction.options.get("window", 0)
        self.history = torch.zeros(layers, window, kv_heads, tokens) if direction.rank == "window" else None
        self.mean_query: dict[int, torch.Tensor] = {}
        self.forecast: torch.Tensor | None = None
        self.future: list[torch.Tensor] = []

    def quantize(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """In place: the tokens that have left the residual window are replaced by their dequantized form."""
        n, done = keys.shape[1], int(self.quantized[layer])
        if self.d.quant == "token":
            upto = n - RESIDUAL
            if upto > done:
                keys[:, done:upto] = per_token(keys[:, done:upto], self.rotation)
                values[:, done:upto] = per_token(values[:, done:upto], self.value_rotation)
                self.quantized[layer] = upto
        elif self.d.quant in ("shift", "smooth"):
            upto, calibration = n - RESIDUAL, self.d.options.get("calibration", CALIBRATION)
            if upto < calibration:
                return
            if layer not in self.offsets:
                first = keys[:, :calibration].float()
                offset = first.mean(1, keepdim=True)
                scale = ((first - offset).abs().amax(1, keepdim=True).clamp(min=1e-3) if self.d.quant == "smooth"
                         else torch.ones_like(offset))
                self.offsets[layer] = (offset, scale)
            offset, scale = self.offsets[layer]
            if upto > done:
                shifted = (keys[:, done:upto].float() - offset) / scale
                keys[:, done:upto] = (per_token(shifted, self.rotation) * scale + offset).to(keys.dtype)
                values[:, done:upto] = per_token(values[:, done:upto], self.value_rotation)
                self.quantized[layer] = upto
        elif self.d.quant == "kivi":
            while n - RESIDUAL >= done + GROUP:  # a whole group of keys, per channel over its 32 tokens
                keys[:, done : done + GROUP] = fake_quantize(keys[:, done : done + GROUP], 1)
                values[:, done : done + GROUP] = per_token(values[:, done : done + GROUP], self.value_rotation)
                done += GROUP
            self.quantized[layer] = done
        elif self.d.quant == "slots":
            for t in range(done, n - RESIDUAL):
                values[:, t : t + 1] = per_token(values[:, t : t + 1], self.value_rotation)
                for h in range(keys.shape[0]):
                    if self.held[layer, h, t]:
                        self.place(layer, h, t, keys[h])
            self.quantized[layer] = max(done, n - RESIDUAL)

    def place(self, layer: int, head: int, token: int, keys: torch.Tensor) -> None:
        """``slots``: quantize ``token``'s key into the lowest free slot; its block's per-channel range only grows,
        and when it grows the block's held keys are re-quantized (from their stored, dequantized form)."""
        slot = int((self.token_in[layer, head] < 0).nonzero()[0])
        block = slot // GROUP
        self.token_in[layer, head, slot], self.slot_of[layer, head, token] = token, slot
        key = keys[token].float()
        low, high = self.low[layer, head, block], self.high[layer, head, block]
        new_low, new_high = torch.minimum(low, key), torch.maximum(high, key)
        if bool((new_low < low).any() or (new_high > high).any()):
            members = self.token_in[layer, head, block * GROUP : (block + 1) * GROUP]
            members = members[members >= 0]
        else:
            members = torch.tensor([token])
        self.low[layer, head, block], self.high[layer, head, block] = new_low, new_high
        # floor 1e-6: a block's first key has a zero range, and 1e-8 rounds to an fp16 0 (0 / 0)
        keys[members] = quantize_in_range(keys[members], new_low, new_high, floor=1e-6)

    def priority(self, layer: int, keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
        """``[kv_heads, n]`` fp32, higher = kept longer."""
        scores = self.scores[layer, :, :n]
        if self.d.rank == "window":
            return self.history[layer, :, :, :n].sum(0)
        if self.d.rank == "ema-query":
            return self.forecast.clone()
        if self.d.rank == "expected-attention":
            return self.expected_attention(layer, keys, values, n)
        if self.d.rank == "oracle":  # the attention each token will get from the queries still to come
            future = self.future[layer]
            return future[:, n, :n].clone() if n < future.shape[1] else torch.zeros_like(scores)
        if self.d.rank == "vatp":
            return scores * values.float().abs().sum(-1)
        if self.d.rank == "vatp-l2":  # the L2 norm: the same in any orthonormal basis (a Hadamard-rotated store)
            return scores * values.float().norm(dim=-1)
        if self.d.rank == "keydiff":
            unit = torch.nn.functional.normalize(keys.float(), dim=-1)
            held = self.held[layer, :, :n].unsqueeze(-1)
            anchor = (unit * held).sum(1, keepdim=True) / held.sum(1, keepdim=True).clamp(min=1)
            return -torch.nn.functional.cosine_similarity(unit, anchor, dim=-1)
        return scores.clone()

    def rope_rotation(self, position: int, count: int = 1) -> torch.Tensor:
        """The RoPE rotation matrix ``[D, D]`` of ``position``, averaged over ``count`` positions from it
        (kvpress's ``apply_avg_rope``: ``R = cos I + sin P``, ``P`` the matrix of ``rotate_half``)."""
        positions = torch.arange(position, position + count).unsqueeze(0)
        inv = self.rotary.inv_freq
        cos, sin = self.rotary(inv.new_zeros(1), positions)
        cos, sin = cos[0].float().mean(0), sin[0].float().mean(0)
        half = cos.shape[0] // 2
        turn = torch.zeros(2 * half, 2 * half)
        turn[half:, :half], turn[:half, half:] = torch.eye(half), -torch.eye(half)
        return torch.diag(cos) + sin.unsqueeze(1) * turn

    def expected_attention(self, layer: int, keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
        """``expected-attention``: the priority ``[kv_heads, n]`` (the held tokens' entries; sinks infinite)."""
        kv_heads, head_dim = keys.shape[0], keys.shape[-1]
        if self.statistics is not None:
            mean, cov = self.statistics[0][layer], self.statistics[1][layer]
        else:  # the last n queries (the first EA_SINK tokens' excluded), kvpress's biased covariance
            ring, window = self.recent_queries[layer], self.d.options["window"]
            recent = ring[torch.arange(max(EA_SINK, n - window), n) % window]  # [m, q_heads, D]
            mean = recent.mean(0)
            centred = recent - mean
            cov = torch.einsum("mhi,mhj->hij", centred, centred) / recent.shape[0]
        if self.future_rotation is None or self.future_rotation[0] != n:  # the same for every layer of a step
            self.future_rotation = (n, self.rope_rotation(n, self.d.options["future"]))
        rotation = self.future_rotation[1]
        mean = (mean @ rotation.T).view(kv_heads, -1, head_dim)
        cov = (rotation @ cov @ rotation.T).view(kv_heads, -1, head_dim, head_dim)
        held = self.held[layer, :, :n]
        index = held.nonzero()[:, 1].view(kv_heads, -1)  # every KV head holds as many tokens
        k = keys.float().gather(1, index.unsqueeze(-1).expand(-1, -1, head_dim))
        logits = (torch.einsum("hgd,hmd->hgm", mean, k) / math.sqrt(head_dim)
                  + torch.einsum("hmi,hgij,hmj->hgm", k, cov, k) / head_dim / 2)
        scores = logits.softmax(-1).mean(1)
        if self.d.options.get("vnorm", True):
            v = values.float().gather(1, index.unsqueeze(-1).expand(-1, -1, head_dim))
            scores = (scores + self.d.options.get("epsilon", 0.0)) * v.norm(dim=-1)
        priority = torch.zeros(kv_heads, n).scatter(1, index, scores)
        priority[:, :EA_SINK] = float("inf")
        return priority

    def evict(self, layer: int, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        held = self.held[layer, :, :n]
        if self.d.rank == "full" or int(held[0].sum()) <= self.capacity:
            return
        priority = self.priority(layer, keys, values, n)
        priority[:, max(0, n - self.recent) :] = float("inf")
        priority = priority.masked_fill(~held, float("inf"))
        # lowest priority goes; among ties the newest goes (ties keep the older token, as keep_top)
        flipped = priority.flip(-1)
        victim = n - 1 - flipped.argmin(-1)
        heads = torch.arange(held.shape[0])
        held[heads, victim] = False
        if self.d.quant == "slots":
            for h, t in enumerate(victim.tolist()):
                slot = int(self.slot_of[layer, h, t])
                if slot >= 0:
                    self.token_in[layer, h, slot] = -1
        if self.d.merge_tau is not None:
            self.merge(layer, keys, values, n, victim)

    def merge(self, layer: int, keys, values, n: int, victim: torch.Tensor) -> None:
        heads = torch.arange(keys.shape[0])
        unit = torch.nn.functional.normalize(keys[:, :n].float(), dim=-1)
        similarity = (unit * unit[heads, victim].unsqueeze(1)).sum(-1)
        similarity = similarity.masked_fill(~self.held[layer, :, :n], -2.0)
        best = similarity.argmax(-1)
        for h in range(keys.shape[0]):
            if similarity[h, best[h]] >= self.d.merge_tau:
                a, b = self.scores[layer, h, best[h]], self.scores[layer, h, victim[h]]
                weight = b / (a + b).clamp(min=1e-12)
                values[h, best[h]] = (1 - weight) * values[h, best[h]] + weight * values[h, victim[h]]
                self.scores[layer, h, best[h]] = a + b

    def attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """transformers' attention function signature; one query token, batch 1."""
        layer = module.layer_idx
        kv_heads, n, head_dim = key.shape[1], key.shape[2], key.shape[3]
        group = query.shape[1] // kv_heads
        keys, values = key[0], value[0]  # the DynamicCache's own tensors: in-place edits persist
        self.held[layer, :, n - 1] = True
        if self.d.quant != "none":
            self.quantize(layer, keys, values)
        q = query[0, :, -1].view(kv_heads, group, head_dim).float()
        scale = scaling if scaling is not None else head_dim**-0.5
        logits = torch.einsum("hgd,hnd->hgn", q, keys.float()) * scale
        logits = logits.masked_fill(~self.held[layer, :, None, :n], float("-inf"))
        probs = logits.softmax(-1)
        output = torch.einsum("hgn,hnd->hgd", probs, values.float()).to(query.dtype)
        self.scores[layer, :, :n] += probs.sum(1)
        if self.d.rank == "window":  # each query's probabilities, the last ``window`` of them
            ring = n % self.history.shape[1]
            self.history[layer, ring].zero_()
            self.history[layer, ring, :, :n] = probs.sum(1)
        elif self.d.rank == "ema-query":  # a forecast of the next queries: their running mean
            beta = self.d.options["beta"]
            previous = self.mean_query.get(layer)
            mean = q if previous is None else beta * previous + (1 - beta) * q
            self.mean_query[layer] = mean
            forecast = (torch.einsum("hgd,hnd->hgn", mean, keys.float()) * scale)
            self.forecast = forecast.masked_fill(~self.held[layer, :, None, :n], float("-inf")).softmax(-1).sum(1)
        elif self.d.rank == "expected-attention" and self.statistics is None:  # the pre-RoPE query, kept
            window = self.d.options["window"]
            ring = self.recent_queries.setdefault(layer, torch.zeros(window, kv_heads * group, head_dim))
            ring[(n - 1) % window] = q.reshape(-1, head_dim) @ self.rope_rotation(n - 1)  # R^T: the inverse rotation
        self.evict(layer, keys, values, n)
        return output.reshape(1, 1, kv_heads * group, head_dim), None


@torch.inference_mode()
def simulate(model, ids: torch.Tensor, direction: Direction, capacity: int, recent: int,
             simulation: type = Simulation) -> float:
    """Perplexity of ``ids [1, tokens]`` read token by token through ``simulation`` (a :class:`Simulation` or a
    subclass taking the same arguments)."""
    cfg = model.config
    heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sim = simulation(direction, cfg.num_hidden_layers, heads, ids.shape[1], capacity, recent, head_dim)
    if direction.rank == "oracle":
        sim.future = future_attention(model, ids)
    if direction.rank == "expected-attention":
        sim.rotary = model.model.rotary_emb
        sim.statistics = direction.options.get("statistics")
    AttentionInterface.register("eviction_directions", sim.attend)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eviction_directions")
    try:
        cache, nll = DynamicCache(config=cfg), 0.0
        for t in range(ids.shape[1] - 1):
            logits = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
            nll -= torch.log_softmax(logits.float(), -1)[ids[0, t + 1]].item()
    finally:
        model.set_attn_implementation(previous)
    return math.exp(nll / (ids.shape[1] - 1))


@torch.inference_mode()
def future_attention(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, fp32 ``[kv_heads, tokens + 1, tokens]``: ``[h, i, j]`` is the attention key ``j`` gets from the
    queries ``i, i + 1, ...`` of the uncompressed model (probabilities summed over the query heads of KV head ``h``;
    row ``tokens`` is 0). The ``oracle`` ranking reads it: a bound on what ranking tokens can give, not a policy."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        attentions = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    future, heads = [], model.config.num_key_value_heads
    for a in attentions:  # [1, q_heads, tokens, tokens]
        a = a[0].float().unflatten(0, (heads, -1)).sum(1)  # [kv_heads, tokens, tokens]
        suffix = a.flip(1).cumsum(1).flip(1)
        future.append(torch.cat((suffix, torch.zeros_like(suffix[:, :1])), 1))
    return future


@torch.inference_mode()
def query_statistics(model, ids: torch.Tensor, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``expected-attention calibrated``: per layer, the mean ``[q_heads, D]`` and covariance ``[q_heads, D, D]``
    (over tokens, ``N - 1``, as kvpress's ``collect_queries``) of the pre-RoPE queries (``q_proj``'s output) of
    the uncompressed model reading ``ids`` at once, the first ``sink`` tokens' excluded."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    captured: list[torch.Tensor] = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: captured.append(o[0, sink:].float()))
             for layer in model.model.layers]
    try:
        model(input_ids=ids)
    finally:
        for hook in hooks:
            hook.remove()
    means, covs = [], []
    for q in captured:  # [tokens, q_heads * D]
        q = q.view(q.shape[0], -1, head_dim).transpose(0, 1)  # [q_heads, tokens, D]
        mean = q.mean(1)
        centred = q - mean.unsqueeze(1)
        means.append(mean)
        covs.append(centred.transpose(1, 2) @ centred / (q.shape[1] - 1))
    return torch.stack(means), torch.stack(covs)


#: The eviction directions without an option; ``merge`` is added once per threshold (:data:`TAUS`, or the chosen one).
DIRECTIONS = (Direction("h2o"), Direction("vatp", rank="vatp"), Direction("vatp-l2", rank="vatp-l2"),
              Direction("keydiff", rank="keydiff"))
TAUS = (0.5, 0.7, 0.9)
WINDOWS = (1, 8, 32)  # ``window W``: attention from the last W queries (W = 1: TOVA's rule)
BETAS = (0.9, 0.99)  # ``ema-query b``: the attention a running mean of the queries (decay b) would give
EA_SINK = 4  # kvpress's n_sink: never evicted, and their queries left out of the statistics
EA_CALIBRATION = 4096  # ``expected-attention calibrated``: tokens of the tuning text the statistics are measured on
#: ``expected-attention``: (recent queries n, future positions F, value norm), kvpress's default (F 512, the value
#: norm) and one change at a time; ``calibrated``: (None, F, value norm)
EA_VARIANTS = ((128, 512, True), (64, 512, True), (128, 256, True), (128, 512, False), (None, 512, True),
               (None, 256, True))


def expected_attention_direction(window: int | None, future: int, vnorm: bool) -> Direction:
    name = f"expected-attention {window if window else 'calibrated'} {future}" + ("" if vnorm else " no-vnorm")
    return Direction(name, rank="expected-attention",
                     options={"window": window, "future": future, "vnorm": vnorm, "calibrated": window is None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=("choose", "report"), required=True,
                        help="choose: the tuning text only; report: the reporting corpus with the chosen options")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budgets", default="0.2,0.1")
    parser.add_argument("--rows", default="", help="comma-separated subset of row names (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--texts", default="", help="report phase: a subset of the reporting texts")
    parser.add_argument("--start", type=int, default=0,
                        help="choose phase: the first token of the tuning text read (4096: past the tokens "
                             "``expected-attention calibrated`` measures its statistics on)")
    parser.add_argument("--chosen", default="benchmarks/results/eviction_directions_choose.json")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out or f"benchmarks/results/eviction_directions_{args.phase}.json")
    command = "python benchmarks/eviction_directions.py " + shlex.join(sys.argv[1:])
    if args.phase == "choose":
        texts, tau = ["sherlock"], None  # the tuning text (TUNING_TEXT) by its name
        if args.start:
            texts = [f"sherlock {args.start}-{args.start + args.tokens - 1}"]
    else:
        texts = [t for t in (args.texts.split(",") if args.texts else REPORTING_TEXTS) if t]
        unknown = [t for t in texts if t not in REPORTING_TEXTS]
        if unknown:
            parser.error(f"--texts {unknown}: the report phase reads only the reporting corpus {REPORTING_TEXTS}")
        tau = json.loads(Path(args.chosen).read_text())["chosen"]["merge_tau"]
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    wanted = set(args.rows.split(",")) - {""}
    statistics = None  # ``expected-attention calibrated``'s, measured when a row first needs them
    for text in texts:
        if text.startswith("sherlock "):  # tokens start.. of the tuning text
            ids = tokenize_text(tokenizer, load_text("sherlock"), args.start + args.tokens)[:, args.start :]
        else:
            ids = tokenize_text(tokenizer, load_text(text), args.tokens)
        plan = [(1.0, "library full", CompressionConfig(policy="full")),
                (1.0, "library token int4", CompressionConfig(kv_bits=4)),
                (1.0, "token int4", Direction("token int4", rank="full", quant="token")),
                (1.0, "kivi int4", Direction("kivi int4", rank="full", quant="kivi")),
                (1.0, "slots int4", Direction("slots int4", rank="full", quant="slots")),
                (1.0, "shift int4", Direction("shift int4", rank="full", quant="shift")),
                (1.0, "smooth int4", Direction("smooth int4", rank="full", quant="smooth")),
                (1.0, "shift4 int4", Direction("shift4 int4", rank="full", quant="shift", options={"calibration": 4}))]
        for budget in (float(b) for b in args.budgets.split(",")):
            # min_capacity 0: the budget alone, as the simulated rows take it (their recorded figures had no floor)
            plan += [(budget, "library h2o", CompressionConfig(budget=budget, min_capacity=0)),
                     (budget, "library h2o int4", CompressionConfig(budget=budget, kv_bits=4, min_capacity=0))]
            plan += [(budget, d.name, d) for d in DIRECTIONS]
            plan += [(budget, "oracle", Direction("oracle", rank="oracle"))]
            plan += [(budget, f"window {w}", Direction(f"window {w}", rank="window", options={"window": w}))
                     for w in WINDOWS]
            plan += [(budget, f"ema-query {b}", Direction(f"ema-query {b}", rank="ema-query", options={"beta": b}))
                     for b in BETAS]
            plan += [(budget, d.name, d) for d in (expected_attention_direction(*v) for v in EA_VARIANTS)]
            plan += [(budget, f"merge tau {t}", Direction(f"merge tau {t}", merge_tau=t))
                     for t in (TAUS if tau is None else (tau,))]
            plan += [(budget, "h2o kivi int4", Direction("h2o kivi int4", quant="kivi")),
                     (budget, "h2o slots int4", Direction("h2o slots int4", quant="slots")),
                     (budget, "h2o token int4", Direction("h2o token int4", quant="token")),
                     (budget, "h2o shift int4", Direction("h2o shift int4", quant="shift")),
                     (budget, "h2o smooth int4", Direction("h2o smooth int4", quant="smooth")),
                     (budget, "h2o shift4 int4", Direction("h2o shift4 int4", quant="shift", options={"calibration": 4}))]
        reference = None  # the uncompressed perplexity ("library full", always the first row)
        for budget, name, setting in plan:
            if wanted and name not in wanted and name != "library full":
                continue
            previous = next((r for r in rows if (r["text"], r["budget"], r["row"]) == (text, budget, name)), None)
            if previous is not None:
                reference = reference or previous["perplexity"]
                continue
            started, capacity = time.perf_counter(), None
            if isinstance(setting, CompressionConfig):
                ppl = streaming_perplexity(model, ids, setting, 1).perplexity
            else:
                if setting.options.get("calibrated"):
                    if statistics is None:
                        tuning = tokenize_text(tokenizer, load_text("sherlock"), EA_CALIBRATION)
                        statistics = query_statistics(model, tuning, EA_SINK)
                    setting.options["statistics"] = statistics
                cache = make_cache(model, CompressionConfig(budget=budget, min_capacity=0), max_length=ids.shape[1])
                capacity = cache.capacity or ids.shape[1]
                ppl = simulate(model, ids, setting, capacity, cache.layers[0].setting.policy.recent_window(capacity))
            reference = reference or ppl
            row = {"text": text, "budget": budget, "row": name, "perplexity": ppl, "ratio": ppl / reference,
                   "capacity": capacity, "seconds": round(time.perf_counter() - started, 1), "command": command}
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps({"rows": rows}, indent=1))
    result = {"rows": rows, "command": command}
    if args.phase == "choose":
        merges = [r for r in rows if r["row"].startswith("merge tau")]
        best = {}
        for r in merges:
            best.setdefault(float(r["row"].split()[-1]), []).append(r["ratio"])
        result["chosen"] = {"merge_tau": min(best, key=lambda t: sum(best[t]) / len(best[t])) if best else TAUS[-1]}
        expected = {}
        for r in rows:
            if r["row"].startswith("expected-attention"):
                expected.setdefault(r["row"], []).append(r["ratio"])
        if expected:  # the lowest mean ratio of each kind (recent queries, calibrated)
            for kind, names in (("expected_attention", [k for k in expected if "calibrated" not in k]),
                                ("expected_attention_calibrated", [k for k in expected if "calibrated" in k])):
                if names:
                    result["chosen"][kind] = min(names, key=lambda k: sum(expected[k]) / len(expected[k]))
    out.write_text(json.dumps(result, indent=1))
    write_markdown(result, out.with_suffix(".md"), args.phase)


def ratio_table(rows: list[dict], keys: list[tuple] | None = None) -> list[str]:
    """Markdown lines of a table of perplexity ratios: one line per ``(budget, row)`` of ``keys`` (default: in the
    order the rows came), one column per text, ``-`` where a text has no such row."""
    texts = list(dict.fromkeys(r["text"] for r in rows))
    keys = keys if keys is not None else list(dict.fromkeys((r["budget"], r["row"]) for r in rows))
    ratios = {(r["text"], r["budget"], r["row"]): r["ratio"] for r in reversed(rows)}  # the first row of a key wins
    lines = ["| budget | row | " + " | ".join(texts) + " |", "|---:|---|" + "---:|" * len(texts)]
    for budget, name in keys:
        cells = [f"{ratios[(t, budget, name)]:.3f}x" if (t, budget, name) in ratios else "-" for t in texts]
        lines.append(f"| {budget} | {name} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(result: dict, path: Path, phase: str) -> None:
    lines = [f"# Eviction and quantization directions, streaming perplexity x uncompressed ({phase} phase)", "",
             f"`{result['command']}`", "", *ratio_table(result["rows"])]
    if "chosen" in result:
        lines += ["", f"Chosen on the tuning text: `{json.dumps(result['chosen'])}`"]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
