"""``h2o-compress generate``: stream an answer through a compressed KV cache.

Every option is validated before anything is loaded or written (a rejected ``--temperature`` never leaves a
``--save-cache`` file behind).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Optional

import typer

from h2o_compress.config import COMMAND_POLICY
from h2o_compress.evaluation.corpus import read_text_file
from h2o_compress.utils.errors import InputError
from h2o_compress.utils.files import MAX_TEXT_BYTES
from h2o_compress.cli.common import load_options, merged_config, user_errors
from h2o_compress.cli.options import (
    ChatOpt, CompileOpt, ConfigFileOpt, DeviceOpt, DtypeOpt, ModelOpt, OverwriteOpt, SamplingSeedOpt, StreamJsonOpt,
    TemperatureOpt, ThreadsOpt, TrustOpt, Compression, Flag, compression_options, option_group, placement_flags,
)
from h2o_compress.cli.progress import stage_progress
from h2o_compress.jobs.generate import GenerateJob
from h2o_compress.utils.defaults import default_of
from h2o_compress.planner import format_bytes


def write_piece(piece: str) -> None:
    """Stream a new piece of generated text to stdout."""
    sys.stdout.write(piece)
    sys.stdout.flush()


@dataclass(frozen=True)
class Generation:
    """What `generation_options` hands a command: the values of the options ``generate`` and ``ask`` share."""

    device: str
    dtype: Optional[str]
    chat: bool
    temperature: float
    seed: Optional[int]
    as_json: bool
    config_file: Optional[str]
    save_cache: Optional[str]
    load_cache: Optional[str]
    overwrite: bool

    def job_settings(self) -> dict:
        """The fields a job takes as they are (``chat``, ``temperature``, ``seed``, the cache files, ``overwrite``)."""
        return {name: getattr(self, name) for name in ("chat", "temperature", "seed", "save_cache", "load_cache",
                                                       "overwrite")}


def generation_options(save_help: str, load_help: str):
    """Decorator: the options ``generate`` and ``ask`` share (``--device``, ``--dtype``, ``--chat``,
    ``--temperature``, ``--seed``, ``--json``, ``--config``, ``--save-cache``, ``--load-cache``, ``--overwrite``),
    put where the command's parameter ``options`` stands (`option_group`) and handed to it as that one keyword
    argument, a `Generation`.

    Args:
        save_help: the help of ``--save-cache`` (what the command saves).
        load_help: the help of ``--load-cache`` (what it starts from).
    """
    return option_group("options", {
        "device": Flag(str, DeviceOpt), "dtype": Flag(Optional[str], DtypeOpt), "chat": Flag(bool, ChatOpt),
        "temperature": Flag(float, TemperatureOpt), "seed": Flag(Optional[int], SamplingSeedOpt),
        "as_json": Flag(bool, StreamJsonOpt), "config_file": Flag(Optional[str], ConfigFileOpt),
        "save_cache": Flag(Optional[str], typer.Option(None, "--save-cache", help=save_help)),
        "load_cache": Flag(Optional[str], typer.Option(None, "--load-cache", help=load_help)),
        "overwrite": Flag(bool, OverwriteOpt),
    }, Generation)


@user_errors
@compression_options(defaults={"policy": COMMAND_POLICY})
@placement_flags
@generation_options(
    save_help="Save the compressed prompt cache (the part a follow-up prompt shares) to this safetensors file; an "
    "existing file must be a cache file unless --overwrite.",
    load_help="Start from a saved prompt cache (the prompt must extend it).")
def generate(
    ctx: typer.Context,
    prompt: Optional[str] = typer.Argument(None, help="The prompt (or --prompt-file)."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", help="Read the prompt from this UTF-8 file "
                                              "('-': standard input) instead of the argument."),
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(
        default_of(GenerateJob, "max_new_tokens"), "--max-new-tokens", help="Tokens to generate at most."),
    options: Generation = None,
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
    prompt = prompt_text(prompt, prompt_file)
    config, given = merged_config(compression, options.config_file, usable=False,  # GenerateJob checks it
                                  check_formats=memory_limit is None and options.load_cache is None)
    job = GenerateJob(  # checks every option: nothing is loaded or written before all are known to be good
        prompt, model, config, max_new_tokens=max_new_tokens, compile=compile_step, memory_limit=memory_limit,
        given=given, load=load_options(options.device, options.dtype, placement, config.attention_kernel),
        threads=threads, trust_remote_code=trust_remote_code, **options.job_settings())
    with stage_progress(enabled=not options.as_json):  # converting the model (first run), a scoring pass (kvzip)
        report = job.run(on_text=None if options.as_json else write_piece,
                         on_plan=lambda line: typer.echo(line, err=True))
    if options.as_json:
        typer.echo(json.dumps(report.figures))
        return
    sys.stdout.write("\n")
    typer.echo(summary_line(report.figures, loaded=options.load_cache is not None,
                            saved=options.save_cache is not None), err=True)
    if report.plan is not None:
        typer.echo(peak_line(report.figures), err=True)


def prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt: the argument, or the text of ``--prompt-file`` (``-``: standard input), one of them.

    Raises:
        InputError: both or neither given, or a file that is missing, not UTF-8 or too large.
    """
    if (prompt is None) == (prompt_file is None):
        raise InputError("give the prompt as the argument or with --prompt-file, one of them; allowed: "
                         "h2o-compress generate \"...\" or h2o-compress generate --prompt-file FILE")
    if prompt_file is None:
        return prompt
    if prompt_file == "-":
        text = sys.stdin.buffer.read(MAX_TEXT_BYTES + 1)
        if len(text) > MAX_TEXT_BYTES:
            raise InputError(f"the prompt on standard input is over {MAX_TEXT_BYTES} bytes; allowed: a shorter text")
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"the prompt on standard input is not UTF-8 (byte {exc.start}); allowed: UTF-8 "
                             "text") from None
    return read_text_file(prompt_file)


