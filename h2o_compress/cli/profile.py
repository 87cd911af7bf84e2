"""``h2o-compress profile``: the policies x budgets x KV bits sweep, written as a report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from h2o_compress.utils.errors import ConfigError
from h2o_compress.cli.common import load_options, user_errors
from h2o_compress.cli.evaluate import parse_list
from h2o_compress.cli.lm_eval_command import split_tasks
from h2o_compress.cli.options import RayCommand
from h2o_compress.cli.progress import stage_progress
from h2o_compress.cli.options import (
    CompileOpt, Compression, DeviceOpt, DtypeOpt, ModelOpt, ThreadsOpt, TrustOpt, compression_options, parse_budget,
    given_on_command_line, placement_options,
)
from h2o_compress.evaluation.corpus import REPORTING, REPORTING_TEXTS, TEXT_NAMES
from h2o_compress.profiling.report import load_report, write_report
from h2o_compress.profiling.sweep import PLACEMENT_DEFAULTS, ProfileSettings, run_profile
from h2o_compress.utils.defaults import default_of


#: The ``profile`` command: its ``--ray`` takes an optional value (`RayCommand`).
ProfileCommand = RayCommand


def options_given(ctx: typer.Context, *besides: str) -> list[str]:
    """The options of the command given on its command line, but ``besides`` (parameter names), as their flags."""
    return ["/".join(param.opts + param.secondary_opts) for param in ctx.command.params
            if param.name not in besides and given_on_command_line(ctx, param.name)]


def setting_default(name: str):
    """[`ProfileSettings`][h2o_compress.profiling.ProfileSettings]' default of field ``name``, as its option takes it (a tuple as a comma-separated
    list): each default is written once, in the dataclass."""
    value = default_of(ProfileSettings, name)
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return value


# -- the sweep's options, their defaults those of ProfileSettings ------------------------------------------------------
OutOpt = typer.Option(
    ..., "--out", help="Directory for report.json, report.md, PNG plots, report.html and rows/: new, empty, or "
    "one an earlier profile wrote (a rerun resumes from its rows/); other report files there are not replaced.")
PoliciesOpt = typer.Option(setting_default("policies"), "--policies", help="Eviction policies, comma-separated.")
BudgetsOpt = typer.Option(
    setting_default("budgets"), "--budgets", help="Budgets, comma-separated (1 = no eviction).")
KvBitsOpt = typer.Option(setting_default("kv_bits"), "--kv-bits", help="KV bits, comma-separated.")
SeqLenOpt = typer.Option(
    setting_default("seq_lens"), "--seq-len", help="Context lengths of the speed/memory runs.")
DecodeTokensOpt = typer.Option(
    setting_default("decode_tokens"), "--decode-tokens", help="Decode steps timed after each prefill.")
PplTokensOpt = typer.Option(
    setting_default("ppl_tokens"), "--ppl-tokens", help="Tokens of the streaming-perplexity run.")
ChunkSizeOpt = typer.Option(
    setting_default("chunk_size"), "--chunk-size", help="Tokens per forward pass in the perplexity run: 1 (default) = "
    "token by token, the exact decode semantics; larger is faster but optimistic, and the report labels it chunked.")
AgreementPromptsOpt = typer.Option(
    setting_default("agreement_prompts"), "--agreement-prompts", help="Shipped prompts for agreement (0 = skip).")
MaxNewTokensOpt = typer.Option(
    setting_default("max_new_tokens"), "--max-new-tokens", help="Tokens generated per agreement prompt.")
NeedleLengthsOpt = typer.Option(
    setting_default("needle_lengths"), "--needle-lengths", help="Passkey context lengths (empty = skip).")
NeedleDepthsOpt = typer.Option(
    setting_default("needle_depths"), "--needle-depths", help="Passkey depths in [0, 1].")
TextFileOpt = typer.Option(
    setting_default("text_file"), "--text-file", help="Text for perplexity/speed (default: shipped corpus).")
QualityTextsOpt = typer.Option(
    setting_default("quality_texts"), "--quality-texts", help="More texts, comma-separated, on which every "
    "configuration's perplexity (and passkey accuracy, with --needle-lengths) is also measured: "
    f"{', '.join(TEXT_NAMES)}, {REPORTING} (= {', '.join(REPORTING_TEXTS)}) or file paths; the report adds a "
    "'Quality per corpus' table (empty = skip).")
IsolateOpt = typer.Option(
    setting_default("isolate"), "--isolate/--no-isolate", help="One fresh worker process per configuration "
    "(default: on CPU, where the peak RSS needs it).")
RayOpt = typer.Option(
    None, "--ray", metavar="[ADDRESS]",
    help="Run each configuration as a Ray task (pip install 'h2o-compress\\[ray]'): --ray alone starts a local "
    "Ray instance; --ray auto joins the cluster running here; --ray ray://HEAD:10001 or HEAD:6379 an existing "
    "cluster (one GPU per task where it has GPUs).")
ResumeOpt = typer.Option(
    default_of(run_profile, "resume"), "--resume/--no-resume", help="Reuse the rows a previous run of the same sweep "
    "finished in OUT/rows (default); --no-resume measures every row again.")
LmEvalTasksOpt = typer.Option(
    setting_default("lm_eval_tasks"), "--lm-eval-tasks", help="lm-evaluation-harness tasks scored for every "
    "configuration, comma-separated (e.g. lambada_openai,hellaswag; empty = skip; needs the lm-eval extra).")
LmEvalLimitOpt = typer.Option(
    setting_default("lm_eval_limit"), "--lm-eval-limit", help="At most N documents per lm-eval task.")
LmEvalIncludePathOpt = typer.Option(
    setting_default("lm_eval_include_path"), "--lm-eval-include-path", help="A folder of extra lm-eval task YAML "
    "files.")
RenderOpt = typer.Option(
    None, "--render", help="Only re-render the report files from this report.json (e.g. of an interrupted sweep) "
    "into --out; takes no sweep option.")


def sweep_lists(policies: str, budgets: str, kv_bits: str, seq_len: str, needle_lengths: str, needle_depths: str,
                lm_eval_tasks: str, quality_texts: str) -> dict:
    """The comma-separated list options, parsed into [`ProfileSettings`][h2o_compress.profiling.ProfileSettings]' tuples. Raises ConfigError."""
    return dict(
        policies=tuple(parse_list(policies, str, "policies", "names such as h2o,local,sink")),
        budgets=tuple(parse_list(budgets, parse_budget, "budgets", "fractions in (0, 1] or integers, e.g. 1,0.5,0.2")),
        kv_bits=tuple(parse_list(kv_bits, int, "kv-bits", "16, 8 or 4, e.g. 16,8,4")),
        seq_lens=tuple(parse_list(seq_len, int, "seq-len", "integers, e.g. 256,512,1024")),
        needle_lengths=tuple(parse_list(needle_lengths, int, "needle-lengths", "integers >= 64, e.g. 1024")),
        needle_depths=tuple(parse_list(needle_depths, float, "needle-depths", "fractions in [0, 1]")),
        lm_eval_tasks=tuple(split_tasks(lm_eval_tasks, "--lm-eval-tasks")) if lm_eval_tasks else (),
        quality_texts=tuple(parse_list(quality_texts, str, "quality-texts", f"{', '.join(TEXT_NAMES)}, {REPORTING} "
                                       "or file paths, e.g. reporting")),
    )


