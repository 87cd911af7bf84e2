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
    CompileOpt, Compression, DeviceOpt, DtypeOpt, Flag, ModelOpt, ThreadsOpt, TrustOpt, compression_options,
    given_on_command_line, option_group, parse_budget, placement_flags,
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


def sweep_option(name: str, help: str, flag: str | None = None):
    """The option of [`ProfileSettings`][h2o_compress.profiling.ProfileSettings]' field ``name``: its default the
    field's (`setting_default`), its flag ``--`` and the name with dashes unless ``flag`` says otherwise."""
    return typer.Option(setting_default(name), flag or "--" + name.replace("_", "-"), help=help)


# -- the sweep's options, their defaults those of ProfileSettings ------------------------------------------------------
OutOpt = typer.Option(
    ..., "--out", help="Directory for report.json, report.md, PNG plots, report.html and rows/: new, empty, or "
    "one an earlier profile wrote (a rerun resumes from its rows/); other report files there are not replaced.")
PoliciesOpt = sweep_option("policies", "Eviction policies, comma-separated.")
BudgetsOpt = sweep_option("budgets", "Budgets, comma-separated (1 = no eviction).")
KvBitsOpt = sweep_option("kv_bits", "KV bits, comma-separated.")
SeqLenOpt = sweep_option("seq_lens", "Context lengths of the speed/memory runs.", "--seq-len")
DecodeTokensOpt = sweep_option("decode_tokens", "Decode steps timed after each prefill.")
PplTokensOpt = sweep_option("ppl_tokens", "Tokens of the streaming-perplexity run.")
ChunkSizeOpt = sweep_option("chunk_size", "Tokens per forward pass in the perplexity run: 1 (default) = token by "
                            "token, the exact decode semantics; larger is faster but optimistic, and the report "
                            "labels it chunked.")
AgreementPromptsOpt = sweep_option("agreement_prompts", "Shipped prompts for agreement (0 = skip).")
MaxNewTokensOpt = sweep_option("max_new_tokens", "Tokens generated per agreement prompt.")
NeedleLengthsOpt = sweep_option("needle_lengths", "Passkey context lengths (empty = skip).")
NeedleDepthsOpt = sweep_option("needle_depths", "Passkey depths in [0, 1].")
TextFileOpt = sweep_option("text_file", "Text for perplexity/speed (default: shipped corpus).")
QualityTextsOpt = sweep_option(
    "quality_texts", "More texts, comma-separated, on which every configuration's perplexity (and passkey "
    f"accuracy, with --needle-lengths) is also measured: {', '.join(TEXT_NAMES)}, {REPORTING} (= "
    f"{', '.join(REPORTING_TEXTS)}) or file paths; the report adds a 'Quality per corpus' table (empty = skip).")
IsolateOpt = sweep_option("isolate", "One fresh worker process per configuration (default: on CPU, where the peak "
                          "RSS needs it).", "--isolate/--no-isolate")
LmEvalTasksOpt = sweep_option("lm_eval_tasks", "lm-evaluation-harness tasks scored for every configuration, "
                              "comma-separated (e.g. lambada_openai,hellaswag; empty = skip; needs the lm-eval "
                              "extra).")
LmEvalLimitOpt = sweep_option("lm_eval_limit", "At most N documents per lm-eval task.")
LmEvalIncludePathOpt = sweep_option("lm_eval_include_path", "A folder of extra lm-eval task YAML files.")
RayOpt = typer.Option(
    None, "--ray", metavar="[ADDRESS]",
    help="Run each configuration as a Ray task (pip install 'h2o-compress\\[ray]'): --ray alone starts a local "
    "Ray instance; --ray auto joins the cluster running here; --ray ray://HEAD:10001 or HEAD:6379 an existing "
    "cluster (one GPU per task where it has GPUs).")
ResumeOpt = typer.Option(
    default_of(run_profile, "resume"), "--resume/--no-resume", help="Reuse the rows a previous run of the same sweep "
    "finished in OUT/rows (default); --no-resume measures every row again.")
RenderOpt = typer.Option(
    None, "--render", help="Only re-render the report files from this report.json (e.g. of an interrupted sweep) "
    "into --out; takes no sweep option.")


#: The sweep's grid and measurement options, in their ``--help`` order (`option_group` ``sweep``).
SWEEP_FLAGS = {
    "policies": Flag(str, PoliciesOpt), "budgets": Flag(str, BudgetsOpt), "kv_bits": Flag(str, KvBitsOpt),
    "seq_len": Flag(str, SeqLenOpt), "decode_tokens": Flag(int, DecodeTokensOpt), "ppl_tokens": Flag(int, PplTokensOpt),
    "chunk_size": Flag(int, ChunkSizeOpt), "agreement_prompts": Flag(int, AgreementPromptsOpt),
    "max_new_tokens": Flag(int, MaxNewTokensOpt), "needle_lengths": Flag(str, NeedleLengthsOpt),
    "needle_depths": Flag(str, NeedleDepthsOpt), "text_file": Flag(Optional[str], TextFileOpt),
    "quality_texts": Flag(str, QualityTextsOpt),
}
#: The lm-evaluation-harness options (`option_group` ``lm_eval``).
LM_EVAL_FLAGS = {
    "lm_eval_tasks": Flag(str, LmEvalTasksOpt), "lm_eval_limit": Flag(Optional[int], LmEvalLimitOpt),
    "lm_eval_include_path": Flag(Optional[str], LmEvalIncludePathOpt),
}


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


def sweep_settings(sweep: dict, lm_eval: dict) -> dict:
    """[`ProfileSettings`][h2o_compress.profiling.ProfileSettings]' fields from the values of the `SWEEP_FLAGS`
    and `LM_EVAL_FLAGS` options: the lists parsed (`sweep_lists`), the rest as given. Raises ConfigError."""
    scalars = ("decode_tokens", "ppl_tokens", "chunk_size", "agreement_prompts", "max_new_tokens", "text_file")
    return dict(
        **{name: sweep[name] for name in scalars},
        lm_eval_limit=lm_eval["lm_eval_limit"], lm_eval_include_path=lm_eval["lm_eval_include_path"],
        **sweep_lists(sweep["policies"], sweep["budgets"], sweep["kv_bits"], sweep["seq_len"], sweep["needle_lengths"],
                      sweep["needle_depths"], lm_eval["lm_eval_tasks"], sweep["quality_texts"]),
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
@placement_flags
@option_group("sweep", SWEEP_FLAGS)
@option_group("lm_eval", LM_EVAL_FLAGS)
def profile_command(
    ctx: typer.Context,
    out: str = OutOpt,
    model: str = ModelOpt,
    sweep: dict = None,
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    isolate: Optional[bool] = IsolateOpt,
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    ray: Optional[str] = RayOpt,
    resume: bool = ResumeOpt,
    lm_eval: dict = None,
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
        model=model, device=device, dtype=dtype, isolate=isolate, threads=threads,
        trust_remote_code=trust_remote_code, compile=compile_step, **sweep_settings(sweep, lm_eval),
        **compression.values, placement={k: load[k] for k in PLACEMENT_DEFAULTS},
    )
    with stage_progress():  # a first run converts the model before the sweep's own bar
        report = run_profile(settings, out, ray_address=ray, resume=resume)
    reused = f", {report['rows_reused']} reused from {Path(out) / 'rows'}" if report["rows_reused"] else ""
    typer.echo(f"wrote {Path(out) / 'report.json'}, report.md, report.html and 3 PNG plots "
               f"({len(report['results'])} configurations{reused})")