def peak_line(figures: dict) -> str:
    """The stderr line of ``--memory-limit``: the planner's total against the peak measured over load + generation."""
    planned, measured = figures["planned_peak_bytes"], figures["measured_peak_bytes"]
    share = f" = {measured / planned:.0%} of planned" if planned else ""
    return (f"[peak memory while generating: planned {format_bytes(planned)} (weights + KV cache + workspace), "
            f"measured {format_bytes(measured)} ({figures['measured_peak_kind']}){share}]")


def summary_line(figures: dict, loaded: bool = False, saved: bool = False) -> str:
    """The stderr summary of one generation: tokens, capacity (or why nothing was evicted), KV bytes and their share
    of the uncompressed cache, prompt time, speed."""
    if loaded:
        prompt_time = f"cache load + prompt {figures['prefill_s']:.2f} s"
    elif saved:
        prompt_time = f"prefill + cache save {figures['prefill_s']:.2f} s"
    else:
        prompt_time = f"prefill {figures['prefill_s']:.2f} s"
    return (
        f"[{figures['prompt_tokens']} prompt + {figures['new_tokens']} new tokens | {capacity_text(figures)} | "
        f"{kv_share_text(figures)} | {prompt_time} | decode {figures['decode_tokens_per_s']:.1f} tokens/s"
        + (f" compiled (compile {figures['compile_s']:.1f} s)" if figures.get("compiled") else " eager")
        + (f", {figures['decode_kernel']} attention" if figures.get("decode_kernel") else "")
        + "]"
    )


def capacity_text(figures: dict) -> str:
    """What eviction did: ``capacity N of M tokens (K evicted per layer and KV head)``, with a note where the floor
    ``--min-capacity`` kept more than a fractional ``--budget`` asks for, or ``capacity all`` with the reason nothing
    was evicted."""
    config = figures.get("config") or {}
    budget, floor = config.get("budget", 1.0), figures.get("min_capacity", 0)
    read = figures["prompt_tokens"] + max(figures["new_tokens"] - 1, 0)  # the last new token is never cached
    capacity = figures["capacity"]
    if capacity is not None:
        text = f"capacity {capacity} of {read} tokens ({max(read - capacity, 0)} evicted per layer and KV head)"
        length = figures["prompt_tokens"] + figures.get("max_new_tokens", figures["new_tokens"])
        asked = math.ceil(budget * length) if isinstance(budget, float) else capacity
        if asked < capacity == floor:
            text += (f"; --budget {budget} alone keeps {asked}, the floor --min-capacity {floor} keeps {floor} "
                     "(--min-capacity 0 turns it off)")
        return text
    if config.get("policy") != "full" and isinstance(budget, float) and budget < 1 and floor:
        return (f"capacity all ({figures['prompt_tokens'] + figures['new_tokens']} tokens <= --min-capacity {floor}: "
                "nothing evicted)")
    return "capacity all"


def kv_share_text(figures: dict) -> str:
    """The KV bytes held and their share of the uncompressed cache in the model's own dtype, counted like with like
    (the keys and values of the tokens held against those of every token seen: 100% when nothing is evicted or
    quantized), then what the cache holds beside them: bookkeeping (positions, scores) and free slots, and a
    hybrid model's constant states (uncompressed, not in the share)."""
    held, full, dtype = figures.get("kv_bytes_held"), figures.get("kv_bytes_full"), figures["kv_dtype"]
    states = figures.get("kv_state_bytes") or 0
    if held is None or not full:  # figures of an older run: the footprint alone
        return f"KV {figures['kv_bytes'] / 2**20:.2f} MiB"
    text = f"KV {format_bytes(held)} = {held / full:.1%} of the uncompressed cache ({dtype}, the model's dtype)"
    extra = figures["kv_bytes"] - held - states
    if extra > 0:
        text += f" + {format_bytes(extra)} positions, scores and free slots"
    if states:
        text += f" + {format_bytes(states)} linear-attention/SSM states (uncompressed)"
    return text
