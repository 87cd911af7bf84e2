"""``h2o-compress eval perplexity|needle|ruler|agreement|lm-eval``: quality under compression against the uncompressed cache.

User errors exit with code 2 and one line (`user_errors`); every option is
checked before the model loads.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import typer

from h2o_compress.runtime.compiled import check_compile
from h2o_compress.config import COMMAND_POLICY, CompressionConfig, check_usable
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.cli.common import load_options, set_threads, user_errors
from h2o_compress.cli.lm_eval_command import lm_eval_command
from h2o_compress.cli.progress import stage_progress
from h2o_compress.cli.options import (
    CompileOpt,
    Compression, DeviceOpt, DtypeOpt, JsonOpt, ModelOpt, ThreadsOpt, TrustOpt, compression_options, placement_flags,
)
from h2o_compress import models
from h2o_compress.evaluation.agreement import agreement_eval
from h2o_compress.evaluation.corpus import TEXT_NAMES, TextNameWarning, load_prompts, load_text
from h2o_compress.evaluation.needle import check_needle_args, needle_eval
from h2o_compress.evaluation.perplexity import text_perplexity
from h2o_compress.policies import policy_names
from h2o_compress.evaluation.ruler import RATIOS, TASKS, check_ruler_args, ruler_eval
from h2o_compress.utils.checks import check_count

eval_app = typer.Typer(
    add_completion=False, no_args_is_help=True,
    help="Measure quality under compression against the uncompressed cache on your model and text.",
)

def parse_list(text: str, cast: Callable, name: str, allowed: str) -> list:
    """``"a,b,c"`` -> ``[cast(a), cast(b), cast(c)]``; an empty string gives ``[]``. Raises ConfigError."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return [cast(part) for part in items]
    except (ValueError, ConfigError):
        raise ConfigError(f"{name}={short(text)} is invalid; allowed: {allowed}") from None


@contextmanager
def progress_bar(description: str, enabled: bool = True):
    """A transient rich progress bar on stderr; yields ``update(done, total)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not enabled) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _load(model: str, device: str, dtype: Optional[str], threads: Optional[int], trust: bool, placement: dict,
          attention_kernel: str, show_progress: bool = True):
    """Load the model as the flags say (``placement``: the weights/placement flags, see
    `placement_flags`; ``attention_kernel``: ``--kernel``, checked against the
    device first); ``show_progress``: a bar on stderr while a first run converts the model."""
    options = load_options(device, dtype, placement, attention_kernel)
    set_threads(threads)
    with stage_progress(show_progress):  # a first-run conversion of the model
        return models.load_model(model, trust_remote_code=trust, **options)


def checked_text(text_file: str) -> str:
    """The text of ``--text-file`` (`load_text`), read before the model loads so a bad file fails first; when a
    shipped text's name is also a file in the current folder, one ``warning:`` line on stderr says which is read
    (and later reads say nothing more)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = load_text(text_file)
    for warning in caught:
        if issubclass(warning.category, TextNameWarning):
            typer.echo(f"warning: {warning.message}", err=True)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    warnings.filterwarnings("ignore", category=TextNameWarning)  # said once
    return text


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f} MiB"


