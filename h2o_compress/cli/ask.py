"""``h2o-compress ask``: compress a document once, then answer questions about it (compress-then-ask).

Every option is validated before anything is loaded or written.
"""

from __future__ import annotations

import json
import sys
import time
from typing import List, Optional

import typer

from h2o_compress.runtime.ask import ASK_DEFAULTS
from h2o_compress.utils.errors import ConfigError, short
from h2o_compress.cli.common import check_cache_paths, fail, load_options, merged_config, set_threads, user_errors
from h2o_compress.cli.generate import summary_line
from h2o_compress.cli.options import (
    ChatOpt, CompileOpt, ConfigFileOpt, DeviceOpt, DtypeOpt, ModelOpt, OverwriteOpt, SamplingSeedOpt, StreamJsonOpt,
    TemperatureOpt, ThreadsOpt, TrustOpt, Compression, compression_options, placement_options,
)

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
    """:func:`merged_config` with ``ask``'s defaults; where the setting refuses them, those of
    :data:`SOFT_DEFAULTS` not given on the command line fall back to ``uniform``. Raises ConfigError (the setting's
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
@placement_options
def ask(
    ctx: typer.Context,
    context_file: str = typer.Option(..., "--context-file", help="The document (UTF-8 text), compressed once."),
    question: List[str] = typer.Option(..., "--question", help="A question (repeat for several)."),
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens per answer at most."),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    chat: bool = ChatOpt,
    temperature: float = TemperatureOpt,
    seed: Optional[int] = SamplingSeedOpt,
    as_json: bool = StreamJsonOpt,
    config_file: Optional[str] = ConfigFileOpt,
    save_cache: Optional[str] = typer.Option(
        None, "--save-cache", help="Save the compressed context to this safetensors file (an existing file must be "
        "a cache file unless --overwrite)."),
    load_cache: Optional[str] = typer.Option(
        None, "--load-cache", help="Start from a compressed context saved with --save-cache (same document)."),
    overwrite: bool = OverwriteOpt,
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    compression: Compression = None,
    placement: dict = None,
):
    """Compress a document once (defaults: kvzip with global layer budgets and adaptive heads, budget 0.2 of the
    document, heavy ratio 1 with 4 sinks, 4 bits), then answer each --question from the same compressed context."""
    from h2o_compress.runtime.ask import CompressedContext, check_questions_fit, compress
    from h2o_compress.runtime.ask import ask as run_ask
    from h2o_compress.runtime.compiled import check_compile
    from h2o_compress.utils.files import MAX_TEXT_BYTES, read_text
    from h2o_compress.utils.errors import InputError
    from h2o_compress.runtime.generation import check_generation_args, check_prompt
    from h2o_compress.models import load_model
    from h2o_compress.models.weights import floating_dtype

    # -- every check first ---------------------------------------------------------------------------------
    context = read_text(context_file, "context file", InputError, limit=MAX_TEXT_BYTES)
    if not context.strip():
        fail(f"context file {short(context_file)} is empty (or whitespace only); allowed: a document to ask about")
    check_prompt(context)
    for text in question:
        check_prompt(text)
    config, overrides = fitted_config(compression, config_file, check_formats=load_cache is None)
    check_generation_args(max_new_tokens, temperature, seed)
    check_compile(compile_step, config)
    if save_cache is not None and load_cache is not None:
        fail("--save-cache and --load-cache cannot be combined: a loaded context is already saved")
    check_cache_paths(save_cache, load_cache, overwrite)
    load = load_options(device, dtype, placement, config.attention_kernel)
    set_threads(threads)
    # -- then the work -------------------------------------------------------------------------------------
    lm, tokenizer = load_model(model, trust_remote_code=trust_remote_code, **load)
    check_questions_fit(lm, tokenizer, context, question, max_new_tokens, chat)  # before minutes of compressing
    started = time.perf_counter()
    if load_cache is not None:
        compressed = CompressedContext.load(load_cache, lm, tokenizer, context, chat, config=overrides)
    else:
        compressed = compress(lm, tokenizer, context, config, chat=chat)
    context_s = time.perf_counter() - started
    if save_cache is not None:
        compressed.save(save_cache, overwrite=overwrite)
    cache = compressed.cache
    head = {
        "model": model, "config": cache.config.to_dict(), "context_tokens": compressed.tokens,
        "context_kv_bytes": cache.nbytes(), "context_kv_bytes_full_fp16": cache.full_fp16_nbytes(),
        "capacity": cache.capacity, ("cache_load_s" if load_cache else "compress_s"): context_s,
    }
    if not as_json:
        typer.echo(
            f"[context: {head['context_tokens']} tokens, capacity {head['capacity'] or 'all'}, KV "
            f"{head['context_kv_bytes'] / 2**20:.2f} MiB = {head['context_kv_bytes'] / max(1, head['context_kv_bytes_full_fp16']):.1%}"
            f" of an fp16 cache, {'loaded' if load_cache else 'compressed'} in {context_s:.2f} s]", err=True,
        )
    answers = []
    kv_dtype = str(floating_dtype(lm)).removeprefix("torch.")
    for text in question:
        if not as_json:
            sys.stdout.write(f"Q: {text}\nA: ")
        stream = None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        result = run_ask(lm, tokenizer, compressed, text, max_new_tokens=max_new_tokens, temperature=temperature,
                         seed=seed, on_text=stream, compile=compile_step)
        figures = {k: v for k, v in result.to_dict().items() if k != "token_ids"}
        figures["question"] = text
        answers.append(figures)
        if not as_json:
            sys.stdout.write("\n")
            typer.echo(summary_line({**figures, "kv_dtype": kv_dtype}), err=True)
    if as_json:
        typer.echo(json.dumps({**head, "answers": answers}))
