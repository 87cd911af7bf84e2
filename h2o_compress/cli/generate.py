"""``h2o-compress generate``: stream an answer through a compressed KV cache.

Every option is validated before anything is loaded or written (a rejected ``--temperature`` never leaves a
``--save-cache`` file behind).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer

from h2o_compress.cli.common import check_cache_paths, fail, load_options, merged_config, set_threads, user_errors
from h2o_compress.cli.options import (
    ChatOpt, CompileOpt, ConfigFileOpt, DeviceOpt, DtypeOpt, ModelOpt, OverwriteOpt, SamplingSeedOpt, StreamJsonOpt,
    TemperatureOpt, ThreadsOpt, TrustOpt, Compression, compression_options, placement_options,
)


@user_errors
@compression_options
@placement_options
def generate(
    ctx: typer.Context,
    prompt: str = typer.Argument(..., help="The prompt."),
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens to generate at most."),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    chat: bool = ChatOpt,
    temperature: float = TemperatureOpt,
    seed: Optional[int] = SamplingSeedOpt,
    as_json: bool = StreamJsonOpt,
    config_file: Optional[str] = ConfigFileOpt,
    save_cache: Optional[str] = typer.Option(
        None, "--save-cache", help="Save the compressed prompt cache (the part a follow-up prompt shares) to this "
        "safetensors file; an existing file must be a cache file unless --overwrite."),
    load_cache: Optional[str] = typer.Option(
        None, "--load-cache", help="Start from a saved prompt cache (the prompt must extend it)."),
    overwrite: bool = OverwriteOpt,
    memory_limit: Optional[str] = typer.Option(
        None, "--memory-limit", help="Let the planner pick budget, bits and group size to fit in this memory "
        "(e.g. 2GiB)."),
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    compression: Compression = None,
    placement: dict = None,
):
    """Generate text with a compressed KV cache, streaming tokens as they come. With --memory-limit the planner
    picks the setting for the weights as loaded (--weights-bits) and the summary gives planned vs measured peak
    memory."""
    from h2o_compress.runtime.generation import check_generation_args, check_prompt
    from h2o_compress.runtime.generation import generate as run_generate
    from h2o_compress.models import load_model

    # -- every check first: nothing is loaded or written before all options are known to be good ---------
    check_prompt(prompt)
    config, overrides = merged_config(compression, config_file,
                                       check_formats=memory_limit is None and load_cache is None)
    check_generation_args(max_new_tokens, temperature, seed)
    from h2o_compress.runtime.compiled import check_compile

    check_compile(compile_step, config)
    if memory_limit is not None and load_cache is not None:
        fail("--memory-limit and --load-cache cannot be combined: a loaded cache keeps the setting it was saved with")
    if memory_limit is not None:
        from h2o_compress.planner import parse_memory
        from h2o_compress.planner.plan import PICKED

        parse_memory(memory_limit)
        fixed = [name for name in PICKED if name in overrides]
        if fixed:
            flags = ", ".join("--" + name.replace("_", "-") for name in fixed)
            fail(f"--memory-limit picks budget, bits and group size itself, so {flags} (given on the command line or "
                 "in --config) would be ignored; allowed: --memory-limit without them, or those settings without "
                 "--memory-limit")
    check_cache_paths(save_cache, load_cache, overwrite)
    load = load_options(device, dtype, placement, config.attention_kernel)
    set_threads(threads)
    if seed is not None:
        import torch

        torch.manual_seed(seed)
    # -- then the work -------------------------------------------------------------------------------------
    from h2o_compress.utils.memory import PeakMemory

    peak = PeakMemory() if memory_limit is not None else None  # from before the weights load: the planner counts them
    lm, tokenizer = load_model(model, trust_remote_code=trust_remote_code, **load)
    if peak is not None:
        peak.loaded()  # the weights are resident: count them, not the transient of loading them
    row = None
    if memory_limit is not None:
        from h2o_compress.planner import choose_for_prompt, describe_choice

        row = choose_for_prompt(lm, tokenizer, prompt, memory_limit, max_new_tokens, chat=chat, base=config,
                                compiled=compile_step)
        config = row.config
        typer.echo(describe_choice(row, memory_limit), err=True)
    if load_cache is None:  # the capacity is known now: refuse a split that leaves no recent window
        from h2o_compress.config import check_usable
        from h2o_compress.runtime.generation import encode_prompt

        check_usable(config, config.capacity(encode_prompt(tokenizer, prompt, chat).shape[1] + max_new_tokens))
    stream = None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    extra, load_s = {}, None
    if save_cache is not None or load_cache is not None:
        from h2o_compress.runtime.prompt_cache import prepare_prompt_cache

        started = time.perf_counter()
        cache = prepare_prompt_cache(
            lm, tokenizer, prompt, config, max_new_tokens, chat, load=load_cache, save=save_cache, expect=overrides,
            overwrite=overwrite,
        )
        load_s = time.perf_counter() - started
        config, extra = cache.config, {"cache": cache}
    result = run_generate(
        lm, tokenizer, prompt, config, max_new_tokens=max_new_tokens, chat=chat, temperature=temperature,
        seed=seed, on_text=stream, compile=compile_step, **extra,
    )
    figures = {k: v for k, v in result.to_dict().items() if k != "token_ids"}
    figures["config"] = config.to_dict()
    figures["model"] = model
    from h2o_compress.models.weights import floating_dtype

    figures["kv_dtype"] = str(floating_dtype(lm)).removeprefix("torch.")
    figures["weights_bits"] = placement["weights_bits"]
    if row is not None:
        figures["planned_peak_bytes"] = row.total_bytes
        figures["measured_peak_bytes"], figures["measured_peak_kind"] = peak.measure()
    if load_s is not None:  # the prompt went through the cache before generate: that time is not "prefill"
        figures["prefill_s"] = load_s
        figures["cache_load_s" if load_cache is not None else "cache_save_s"] = load_s
    if as_json:
        typer.echo(json.dumps(figures))
        return
    sys.stdout.write("\n")
    typer.echo(summary_line(figures, loaded=load_cache is not None, saved=save_cache is not None), err=True)
    if row is not None:
        typer.echo(peak_line(figures), err=True)


def peak_line(figures: dict) -> str:
    """The stderr line of ``--memory-limit``: the planner's total against the peak measured over load + generation."""
    from h2o_compress.planner import format_bytes

    planned, measured = figures["planned_peak_bytes"], figures["measured_peak_bytes"]
    share = f" = {measured / planned:.0%} of planned" if planned else ""
    return (f"[peak memory while generating: planned {format_bytes(planned)} (weights + KV cache + workspace), "
            f"measured {format_bytes(measured)} ({figures['measured_peak_kind']}){share}]")


