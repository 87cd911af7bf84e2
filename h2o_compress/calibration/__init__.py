"""Calibration fitted once per model on calibration text: the calibrated eviction policy's weights
(`h2o_compress.calibration.eviction_fit`) and the mean pre-RoPE keys (`h2o_compress.calibration.key_channels`),
written to one file tied to the model (`h2o_compress.persistence.calibration_file`).

Example:
    >>> from h2o_compress import CompressionConfig, load_model, generate
    >>> from h2o_compress.calibration import calibrate
    >>> model, tokenizer = load_model("smollm2-135m")  # doctest: +SKIP
    >>> calibrate(model, tokenizer, out="scorer.safetensors")  # doctest: +SKIP
    >>> config = CompressionConfig(policy="calibrated", budget=0.2, calibration="scorer.safetensors")
"""

from __future__ import annotations

import math

import torch

from h2o_compress.calibration.eviction_fit import (
    HEAVY_FRACTION, INPUT_SETS, RECENT_FRACTION, fit_columns, h2o_weights, input_columns, kept_shares, read_segment,
    training_rows,
)
from h2o_compress.calibration.key_channels import key_statistics_of
from h2o_compress.evaluation.corpus import REPORTING_TEXTS, load_text, tokenize_text
from h2o_compress.models.identity import model_fingerprint, model_identity
from h2o_compress.persistence.calibration_file import (
    EVICTION_WEIGHTS, KEY_CHANNEL_MEAN, Calibration, check_calibration_target, default_calibration_path,
    save_calibration,
)
from h2o_compress.runtime.generation import check_model
from h2o_compress.utils.checks import check_count
from h2o_compress.utils.errors import InputError, UnsupportedModelError, short
from h2o_compress.utils.progress import report

__all__ = ["calibrate", "check_request", "fit_eviction", "DEFAULT_INPUTS", "INPUT_SETS", "CALIBRATION_TOKENS", "CALIBRATION_SEGMENTS"]

#: Tokens of each calibration segment.
CALIBRATION_TOKENS = 1024
#: Segments read from the calibration text: the first is held back (the printed check), the others fitted.
CALIBRATION_SEGMENTS = 4
#: The inputs the fit uses (`INPUT_SETS`), chosen on the tuning text (benchmarks/calibrated_eviction.py).
DEFAULT_INPUTS = "score,age"


def check_request(text_file, tokens, segments, inputs: str = DEFAULT_INPUTS) -> None:
    """Refuse a reporting text as calibration text, an unknown input set and bad counts (``tokens`` 64 to 65,536,
    ``segments`` 2 to 65,536), before the model loads.

    Raises:
        InputError: naming the value and what is allowed.
    """
    if isinstance(text_file, str) and text_file in REPORTING_TEXTS:
        raise InputError(f"calibration text {text_file!r} is a reporting text, which nothing may be tuned on; "
                         "allowed: the tuning text (default) or a text file of your own")
    if inputs not in INPUT_SETS:
        raise InputError(f"inputs={short(inputs)} is not an input set; allowed: {', '.join(INPUT_SETS)}")
    for name, value, low in (("tokens", tokens, 64), ("segments", segments, 2)):
        check_count(name, value, minimum=low, maximum=65_536, allowed=f"an integer from {low} to 65536",
                    error=InputError)


def _segments(tokenizer, text_file, tokens: int, segments: int) -> list[torch.Tensor]:
    """``segments`` consecutive pieces of ``tokens`` token ids ``[1, tokens]`` from the start of the text."""
    ids = tokenize_text(tokenizer, load_text(text_file), tokens * segments)
    if ids.shape[1] < tokens * segments:
        raise InputError(f"the calibration text gives {ids.shape[1]} tokens; allowed: a text of at least "
                         f"{tokens * segments} tokens (--tokens {tokens} x --segments {segments})")
    return [ids[:, i * tokens : (i + 1) * tokens] for i in range(segments)]


