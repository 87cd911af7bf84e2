"""Fitting the calibrated eviction policy's weights on the uncompressed model's attention (KVzap-style,
arXiv 2601.07891 §3, with H2O's accumulated attention and the token's age among the inputs).

For a calibration segment of ``T`` tokens, the uncompressed model's attention ``A[h, i, j]`` (query ``i``, key
``j``, the query heads of KV head ``h`` summed) gives, at each decision time ``n`` (``n`` tokens seen):

- the **label** of token ``j``: ``log(mean_{i >= n} A[h, i, j] + SCORE_FLOOR)``, the mean attention it receives
  from every later query of the segment (the horizon is the rest of the segment; the oracle ranks by the sum over
  the same queries, which orders tokens alike);
- its **inputs** (`h2o_compress.policies.calibrated.feature_matrix`): ``log`` of the attention accumulated so far
  (``sum_{i < n} A[h, i, j]``, H2O's score), ``log`` of its age ``n - j``, its value and the log of the value's norm.

Only tokens outside the recent window at a budget of `RECENT_FRACTION` are rows (those the policy ranks), at every
`STRIDE`-th decision time. The weights are a ridge regression per (layer, KV head), on standardised inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from h2o_compress.cache.span import FULL_SPAN, LayerSpan
from h2o_compress.models import model_dims
from h2o_compress.policies.calibrated import SCORE_FLOOR, feature_matrix, predicted_score, token_prior
from h2o_compress.utils.errors import UnsupportedModelError

#: The recent window the rows leave out, as a share of the segment (the default budget 0.2 splits into 0.1 heavy
#: hitters and 0.1 recent window).
RECENT_FRACTION = 0.1
#: Decision times between two that give rows.
STRIDE = 8
#: Ridge penalty per row on standardised inputs.
RIDGE = 1e-2
#: Share of the held-back segment's tokens a held-back check keeps as heavy hitters.
HEAVY_FRACTION = 0.1


@dataclass
class LayerAttention:
    """One layer of one calibration segment read by the uncompressed model.

    Attributes:
        attention: fp32 ``[kv_heads, tokens, tokens]``, ``[h, i, j]`` the attention query ``i`` gives key ``j``,
            the query heads of KV head ``h`` summed.
        values: fp32 ``[kv_heads, tokens, head_dim]`` the values as the model made them.
        span: the tokens each query of the layer sees (full, sliding window or chunk: `LayerSpan`); a sliding or
            chunked layer holds, at decision time ``n``, only the tokens the query at ``n`` sees, so only those
            are ranked.
    """

    attention: torch.Tensor
    values: torch.Tensor
    span: LayerSpan = FULL_SPAN

    def lowest(self, seen: int) -> int:
        """The lowest position the layer still holds after ``seen`` tokens (the lowest the query at position
        ``seen`` sees; 0 for full attention)."""
        first_real = torch.zeros(1, dtype=torch.int64)
        return max(0, int(self.span.lowest(torch.tensor(seen), first_real)[0]))


@torch.inference_mode()
def read_segment(model, input_ids: torch.Tensor) -> list[LayerAttention | None]:
    """Every layer's attention and values of ``input_ids`` ``[1, tokens]`` in one uncompressed forward pass (eager
    attention, for its probabilities; the model's own setting is restored after), with each layer's span; ``None``
    in the place of a hybrid's linear-attention, SSM or convolution layer (`LayerSpan.stateful`: no attention to
    read, nothing to evict).

    A sliding or chunked layer's cache keeps every token here (a ``DynamicLayer``, not transformers'
    ``DynamicSlidingWindowLayer``, which keeps only its window): the model masks the layer to its span itself,
    so the probabilities are the model's, and the values cover every key the probabilities do.

    Raises:
        UnsupportedModelError: a model whose attention layers give no attention probabilities or no ``[batch,
            kv_heads, tokens, head_dim]`` values (latent caches), or whose layer types the cache does not take
            (`h2o_compress.models.model_dims`).
    """
    spans = model_dims(model.config).spans
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        cache = _reading_cache(model)
        output = model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    count = len(spans) or len(cache.layers)
    stateful = [index < len(spans) and spans[index].stateful for index in range(count)]
    probabilities = _by_layer(list(output.attentions or ()), stateful)
    layers = []
    for index in range(count):
        if stateful[index]:  # a hybrid's state layer: no softmax attention, nothing to evict
            layers.append(None)
            continue
        span, attention = spans[index] if index < len(spans) else FULL_SPAN, probabilities[index]
        values = getattr(cache.layers[index], "values", None) if index < len(cache.layers) else None
        if attention is None or values is None or values.dim() != 4:
            raise UnsupportedModelError(f"{type(model).__name__}: a layer gives no attention probabilities or per-head "
                                        "values; allowed: models with a key/value cache per KV head")
        kv_heads = values.shape[1]
        layers.append(LayerAttention(attention[0].float().unflatten(0, (kv_heads, -1)).sum(1), values[0].float(),
                                     span))
    if not any(layer is not None for layer in layers):
        raise UnsupportedModelError(f"{type(model).__name__}: not every layer gives its attention; allowed: models "
                                    "whose eager attention returns its probabilities")
    return layers


def _by_layer(attentions: list, stateful: list[bool]) -> list:
    """The model's attention outputs by layer index: one per layer as given, or, where the model gives them for its
    attention layers only (a hybrid's state layers give none), those in the places of the layers not ``stateful``;
    ``None`` where a layer has none (or the count fits neither)."""
    if len(attentions) == len(stateful) or not any(stateful):  # one per layer (MiniMax's lightning layers give
        return (attentions + [None] * len(stateful))[: len(stateful)]  # their own, not read)
    places = [index for index, state in enumerate(stateful) if not state]
    by_layer = [None] * len(stateful)
    if len(attentions) == len(places):
        for index, attention in zip(places, attentions):
            by_layer[index] = attention
    return by_layer


def _reading_cache(model):
    """A cache keeping every token of every attention layer for `read_segment`: transformers' ``DynamicCache``
    with its sliding layers made full, or the model's own cache class where it takes no other (MiniMax's
    ``MiniMaxCache``, whose layers are made on use: full)."""
    if getattr(model.config, "model_type", None) == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def _attention_sums(attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seen, to_come)``, both fp32 ``[kv_heads, tokens, tokens]`` from ``attention`` ``[kv_heads, tokens, tokens]``:
    ``seen[h, i, j]`` the attention key ``j`` got from queries ``0..i``, ``to_come[h, i, j]`` from queries
    ``i..end``."""
    return attention.cumsum(1), attention.flip(1).cumsum(1).flip(1)


