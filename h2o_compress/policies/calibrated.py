"""``calibrated``: heavy hitters ranked by a linear predictor of future attention, fitted once per model.

The predictor follows KVzap (arXiv 2601.07891 §3): a per-head linear model, fitted offline on the uncompressed
model's attention, scores each token by the attention it is expected to receive. Here it reads what the cache holds
when it evicts: the token's accumulated attention (H2O, arXiv 2306.14048 §4), its age, and its value vector.
`h2o-compress calibrate` fits the weights (`h2o_compress.calibration`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_compress.policies.h2o import H2OPolicy
from h2o_compress.utils.errors import ConfigError, short

#: Added to an accumulated score before its logarithm (a token nobody attended yet is not ``-inf``).
SCORE_FLOOR = 1e-4
#: Added to a value's L2 norm before its logarithm.
NORM_FLOOR = 1e-6
#: Columns of a layer's weights besides the value's ``head_dim`` ones: score, age, log norm, bias.
EXTRA_COLUMNS = 4


def feature_matrix(scores: torch.Tensor, ages: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The predictor's inputs, fp32 ``[..., tokens, head_dim + 3]``: ``log(score + SCORE_FLOOR)``, ``log(age)``, the
    value itself, ``log(|value|_2 + NORM_FLOOR)`` (the bias column is not included).

    Args:
        scores: fp32 ``[..., tokens]`` accumulated attention.
        ages: ``[..., tokens]`` queries that have seen each token (``seen - position``, at least 1).
        values: ``[..., tokens, head_dim]`` the values in the model's basis.
    """
    values = values.float()
    columns = (torch.log(scores.float() + SCORE_FLOOR).unsqueeze(-1), torch.log(ages.float().clamp(min=1)).unsqueeze(-1),
               values, torch.log(values.norm(dim=-1, keepdim=True) + NORM_FLOOR))
    return torch.cat(columns, -1)


def token_prior(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The part of the predicted score a token carries from when it enters: fp32 ``[batch, kv_heads, tokens]``.

    Args:
        values: ``[batch, kv_heads, tokens, width]`` in the model's basis: ``width`` the weights' ``head_dim``, or
            more where the cache holds narrower values zero-padded to the keys' head dim (the columns beyond
            ``head_dim`` are those zeros, and are not read).
        weights: fp32 ``[kv_heads, head_dim + 4]`` one layer's weights (see `CalibratedPolicy.weights`).
    """
    head_dim = weights.shape[-1] - EXTRA_COLUMNS
    values = values[..., :head_dim].float()
    linear = torch.einsum("bhtd,hd->bht", values, weights[:, 2 : 2 + head_dim])
    norm = torch.log(values.norm(dim=-1) + NORM_FLOOR)
    return linear + norm * weights[:, 2 + head_dim, None] + weights[:, 3 + head_dim, None]


def predicted_score(scores: torch.Tensor, ages: torch.Tensor, prior: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The predicted log of the mean attention each token will receive, fp32 ``[batch, kv_heads, tokens]``.

    Args:
        scores: fp32 ``[batch, kv_heads, tokens]`` accumulated attention.
        ages: ``[batch, kv_heads, tokens]`` ``seen - position``.
        prior: fp32 ``[batch, kv_heads, tokens]`` `token_prior` of each token.
        weights: fp32 ``[kv_heads, head_dim + 4]``.
    """
    log_score = torch.log(scores.float() + SCORE_FLOOR)
    log_age = torch.log(ages.float().clamp(min=1))
    return weights[:, 0, None] * log_score + weights[:, 1, None] * log_age + prior


