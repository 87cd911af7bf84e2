"""``h2o-compress plan``: which compression settings fit a memory limit, and what each costs."""

from __future__ import annotations

import json
from typing import Optional

import typer

from h2o_compress.config import CompressionConfig
from h2o_compress.cli.common import user_errors
from h2o_compress.cli.options import Compression, PlanWeightsBitsOpt, TrustOpt, compression_options, parse_budget
from h2o_compress.planner import parse_list, plan as run_plan
from h2o_compress.planner.view import print_plan


@user_errors
@compression_options(only=("quant", "heavy_ratio", "sink_tokens", "high_bits_fraction", "head_budgets",
                           "layer_budgets"))
def plan(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", help="Local model directory or known model name (e.g. llama-2-7b)."),
    memory: str = typer.Option(..., "--memory", help="Memory limit: 24GiB, 80GB, 512MiB..."),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together."),
    prompt_len: int = typer.Option(2048, "--prompt-len", help="Prompt tokens per sequence."),
    gen_len: int = typer.Option(128, "--gen-len", help="New tokens per sequence."),
    weights_bits: int = PlanWeightsBitsOpt,
    dtype: str = typer.Option("float16", "--dtype", help="Compute and KV dtype: float16, bfloat16 or float32."),
    profile: Optional[str] = typer.Option(
        None, "--profile", help="Profile report (JSON) giving the quality order (default: the shipped measured ranking)."),
    policies: str = typer.Option("h2o", "--policies", help="Eviction policies to consider (comma-separated)."),
    budgets: str = typer.Option("1.0,0.5,0.25,0.1", "--budgets", help="Budgets: fractions or token counts."),
    bits: str = typer.Option("16,8,4", "--bits", help="KV bit widths to consider."),
    group_sizes: str = typer.Option("32,128", "--group-sizes", help="Group sizes to consider (32, 64, 128)."),
    residuals: str = typer.Option(str(CompressionConfig.residual), "--residuals", help="Residual windows to consider."),
    headroom: str = typer.Option(
        "10%", "--headroom", help="Memory left free for the CUDA context and fragmentation: a share (10%) or an "
        "amount (1GiB); 0 to plan up to the limit."),
    compiled: Optional[bool] = typer.Option(
        None, "--compile/--no-compile", help="Count the CUDA-graph pool of the compiled decode step in the workspace. "
        "Default: for 16-bit weights (what generate --device cuda compiles)."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole plan as one JSON object (strict JSON)."),
    trust_remote_code: bool = TrustOpt,
    compression: Compression = None,
):
    """Plan memory: which compression settings fit, the largest batch and context for each, and a pick."""
    values = compression.values
    report = run_plan(
        model, memory, batch=batch, prompt_len=prompt_len, gen_len=gen_len, weights_bits=weights_bits, dtype=dtype,
        profile=profile, policies=parse_list(policies, "policies", str),
        budgets=parse_list(budgets, "budgets", parse_budget), bits=parse_list(bits, "bits"),
        group_sizes=parse_list(group_sizes, "group_sizes"), residuals=parse_list(residuals, "residuals"),
        quant=values["quant"], heavy_ratio=values["heavy_ratio"], sink_tokens=values["sink_tokens"],
        headroom=headroom, trust_remote_code=trust_remote_code, high_bits_fraction=values["high_bits_fraction"],
        head_budgets=values["head_budgets"], layer_budgets=values["layer_budgets"], compiled=compiled,
    )
    for warning in report.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), allow_nan=False))
    else:
        print_plan(report)