def _ages(seen: int, first: int, end: int, kv_heads: int) -> torch.Tensor:
    """int64 ``[kv_heads, end - first]``: the ages ``seen - j`` of tokens ``j = first .. end - 1`` after ``seen``
    tokens."""
    return torch.arange(seen - first, seen - end, -1).expand(kv_heads, end - first)


def training_rows(layer: LayerAttention, recent: int, stride: int = STRIDE) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs fp32 ``[kv_heads, rows, head_dim + 3]`` and labels fp32 ``[kv_heads, rows]`` of one layer of one
    segment (see the module's text), for a recent window of ``recent`` tokens. At each decision time the rows are
    the tokens the layer holds outside the recent window: for a sliding or chunked layer only those its next
    query sees (`LayerAttention.lowest`); ``rows`` is 0 where it holds none (a window within the recent one)."""
    attention, values = layer.attention, layer.values
    kv_heads, tokens = attention.shape[0], attention.shape[1]
    seen_sums, to_come = _attention_sums(attention)
    inputs = [torch.zeros(kv_heads, 0, values.shape[-1] + 3)]
    labels = [torch.zeros(kv_heads, 0)]
    for n in range(recent + 8, tokens - 1, stride):
        first, end = layer.lowest(n), n - recent
        if end <= first:
            continue
        ages = _ages(n, first, end, kv_heads)
        inputs.append(feature_matrix(seen_sums[:, n - 1, first:end], ages, values[:, first:end]))
        labels.append(torch.log(to_come[:, n, first:end] / (tokens - n) + SCORE_FLOOR))
    return torch.cat(inputs, 1), torch.cat(labels, 1)


#: The inputs a fit may use, by name: each is a set of columns of
#: `h2o_compress.policies.calibrated.feature_matrix` (``head_dim`` known at fit time).
INPUT_SETS = ("score,age", "score,age,norm", "score,age,norm,value")


def input_columns(inputs: str, head_dim: int) -> list[int]:
    """The `feature_matrix` columns of the input set ``inputs`` (one of `INPUT_SETS`)."""
    columns = {"score": [0], "age": [1], "value": list(range(2, 2 + head_dim)), "norm": [2 + head_dim]}
    return sorted(c for name in inputs.split(",") for c in columns[name])


def fit_columns(inputs: torch.Tensor, labels: torch.Tensor, columns: list[int], ridge: float = RIDGE) -> torch.Tensor:
    """`fit_ridge` on the ``columns`` of ``inputs`` only, the other weights 0: fp32 ``[kv_heads, features + 1]``."""
    fitted = fit_ridge(inputs[..., columns], labels, ridge)
    weights = torch.zeros(inputs.shape[0], inputs.shape[-1] + 1)
    weights[:, columns] = fitted[:, :-1]
    weights[:, -1] = fitted[:, -1]
    return weights


def fit_ridge(inputs: torch.Tensor, labels: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """Per KV head, the least-squares weights with an L2 penalty on standardised inputs, returned for the raw
    inputs with the bias last: fp32 ``[kv_heads, features + 1]`` from ``inputs`` ``[kv_heads, rows, features]``
    and ``labels`` ``[kv_heads, rows]``."""
    x = inputs.double()
    mean, std = x.mean(1, keepdim=True), x.std(1, keepdim=True).clamp(min=1e-6)
    z = (x - mean) / std
    y = labels.double()
    y_mean = y.mean(1, keepdim=True)
    gram = z.transpose(1, 2) @ z + ridge * z.shape[1] * torch.eye(z.shape[-1], dtype=torch.float64)
    solved = torch.linalg.solve(gram, z.transpose(1, 2) @ (y - y_mean).unsqueeze(-1))[..., 0]
    weights = solved / std[:, 0]
    bias = y_mean[:, 0] - (weights * mean[:, 0]).sum(-1)
    return torch.cat((weights, bias[:, None]), -1).float()


def h2o_weights(kv_heads: int, head_dim: int) -> torch.Tensor:
    """fp32 ``[kv_heads, head_dim + 4]`` that rank as H2O does (the accumulated score alone): a layer's weights
    where the calibration text gives it too few rows to fit (a window within the recent one)."""
    weights = torch.zeros(kv_heads, head_dim + 4)
    weights[:, 0] = 1.0
    return weights


def kept_shares(layer: LayerAttention, weights: torch.Tensor, recent: int, heavy: int,
                stride: int = 4 * STRIDE) -> tuple[float, float] | None:
    """Of the future attention the oracle's ``heavy`` best tokens outside the recent window receive, the share the
    ``heavy`` tokens ranked best by the fitted ``weights`` (fp32 ``[kv_heads, head_dim + 4]``, ranked as the policy
    ranks: `h2o_compress.policies.calibrated.predicted_score`) receive, and the share H2O's accumulated attention
    keeps, averaged over decision times: ``(fitted, h2o)``, a held-back check of a fit (1.0: the oracle's ranking).
    Only tokens the layer holds are ranked (`LayerAttention.lowest`); ``None`` where no decision time has more
    of them than ``heavy`` (nothing to choose)."""
    attention = layer.attention
    seen_sums, to_come = _attention_sums(attention)
    prior = token_prior(layer.values[None], weights)[0]  # [kv_heads, tokens]
    fitted = h2o = best = 0.0
    for n in range(recent + heavy + 8, attention.shape[1] - 1, stride):
        first, end = layer.lowest(n), n - recent
        if end - first <= heavy:
            continue
        future = to_come[:, n, first:end]
        scores = seen_sums[:, n - 1, first:end]
        ages = _ages(n, first, end, attention.shape[0])
        predicted = predicted_score(scores, ages, prior[:, first:end], weights)
        fitted += float(future.gather(-1, predicted.topk(heavy, -1).indices).sum())
        h2o += float(future.gather(-1, scores.topk(heavy, -1).indices).sum())
        best += float(future.topk(heavy, -1).values.sum())
    return (fitted / best, h2o / best) if best else None