@eval_app.command("perplexity")
@user_errors
@compression_options
@placement_flags
def perplexity_command(
    ctx: typer.Context,
    text_file: Optional[str] = typer.Option(None, "--text-file", help="UTF-8 text file, or a shipped text by name: "
                                            f"{', '.join(TEXT_NAMES)} (default: sherlock, the tuning text)."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Tokens of the text to read (the budget is relative to it)."),
    chunk_size: int = typer.Option(
        1, "--chunk-size", help="Tokens per forward pass: 1 = exact decode semantics; larger is faster but "
        "slightly optimistic (tokens of a chunk see each other uncompressed)."),
    model: str = ModelOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt,
    reference: bool = typer.Option(True, "--reference/--no-reference",
                                   help="Also score the text with the uncompressed cache (one fast pass)."),
    as_json: bool = JsonOpt, threads: Optional[int] = ThreadsOpt, trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    compression: Compression = None, placement: dict = None,
):
    """Streaming perplexity: the text is read through the compressed cache chunk by chunk."""
    config = compression.config()
    check_compile(compile_step, config)
    check_count("max_tokens", max_tokens, minimum=2)
    check_usable(config, config.capacity(max_tokens))
    check_count("chunk_size", chunk_size)
    if text_file is not None:
        checked_text(text_file)  # fail on a bad file before loading the model
    lm, tokenizer = _load(model, device, dtype, threads, trust_remote_code, placement, config.attention_kernel,
                          not as_json)
    with progress_bar("reading", enabled=not as_json) as update:
        result = text_perplexity(lm, tokenizer, text_file, max_tokens, config, chunk_size, reference, update,
                                 compile=compile_step)
    figures = result.to_dict()
    figures["model"] = model
    figures["text"] = text_file or "shipped corpus (sherlock_holmes.txt)"
    if as_json:
        typer.echo(json.dumps(figures))
        return
    ratio = f" = {result.perplexity_ratio:.4f}x the uncompressed {result.reference_perplexity:.3f}" if reference else ""
    typer.echo(f"perplexity {result.perplexity:.3f}{ratio}")
    typer.echo(
        f"{result.tokens} tokens, chunk {chunk_size}, capacity {result.capacity or 'all'} | KV {_mib(result.kv_bytes)} "
        f"= {result.kv_bytes / result.kv_bytes_full_fp16:.1%} of fp16 ({_mib(result.kv_bytes_full_fp16)}) | "
        f"{result.tokens_per_s:.1f} tokens/s"
    )


@eval_app.command("needle")
@user_errors
@compression_options(defaults={"policy": COMMAND_POLICY})
@placement_flags
def needle_command(
    ctx: typer.Context,
    lengths: str = typer.Option("512,1024", "--lengths", help="Context lengths in tokens, comma-separated."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="Needle depths in [0, 1], comma-separated."),
    trials: int = typer.Option(1, "--trials", help="Prompts per (length, depth), each with its own passkey."),
    seed: int = typer.Option(0, "--seed", help="Seed of the passkeys and haystack offsets."),
    chunk_size: Optional[int] = typer.Option(
        None, "--chunk-size", help="Read the prompt in chunks of this many tokens, so eviction acts while it is "
        "read (default: one pass, as generate does)."),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", help="Tokens of the answer."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Use the tokenizer's chat template."),
    protocol: str = typer.Option(
        "question-in-prompt", "--protocol", help="question-in-prompt (the budget covers prompt + answer) or "
        "compress-then-ask (the document is compressed before the question is read; see 'ask')."),
    keys: int = typer.Option(1, "--keys", help="Passkeys per haystack (1 to 10), numbered and spread over it, each "
                             "asked for in its own question: accuracy per key."),
    text_file: Optional[str] = typer.Option(
        None, "--text-file", help="UTF-8 prose file for the haystack, or a shipped text by name: "
        f"{', '.join(TEXT_NAMES)} (default: sherlock, the tuning text)."),
    model: str = ModelOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, as_json: bool = JsonOpt,
    threads: Optional[int] = ThreadsOpt, trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt, compression: Compression = None, placement: dict = None,
):
    """Passkey retrieval: accuracy per (context length, depth), compressed vs uncompressed."""
    config = compression.config(frozen=protocol == "compress-then-ask")
    check_compile(compile_step, config)
    length_list = parse_list(lengths, int, "lengths", "integers >= 64, e.g. 512,1024")
    depth_list = parse_list(depths, float, "depths", "fractions in [0, 1], e.g. 0,0.5,1")
    check_needle_args(length_list, depth_list, trials, max_new_tokens, chunk_size, protocol, seed, keys)
    corpus = None if text_file is None else checked_text(text_file)  # a bad file fails before loading the model
    lm, tokenizer = _load(model, device, dtype, threads, trust_remote_code, placement, config.attention_kernel,
                          not as_json)
    with progress_bar("needle", enabled=not as_json) as update:
        result = needle_eval(lm, tokenizer, config, tuple(length_list), tuple(depth_list), trials, seed, chunk_size,
                             max_new_tokens, True, chat, corpus=corpus, progress=update, compile=compile_step,
                             protocol=protocol, keys=keys)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "model": model}))
        return
    print_needle(result, length_list, depth_list)


def print_needle(result, lengths: list[int], depths: list[float]) -> None:
    """The accuracy table of ``eval needle`` (per length and depth; per key with several keys) and its overall line."""
    from rich.console import Console
    from rich.table import Table

    accuracy = result.accuracy
    table = Table(title="passkey accuracy: compressed / uncompressed")
    table.add_column("length")
    for depth in depths:
        table.add_column(f"depth {depth:g}", justify="right")
    for length in lengths:
        cells = [f"{accuracy['compressed'][length][float(d)]:.2f} / {accuracy['reference'][length][float(d)]:.2f}"
                 for d in depths]
        table.add_row(str(length), *cells)
    Console().print(table)
    per_key = result.per_key
    if len(per_key["compressed"]) > 1:
        typer.echo("per key: " + ", ".join(f"key {k} {a:.2f} / {per_key['reference'][k]:.2f}"
                                           for k, a in per_key["compressed"].items()))
    typer.echo(f"overall: compressed {result.overall('compressed'):.2f}, uncompressed {result.overall('reference'):.2f}")