def _fit_layer(segments: list, columns: list[int], recent: int) -> torch.Tensor:
    """One layer's weights fp32 ``[kv_heads, head_dim + 4]`` fitted on its rows over ``segments`` (its
    `LayerAttention` of each fitted segment); H2O's ranking (`h2o_weights`) where they give too few rows to fit
    (a sliding window or chunk no wider than the recent window ranks nothing)."""
    rows = [training_rows(segment, recent) for segment in segments]
    inputs, labels = torch.cat([r[0] for r in rows], 1), torch.cat([r[1] for r in rows], 1)
    if labels.shape[1] < len(columns) + 2:
        return h2o_weights(inputs.shape[0], inputs.shape[-1] - 3)
    return fit_columns(inputs, labels, columns)


def fit_eviction(model, pieces: list[torch.Tensor], inputs: str = DEFAULT_INPUTS) -> tuple[torch.Tensor, dict]:
    """The calibrated policy's weights fp32 ``[layers, kv_heads, head_dim + 4]`` fitted on ``pieces[1:]``, and the
    held-back check on ``pieces[0]``: the share of the oracle's future attention the fitted ranking keeps, beside
    H2O's (`kept_shares`), averaged over the layers and heads that have a choice to make (1.0 where none has).

    Every layer type the cache takes is fitted on the tokens it holds: a sliding-window or chunked layer ranks
    only the tokens its next query sees (`h2o_compress.calibration.eviction_fit.training_rows`). A hybrid's
    linear-attention, SSM or convolution layers evict nothing: only its attention layers are fitted, the others
    get H2O's weights (`h2o_weights`, never read) so the file keeps one row per model layer; ``details
    ["state_layers"]`` counts them.

    Raises:
        UnsupportedModelError: as `h2o_compress.calibration.eviction_fit.read_segment`.
    """
    device = next(model.parameters()).device
    tokens = pieces[0].shape[1]
    recent, heavy = math.ceil(RECENT_FRACTION * tokens), math.ceil(HEAVY_FRACTION * tokens)
    read = []
    for i, piece in enumerate(pieces):
        read.append(read_segment(model, piece.to(device)))
        report("reading the calibration text", i + 1, len(pieces) + 1)
    attention = next(layer for layer in read[0] if layer is not None)
    columns = input_columns(inputs, attention.values.shape[-1])
    weights, shares = [], []
    for layer, held_back in enumerate(read[0]):
        if held_back is None:  # a state layer: nothing to rank
            weights.append(h2o_weights(attention.values.shape[0], attention.values.shape[-1]))
            continue
        weights.append(_fit_layer([segment[layer] for segment in read[1:]], columns, recent))
        shares.append(kept_shares(held_back, weights[-1], recent, heavy))
    report("reading the calibration text", len(pieces) + 1, len(pieces) + 1)
    checked = [share for share in shares if share is not None] or [(1.0, 1.0)]
    fitted, h2o = (sum(share[i] for share in checked) / len(checked) for i in (0, 1))
    details = {"held_back_kept_share": round(fitted, 4), "held_back_kept_share_h2o": round(h2o, 4)}
    states = sum(layer is None for layer in read[0])
    if states:
        details["state_layers"] = states
    return _stacked(model, weights), details


def _stacked(model, weights: list[torch.Tensor]) -> torch.Tensor:
    """The layers' weights as one fp32 ``[layers, kv_heads, head_dim + 4]``, a layer with fewer KV heads than
    the most padded with zero rows (`h2o_compress.persistence.calibration_file.layer_geometry`).

    Raises:
        UnsupportedModelError: layers whose values differ in head dim (one tensor cannot hold their weights).
    """
    if len({w.shape[-1] for w in weights}) > 1:
        raise UnsupportedModelError(f"{type(model).__name__}: its layers' values differ in head dim; allowed for "
                                    "policy 'calibrated': models whose layers share one value head dim")
    heads = max(w.shape[0] for w in weights)
    return torch.stack([torch.nn.functional.pad(w, (0, 0, 0, heads - w.shape[0])) for w in weights])