@dataclass
class CalibratedPolicy(H2OPolicy):
    """Keeps the tokens a calibrated predictor expects to be attended most, plus the recent window and the sinks.

    The predicted score of a held token is linear in ``log(accumulated attention)``, ``log(age)``, its value vector
    and the log of its value's norm, with weights fitted per layer and KV head on the uncompressed model's attention
    over calibration text (`h2o_compress.calibration.calibrate`, KVzap-style, arXiv 2601.07891 §3): the label
    is the log of the mean attention the token receives from every later query of the calibration text (the
    oracle's ranking). The value part is computed once when the token enters the store (one fp32 per slot, like
    VATP's norms); the score and age parts at each eviction. Same budget split (``heavy_ratio``), recent window,
    sinks and tie rule as ``h2o``; the scores accumulated are H2O's.

    Attributes:
        weights: fp32 ``[kv_heads, head_dim + 4]`` this layer's weights, columns ``[score, age, value_0 ..
            value_{head_dim - 1}, log norm, bias]``, or ``None`` until the cache gives the layer its row of the
            calibration file (then the policy refuses to rank).

    Raises:
        ConfigError: weights that are not a finite real floating-point matrix of ``head_dim + 4`` columns (ints,
            bool and complex refused).
    """

    summary: ClassVar[str] = "heavy hitters ranked by a predictor of future attention fitted per model (calibrate)"
    ranks_by: ClassVar[str] = "predicted"
    shares_heads: ClassVar[bool] = False  # weights per KV head: a head-adaptive pool mixes the heads' slots
    weighs_values: ClassVar[bool] = True  # the store keeps one fp32 per slot: the token's prior
    needs_calibration: ClassVar[bool] = True
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        weights = self.weights
        if weights is None:
            return
        if not isinstance(weights, torch.Tensor) or weights.dim() != 2 or weights.shape[1] <= EXTRA_COLUMNS \
                or not weights.dtype.is_floating_point:  # ints, bool, complex
            got = (f"of dtype {str(weights.dtype).removeprefix('torch.')} and shape {list(weights.shape)}"
                   if isinstance(weights, torch.Tensor) else short(weights))
            raise ConfigError(f"calibrated weights {got} are invalid; allowed: a real floating-point (fp32) tensor "
                              f"[kv_heads, head_dim + {EXTRA_COLUMNS}]")
        if not bool(torch.isfinite(weights).all()):
            raise ConfigError("calibrated weights hold NaN or Inf; allowed: finite weights (run calibrate again)")

    def for_layer(self, weights: torch.Tensor | None) -> CalibratedPolicy:
        """This policy with one layer's ``weights`` (fp32 ``[kv_heads, head_dim + 4]``)."""
        return CalibratedPolicy(heavy_ratio=self.heavy_ratio, sink_tokens=self.sink_tokens,
                                weights=None if weights is None else weights.float().contiguous())

    def value_weight(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 ``[batch, kv_heads, tokens]``: what the store keeps per slot for ``values`` ``[batch, kv_heads,
        tokens, head_dim]`` (model basis): the `token_prior`."""
        return token_prior(values, self.weights_on(values.device))

    def weights_on(self, device: torch.device) -> torch.Tensor:
        """This layer's weights on ``device`` (moved once, then kept there).

        Raises:
            ConfigError: the policy was given no weights (no calibration file).
        """
        if self.weights is None:
            raise ConfigError("policy 'calibrated' has no weights for this layer; allowed: a calibration file "
                              "(run: h2o-compress calibrate --model MODEL --out scorer.safetensors, then "
                              "--calibration scorer.safetensors)")
        if self.weights.device != device:
            self.weights = self.weights.to(device)
        return self.weights

    def priority(self, scores: torch.Tensor | None, positions: torch.Tensor, seen, first_real: torch.Tensor,
                 capacity: int, value_norms: torch.Tensor | None = None) -> torch.Tensor:
        """[`EvictionPolicy.priority`][h2o_compress.policies.EvictionPolicy.priority]'s rules over
        `predicted_score`; ``value_norms`` are the per-slot priors (`value_weight`)."""
        weights = self.weights_on(positions.device)
        ages = seen - positions.to(torch.float32)
        prior = value_norms if value_norms is not None else torch.zeros_like(scores)
        ranked = predicted_score(scores, ages, prior, weights)
        return self.protect(ranked, positions, seen, first_real, capacity)

    def rank(self, scores: torch.Tensor | None, positions: torch.Tensor, seen) -> torch.Tensor:
        """The predicted score without the value part (what a caller without the per-slot priors can rank by)."""
        weights = self.weights_on(positions.device)
        return predicted_score(scores, seen - positions.to(torch.float32), torch.zeros_like(scores), weights)
