"""``h2o-compress profile``: the policies x budgets x KV bits sweep, written as a report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand

from h2o_compress.utils.errors import ConfigError
from h2o_compress.cli.common import load_options, user_errors
from h2o_compress.cli.evaluate import parse_list
from h2o_compress.cli.lm_eval_command import split_tasks
from h2o_compress.cli.options import (
    CompileOpt, Compression, DeviceOpt, DtypeOpt, ModelOpt, ThreadsOpt, TrustOpt, compression_options, parse_budget,
    given_on_command_line, placement_options,
)


RAY_LOCAL = "local"


class ProfileCommand(TyperCommand):
    """The ``profile`` command, whose ``--ray`` takes an optional value (typer cannot declare one): a bare
    ``--ray`` (last, or followed by another option) means ``--ray local``, a local Ray instance."""

    def parse_args(self, ctx, args):
        args = list(args)
        for i, arg in enumerate(args):
            if arg == "--":
                break
            if arg == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")):
                args.insert(i + 1, RAY_LOCAL)
                break
        return super().parse_args(ctx, args)


def options_given(ctx: typer.Context, *besides: str) -> list[str]:
    """The options of the command given on its command line, but ``besides`` (parameter names), as their flags."""
    return ["/".join(param.opts + param.secondary_opts) for param in ctx.command.params
            if param.name not in besides and given_on_command_line(ctx, param.name)]


@user_errors
@compression_options(only=("heavy_ratio", "quant", "group_size", "residual", "high_bits_fraction", "head_budgets",
                           "attention_kernel"))
@placement_options
def profile_command(
    ctx: typer.Context,
    out: str = typer.Option(
        ..., "--out", help="Directory for report.json, report.md, PNG plots, report.html and rows/: new, empty, or "
        "one an earlier profile wrote (a rerun resumes from its rows/); other report files there are not replaced."),
    model: str = ModelOpt,
    policies: str = typer.Option("h2o,local,sink", "--policies", help="Eviction policies, comma-separated."),
    budgets: str = typer.Option("1,0.5,0.2,0.1", "--budgets", help="Budgets, comma-separated (1 = no eviction)."),
    kv_bits: str = typer.Option("16,8,4", "--kv-bits", help="KV bits, comma-separated."),
    seq_len: str = typer.Option("256,512,1024", "--seq-len", help="Context lengths of the speed/memory runs."),
    decode_tokens: int = typer.Option(16, "--decode-tokens", help="Decode steps timed after each prefill."),
    ppl_tokens: int = typer.Option(512, "--ppl-tokens", help="Tokens of the streaming-perplexity run."),
    chunk_size: int = typer.Option(
        1, "--chunk-size", help="Tokens per forward pass in the perplexity run: 1 (default) = token by token, the "
        "exact decode semantics; larger is faster but optimistic, and the report labels it chunked."),
    agreement_prompts: int = typer.Option(3, "--agreement-prompts", help="Shipped prompts for agreement (0 = skip)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens generated per agreement prompt."),
    needle_lengths: str = typer.Option("", "--needle-lengths", help="Passkey context lengths (empty = skip)."),
    needle_depths: str = typer.Option("0,0.5,1", "--needle-depths", help="Passkey depths in [0, 1]."),
    text_file: Optional[str] = typer.Option(
        None, "--text-file", help="Text for perplexity/speed (default: shipped corpus)."),
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt,
    isolate: Optional[bool] = typer.Option(
        None, "--isolate/--no-isolate", help="One fresh worker process per configuration (default: on CPU, "
        "where the peak RSS needs it)."),
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    ray: Optional[str] = typer.Option(
        None, "--ray", metavar="[ADDRESS]",
        help="Run each configuration as a Ray task (pip install 'h2o-compress\\[ray]'): --ray alone starts a local "
        "Ray instance; --ray auto joins the cluster running here; --ray ray://HEAD:10001 or HEAD:6379 an existing "
        "cluster (one GPU per task where it has GPUs)."),
    resume: bool = typer.Option(
        True, "--resume/--no-resume", help="Reuse the rows a previous run of the same sweep finished in "
        "OUT/rows (default); --no-resume measures every row again."),
    lm_eval_tasks: str = typer.Option(
        "", "--lm-eval-tasks", help="lm-evaluation-harness tasks scored for every configuration, comma-separated "
        "(e.g. lambada_openai,hellaswag; empty = skip; needs the lm-eval extra)."),
    lm_eval_limit: Optional[int] = typer.Option(None, "--lm-eval-limit", help="At most N documents per lm-eval task."),
    lm_eval_include_path: Optional[str] = typer.Option(
        None, "--lm-eval-include-path", help="A folder of extra lm-eval task YAML files."),
    render: Optional[str] = typer.Option(
        None, "--render", help="Only re-render the report files from this report.json (e.g. of an interrupted sweep) "
        "into --out; takes no sweep option."),
    compression: Compression = None,
    placement: dict = None,
):
    """Sweep policies x budgets x KV bits: KV bytes, peak memory, speed, perplexity, agreement and optionally
    lm-eval scores, as a report."""
    from h2o_compress.evaluation.corpus import load_text
    from h2o_compress.profiling.sweep import ProfileSettings, run_profile
    from h2o_compress.profiling.report import load_report, write_report

    if render is not None:
        ignored = options_given(ctx, "out", "render")
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} cannot be given with --render, which only re-renders the report "
                              "files of an existing report.json (no sweep runs, so sweep options do not apply); "
                              "allowed: --render FILE with --out DIR alone, or no --render to run a sweep")
        written = write_report(load_report(render), out)
        typer.echo(f"wrote {', '.join(sorted(written))} in {out}")
        return
    values = compression.values
    load = load_options(device, dtype, placement)  # --kernel is checked against the device by ProfileSettings
    settings = ProfileSettings(
        model=model, device=device, dtype=dtype,
        policies=tuple(parse_list(policies, str, "policies", "names such as h2o,local,sink")),
        budgets=tuple(parse_list(budgets, parse_budget, "budgets", "fractions in (0, 1] or integers, e.g. 1,0.5,0.2")),
        kv_bits=tuple(parse_list(kv_bits, int, "kv-bits", "16, 8 or 4, e.g. 16,8,4")),
        seq_lens=tuple(parse_list(seq_len, int, "seq-len", "integers, e.g. 256,512,1024")),
        decode_tokens=decode_tokens, ppl_tokens=ppl_tokens, chunk_size=chunk_size,
        agreement_prompts=agreement_prompts, max_new_tokens=max_new_tokens,
        needle_lengths=tuple(parse_list(needle_lengths, int, "needle-lengths", "integers >= 64, e.g. 1024")),
        needle_depths=tuple(parse_list(needle_depths, float, "needle-depths", "fractions in [0, 1]")),
        text_file=text_file, heavy_ratio=values["heavy_ratio"], quant=values["quant"],
        group_size=values["group_size"], residual=values["residual"], isolate=isolate, threads=threads,
        high_bits_fraction=values["high_bits_fraction"], head_budgets=values["head_budgets"],
        attention_kernel=values["attention_kernel"],
        trust_remote_code=trust_remote_code, compile=compile_step,
        lm_eval_tasks=tuple(split_tasks(lm_eval_tasks, "--lm-eval-tasks")) if lm_eval_tasks else (),
        lm_eval_limit=lm_eval_limit, lm_eval_include_path=lm_eval_include_path,
        placement={k: load[k] for k in ("weights_bits", "device_map", "max_memory", "offload_folder")},
    )
    if text_file is not None:
        load_text(text_file)
    if ray is not None:
        from h2o_compress.integrations.ray_sweep import check_address, import_ray

        check_address(ray)
        import_ray()  # the missing extra is named before anything runs
    report = run_profile(settings, out, ray_address=ray, resume=resume)
    reused = f", {report['rows_reused']} reused from {Path(out) / 'rows'}" if report["rows_reused"] else ""
    typer.echo(f"wrote {out}/report.json, report.md, report.html and 3 PNG plots ({len(report['results'])} "
               f"configurations{reused})")