def calibrate(model, tokenizer, text_file=None, tokens: int = CALIBRATION_TOKENS,
              segments: int = CALIBRATION_SEGMENTS, out=None, overwrite: bool = False,
              inputs: str = DEFAULT_INPUTS) -> Calibration:
    """Fit the calibrated eviction policy's weights for ``model`` on calibration text, measure its mean pre-RoPE
    keys, and write both to ``out``.

    The uncompressed model reads ``segments`` consecutive segments of ``tokens`` tokens from the start of the text;
    the first is held back to check the fit, the others are fitted (`h2o_compress.calibration.eviction_fit`: the
    label is the log of the mean attention each token receives from every later query of its segment, the inputs
    what the cache holds when it evicts). Over the same fitted segments the mean pre-RoPE key of each layer and KV
    head is measured (`h2o_compress.calibration.key_channels.key_statistics_of`: what ``key_offsets="calibrated"``
    reads); a model without a fixed rotary embedding still calibrates, its file without them (``details
    ["key_statistics"]`` says why). Its time grows with the number of segments (minutes on a CPU for SmolLM2-135M).

    Args:
        model: a loaded transformers causal LM (`h2o_compress.load_model`).
        tokenizer: its tokenizer.
        text_file: the calibration text: ``None`` or ``"sherlock"`` (the tuning text), or a text file's path; never
            a reporting text.
        tokens: tokens per segment (64 to 65,536).
        segments: segments read (at least 2).
        out: where to write the calibration file (``None``: the model's default file,
            `h2o_compress.persistence.calibration_file.default_calibration_path`, which a cache of policy
            ``calibrated`` reads when no ``calibration`` is set).
        overwrite: replace an existing ``out``.
        inputs: what the predictor reads (`INPUT_SETS`): the default `DEFAULT_INPUTS` was chosen on the tuning
            text.

    Returns:
        The [`Calibration`][h2o_compress.persistence.Calibration]; ``details`` holds the held-back shares and
        whether the key statistics were measured (``key_statistics``).

    Raises:
        ConfigError: ``model`` is not a loaded transformers model.
        InputError: ``tokenizer`` is not one, a reporting text, bad counts, or a text too short.
        UnsupportedModelError: a model whose attention probabilities or per-head values cannot be read, or whose
            layers' values differ in head dim.
        CacheFileError: ``out`` cannot be written (or exists without ``overwrite``).
    """
    check_model(model)
    if not callable(tokenizer):
        raise InputError(f"tokenizer={short(tokenizer)} is not a tokenizer; allowed: the tokenizer of "
                         "h2o_compress.load_model(...) (or any callable transformers tokenizer)")
    check_request(text_file, tokens, segments, inputs)
    out = default_calibration_path(model) if out is None else out
    check_calibration_target(out, overwrite)
    pieces = _segments(tokenizer, text_file, tokens, segments)
    weights, check = fit_eviction(model, pieces, inputs)
    tensors = {EVICTION_WEIGHTS: weights}
    key_mean, why_not = key_statistics_of(model, pieces[1:])
    if key_mean is not None:
        tensors[KEY_CHANNEL_MEAN] = key_mean
    details = {"text": "sherlock" if text_file is None else str(text_file), "tokens": tokens, "segments": segments,
               "inputs": inputs,
               "label": "log mean future attention, horizon: rest of the segment", **check,
               "key_statistics": "mean pre-RoPE key over the fitted segments" if key_mean is not None
               else f"none: {why_not}"}
    calibration = Calibration(tensors, model_fingerprint(model), model_identity(model), details)
    calibration.details["path"] = str(save_calibration(out, calibration, overwrite=overwrite))
    return calibration
