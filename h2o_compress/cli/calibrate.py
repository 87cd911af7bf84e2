"""``h2o-compress calibrate``: fit the calibrated eviction policy and measure the key statistics once per model
(`h2o_compress.calibration`)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from h2o_compress.calibration import (
    CALIBRATION_SEGMENTS, CALIBRATION_TOKENS, DEFAULT_INPUTS, INPUT_SETS, calibrate, check_request,
)
from h2o_compress.cli.common import load_options, set_threads, user_errors
from h2o_compress.cli.evaluate import checked_text
from h2o_compress.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelOpt, ThreadsOpt, TrustOpt, placement_flags
from h2o_compress.cli.progress import stage_progress
from h2o_compress.evaluation.corpus import TEXT_NAMES
from h2o_compress.models import load_model
from h2o_compress.persistence.calibration_file import check_calibration_target


@user_errors
@placement_flags
def calibrate_command(
    model: str = ModelOpt,
    text_file: Optional[str] = typer.Option(
        None, "--text-file", help="Calibration text: a UTF-8 file, or sherlock (the tuning text, the default); "
        f"never a reporting text ({', '.join(TEXT_NAMES[1:])})."),
    tokens: int = typer.Option(CALIBRATION_TOKENS, "--tokens", help="Tokens per calibration segment."),
    segments: int = typer.Option(CALIBRATION_SEGMENTS, "--segments",
                                 help="Segments read (the first is held back to check the fit)."),
    inputs: str = typer.Option(DEFAULT_INPUTS, "--inputs", help="What the predictor reads: "
                               f"{', '.join(INPUT_SETS)} (the default was chosen on the tuning text)."),
    out: Optional[str] = typer.Option(
        None, "--out", help="Calibration file to write (default: the model's own file in the cache root, which "
        "--policy calibrated reads when no --calibration is given)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt, as_json: bool = JsonOpt, placement: dict = None,
):
    """Fit the calibrated eviction policy for a model (once; minutes on a CPU): the uncompressed model reads the
    calibration text, each token is labelled with the attention later queries give it, and a predictor per layer
    and KV head is fitted (KVzap-style, arXiv 2601.07891); the mean pre-RoPE key of each layer and KV head is
    measured on the same text (KVQuant, arXiv 2401.18079; not for a model without a fixed RoPE). Use it with
    --policy calibrated, and --key-offsets calibrated for 4- or 8-bit keys."""
    check_request(text_file, tokens, segments, inputs)
    if text_file is not None:
        checked_text(text_file)
    if out is not None:
        check_calibration_target(out, overwrite)
    options = load_options(device, dtype, placement)
    set_threads(threads)
    with stage_progress(not as_json):
        lm, tokenizer = load_model(model, trust_remote_code=trust_remote_code, **options)
        calibration = calibrate(lm, tokenizer, text_file, tokens, segments, out, overwrite, inputs)
    details = calibration.details
    if as_json:
        typer.echo(json.dumps({"model": calibration.model_id, **details}))
        return
    typer.echo(f"calibration of {calibration.model_id} written to {details['path']}")
    typer.echo(f"held back ({tokens} tokens of {details['text']}): the fitted ranking keeps "
               f"{details['held_back_kept_share']:.1%} of the future attention the oracle keeps (h2o: "
               f"{details['held_back_kept_share_h2o']:.1%})")
    measured = not details.get("key_statistics", "").startswith("none")
    typer.echo("key statistics (mean pre-RoPE keys, for --key-offsets calibrated): "
               + ("measured over the fitted segments" if measured else
                  f"not written ({details['key_statistics'].removeprefix('none: ')})"))
    file = "" if out is None else f" --calibration {out}"
    typer.echo("use it with: --policy calibrated" + file)
    if measured:
        typer.echo("and with 4- or 8-bit keys: --key-offsets calibrated" + file)
