"""``h2o-compress ask``: compress a document once, then answer questions about it (compress-then-ask).

Every option is validated before anything is loaded or written.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from h2o_compress.runtime.ask import ASK_DEFAULTS
from h2o_compress.utils.errors import ConfigError
from h2o_compress.cli.common import load_options, merged_config, user_errors
from h2o_compress.cli.generate import Generation, generation_options, summary_line, write_piece
from h2o_compress.cli.progress import stage_progress
from h2o_compress.cli.options import (
    CompileOpt, ModelOpt, ThreadsOpt, TrustOpt, Compression, compression_options, placement_flags,
)
from h2o_compress.jobs.ask import AskJob
from h2o_compress.utils.defaults import default_of

DEFAULTS = {
    "policy": ASK_DEFAULTS.policy, "budget": str(ASK_DEFAULTS.budget), "heavy_ratio": ASK_DEFAULTS.heavy_ratio,
    "sink_tokens": ASK_DEFAULTS.sink_tokens,
    "kv_bits": ASK_DEFAULTS.kv_bits, "layer_budgets": ASK_DEFAULTS.layer_budgets,
    "head_budgets": ASK_DEFAULTS.head_budgets,
}
#: Defaults that give way: kept only where the rest of the setting allows them (``--policy h2o`` gets uniform
#: layers, ``--policy local`` uniform heads), so that a flag that changes the policy never trips over them.
SOFT_DEFAULTS = ("layer_budgets", "head_budgets")


def fitted_config(compression: Compression, config_file: Optional[str], check_formats: bool = True):
    """`merged_config` with ``ask``'s defaults; where the setting refuses them, those of
    `SOFT_DEFAULTS` not given on the command line fall back to ``uniform``. Raises ConfigError (the setting's
    own, when even that does not fit)."""
    try:
        return merged_config(compression, config_file, frozen=True, check_formats=check_formats)
    except ConfigError:
        soft = {name: "uniform" for name in SOFT_DEFAULTS if name not in compression.given}
        if not soft:
            raise
        return merged_config(Compression({**compression.values, **soft}, compression.given,
                                             {**compression.defaults, **soft}), config_file, frozen=True,
                             check_formats=check_formats)


@user_errors
@compression_options(defaults=DEFAULTS)
@placement_flags
@generation_options(
    save_help="Save the compressed context to this safetensors file (an existing file must be a cache file unless "
    "--overwrite).",
    load_help="Start from a compressed context saved with --save-cache (same document).")
def ask(
    ctx: typer.Context,
    context_file: str = typer.Option(..., "--context-file", help="The document (UTF-8 text), compressed once."),
    question: List[str] = typer.Option(..., "--question", help="A question (repeat for several)."),
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(
        default_of(AskJob, "max_new_tokens"), "--max-new-tokens", help="Tokens per answer at most."),
    options: Generation = None,
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    compression: Compression = None,
    placement: dict = None,
):
    """Compress a document once (defaults: kvzip with global layer budgets and adaptive heads, budget 0.2 of the
    document, heavy ratio 1 with 4 sinks, 4 bits), then answer each --question from the same compressed context."""
    as_json = options.as_json
    config, given = fitted_config(compression, options.config_file, check_formats=options.load_cache is None)
    job = AskJob(  # checks every option: nothing is loaded or written before all are known to be good
        question, context_file=context_file, model=model, config=config, max_new_tokens=max_new_tokens,
        compile=compile_step, given=given, load=load_options(options.device, options.dtype, placement,
                                                             config.attention_kernel),
        threads=threads, trust_remote_code=trust_remote_code, **options.job_settings())
    with stage_progress(enabled=not as_json) as bar:  # converting the model (first run), scoring, prefill
        session = job.start(bar)
    if not as_json:
        typer.echo(context_line(session.figures, loaded=options.load_cache is not None), err=True)
    answers = []
    for text in job.questions:
        if not as_json:
            sys.stdout.write(f"Q: {text}\nA: ")
        answers.append(session.answer(text, on_text=None if as_json else write_piece))
        if not as_json:
            sys.stdout.write("\n")
            typer.echo(summary_line({**answers[-1], "kv_dtype": session.kv_dtype}), err=True)
    if as_json:
        typer.echo(json.dumps({**session.figures, "answers": answers}))


def context_line(figures: dict, loaded: bool = False) -> str:
    """The stderr line of ``ask`` once the context is compressed (or loaded): tokens, capacity, KV bytes and their
    share of an fp16 cache, time."""
    context_s = figures["cache_load_s" if loaded else "compress_s"]
    share = figures["context_kv_bytes"] / max(1, figures["context_kv_bytes_full_fp16"])
    return (f"[context: {figures['context_tokens']} tokens, capacity {figures['capacity'] or 'all'}, KV "
            f"{figures['context_kv_bytes'] / 2**20:.2f} MiB = {share:.1%} of an fp16 cache, "
            f"{'loaded' if loaded else 'compressed'} in {context_s:.2f} s]")