def summary_line(figures: dict, loaded: bool = False, saved: bool = False) -> str:
    """The stderr summary of one generation: tokens, capacity, KV bytes with the dtype they are stored in and their
    share of an fp16 cache (an fp32 model's 16-bit setting holds twice the fp16 bytes), prompt time, speed."""
    full = figures["kv_bytes_full_fp16"]
    ratio = figures["kv_bytes"] / full if full else 0.0
    if loaded:
        prompt_time = f"cache load + prompt {figures['prefill_s']:.2f} s"
    elif saved:
        prompt_time = f"prefill + cache save {figures['prefill_s']:.2f} s"
    else:
        prompt_time = f"prefill {figures['prefill_s']:.2f} s"
    return (
        f"[{figures['prompt_tokens']} prompt + {figures['new_tokens']} new tokens | capacity "
        f"{figures['capacity'] or 'all'} | KV {figures['kv_bytes'] / 2**20:.2f} MiB ({figures['kv_dtype']} storage) = "
        f"{ratio:.1%} of an fp16 cache | "
        f"{prompt_time} | decode {figures['decode_tokens_per_s']:.1f} tokens/s"
        + (f" compiled (compile {figures['compile_s']:.1f} s)" if figures.get("compiled") else " eager")
        + (f", {figures['decode_kernel']} attention" if figures.get("decode_kernel") else "")
        + "]"
    )