def render_only(ctx: typer.Context, render: str) -> str:
    """``render``, once no sweep option was given beside ``--render`` (which only re-renders the report files of an
    existing report.json). Raises ConfigError naming the options given."""
    ignored = options_given(ctx, "out", "render")
    if ignored:
        raise ConfigError(f"{', '.join(ignored)} cannot be given with --render, which only re-renders the report "
                          "files of an existing report.json (no sweep runs, so sweep options do not apply); "
                          "allowed: --render FILE with --out DIR alone, or no --render to run a sweep")
    return render


@user_errors
@compression_options(only=("min_capacity", "heavy_ratio", "quant", "group_size", "residual", "high_bits_fraction", "head_budgets",
                           "attention_kernel"))
@placement_options
def profile_command(
    ctx: typer.Context,
    out: str = OutOpt,
    model: str = ModelOpt,
    policies: str = PoliciesOpt,
    budgets: str = BudgetsOpt,
    kv_bits: str = KvBitsOpt,
    seq_len: str = SeqLenOpt,
    decode_tokens: int = DecodeTokensOpt,
    ppl_tokens: int = PplTokensOpt,
    chunk_size: int = ChunkSizeOpt,
    agreement_prompts: int = AgreementPromptsOpt,
    max_new_tokens: int = MaxNewTokensOpt,
    needle_lengths: str = NeedleLengthsOpt,
    needle_depths: str = NeedleDepthsOpt,
    text_file: Optional[str] = TextFileOpt,
    quality_texts: str = QualityTextsOpt,
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    isolate: Optional[bool] = IsolateOpt,
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    ray: Optional[str] = RayOpt,
    resume: bool = ResumeOpt,
    lm_eval_tasks: str = LmEvalTasksOpt,
    lm_eval_limit: Optional[int] = LmEvalLimitOpt,
    lm_eval_include_path: Optional[str] = LmEvalIncludePathOpt,
    render: Optional[str] = RenderOpt,
    compression: Compression = None,
    placement: dict = None,
):
    """Sweep policies x budgets x KV bits: KV bytes, peak memory, speed, perplexity, agreement and optionally
    lm-eval scores, as a report."""
    if render is not None:
        written = write_report(load_report(render_only(ctx, render)), out)
        typer.echo(f"wrote {', '.join(sorted(written))} in {Path(out)}")
        return
    load = load_options(device, dtype, placement)  # --kernel is checked against the device by ProfileSettings
    settings = ProfileSettings(  # checks every setting; run_profile checks --text-file, --ray and --out
        model=model, device=device, dtype=dtype, decode_tokens=decode_tokens, ppl_tokens=ppl_tokens,
        chunk_size=chunk_size, agreement_prompts=agreement_prompts, max_new_tokens=max_new_tokens,
        text_file=text_file, isolate=isolate, threads=threads, trust_remote_code=trust_remote_code,
        compile=compile_step, lm_eval_limit=lm_eval_limit, lm_eval_include_path=lm_eval_include_path,
        **sweep_lists(policies, budgets, kv_bits, seq_len, needle_lengths, needle_depths, lm_eval_tasks,
                      quality_texts),
        **compression.values, placement={k: load[k] for k in PLACEMENT_DEFAULTS},
    )
    with stage_progress():  # a first run converts the model before the sweep's own bar
        report = run_profile(settings, out, ray_address=ray, resume=resume)
    reused = f", {report['rows_reused']} reused from {Path(out) / 'rows'}" if report["rows_reused"] else ""
    typer.echo(f"wrote {Path(out) / 'report.json'}, report.md, report.html and 3 PNG plots "
               f"({len(report['results'])} configurations{reused})")