@eval_app.command("ruler")
@user_errors
@compression_options(only=("kv_bits", "k_bits", "v_bits", "quant", "group_size", "residual", "heavy_ratio",
                           "sink_tokens", "prefill_chunk_size"))
@placement_flags
def ruler_command(
    ctx: typer.Context,
    policies: str = typer.Option(COMMAND_POLICY, "--policies", help="Eviction policies, comma-separated (default: "
                                 f"{COMMAND_POLICY}, the commands' default)."),
    ratios: str = typer.Option(",".join(map(str, RATIOS)), "--ratios", help="Shares of each prompt's tokens removed "
                               "(kvpress's compression ratio), comma-separated, each in [0, 1)."),
    tasks: str = typer.Option(",".join(TASKS), "--tasks", help=f"RULER tasks, comma-separated: {', '.join(TASKS)}."),
    length: int = typer.Option(4096, "--length", help="Tokens of each prompt (chat template included)."),
    samples: int = typer.Option(3, "--samples", help="Prompts per task, each seeded."),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Also run the uncompressed cache."),
    model: str = ModelOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, as_json: bool = JsonOpt,
    threads: Optional[int] = ThreadsOpt, trust_remote_code: bool = TrustOpt,
    compression: Compression = None, placement: dict = None,
):
    """RULER-style synthetic tasks (needles, variable tracking, common words) at kvpress's compression ratios."""
    base = compression.config()
    policy_list = parse_list(policies, lambda name: CompressionConfig(policy=name).policy, "policies",
                             "policy names, comma-separated, of " + ", ".join(policy_names()))
    ratio_list = parse_list(ratios, float, "ratios", "fractions in [0, 1), e.g. 0.25,0.5,0.75,0.875")
    task_list = parse_list(tasks, str, "tasks", ", ".join(TASKS))
    check_ruler_args(task_list, ratio_list, samples, length)
    if not policy_list or not ratio_list or not task_list:
        raise ConfigError("policies, ratios and tasks must not be empty; allowed: e.g. --policies h2o --ratios 0.75")
    lm, tokenizer = _load(model, device, dtype, threads, trust_remote_code, placement, base.attention_kernel,
                          not as_json)
    with progress_bar("ruler", enabled=not as_json) as update:
        result = ruler_eval(lm, tokenizer, policy_list, tuple(ratio_list), tuple(task_list), samples, length, base,
                            reference, update)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "model": model}))
        return
    print_ruler(result, task_list)


def print_ruler(result, tasks: list[str]) -> None:
    """The score table of ``eval ruler``: a row per setting (task scores, their mean, KV bytes of fp16)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"RULER at {result.length} tokens: share of the expected strings found")
    for column in ("setting", *tasks, "mean", "KV of fp16"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for setting, scores in result.scores.items():
        table.add_row(setting, *(f"{scores[t]:.2f}" for t in tasks), f"{result.mean(setting):.2f}",
                      f"{result.kv_share[setting]:.1%}")
    Console().print(table)


@eval_app.command("agreement")
@user_errors
@compression_options
@placement_flags
def agreement_command(
    ctx: typer.Context,
    prompts_file: Optional[str] = typer.Option(
        None, "--prompts-file", help="JSON list of prompts or one prompt a line (default: the shipped prompts)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use only the first N prompts (N at most their number)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate per prompt."),
    model: str = ModelOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, as_json: bool = JsonOpt,
    threads: Optional[int] = ThreadsOpt, trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt, compression: Compression = None, placement: dict = None,
):
    """Greedy generations with and without compression: token match rate and ROUGE-L."""
    config = compression.config()
    check_compile(compile_step, config)
    check_count("max_new_tokens", max_new_tokens)
    prompts = load_prompts(prompts_file)
    if limit is not None:  # more than there are would be ignored silently: refused, naming how many there are
        prompts = prompts[: check_count("limit", limit, unit="prompts", maximum=len(prompts))]
    lm, tokenizer = _load(model, device, dtype, threads, trust_remote_code, placement, config.attention_kernel,
                          not as_json)
    with progress_bar("generating", enabled=not as_json) as update:
        result = agreement_eval(lm, tokenizer, config, prompts, max_new_tokens, progress=update, compile=compile_step)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "model": model}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="greedy agreement with the uncompressed cache")
    for name in ("prompt", "token match", "prefix match", "ROUGE-L"):
        table.add_column(name, justify="left" if name == "prompt" else "right")
    for item in result.items:
        table.add_row(item.prompt[:50], f"{item.token_match:.2f}", f"{item.prefix_match:.2f}", f"{item.rouge_l:.2f}")
    table.add_row("[bold]mean", f"{result.token_match:.2f}", f"{result.prefix_match:.2f}", f"{result.rouge_l:.2f}")
    Console().print(table)


eval_app.command("lm-eval")(lm_eval_command)
