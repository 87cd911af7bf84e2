"""Command line: ``h2o-compress generate|eval|profile|plan``.

Every user error (an :class:`~h2o_compress.errors.H2OCompressError`) becomes one line on stderr and exit
code 2, never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Optional

import typer

from .config import CompressionConfig
from .errors import ConfigError, H2OCompressError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Compress the KV cache of transformers LMs.")


@app.callback()
def _root() -> None:
    """h2o-compress: H2O eviction + 4/8-bit quantization of the KV cache."""


def fail(message: str) -> None:
    """Print ``error: message`` to stderr and exit with code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def user_errors(fn):
    """Turn H2OCompressError into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except H2OCompressError as exc:
            fail(str(exc))

    return wrapper


def parse_budget(text: str) -> float | int:
    """``"0.2"`` -> 0.2 (fraction of the sequence), ``"100"`` -> 100 (tokens). Raises ConfigError."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"budget {text!r} is not a number; allowed: a fraction in (0, 1] or an integer >= 1") from None
    if value > 1 and value == int(value) and "." not in text:
        return int(value)
    if value > 1:
        raise ConfigError(f"budget={text} is invalid; allowed: a fraction in (0, 1] or an integer number of tokens >= 1")
    return value


def compression_config(
    policy: str, budget: str, heavy_ratio: float, sink_tokens: Optional[int], kv_bits: int,
    k_bits: Optional[int], v_bits: Optional[int], quant: str, group_size: int, residual: int,
    attention_kernel: str = "auto",
) -> CompressionConfig:
    """Build a validated :class:`CompressionConfig` from CLI options."""
    return CompressionConfig(
        policy=policy, budget=parse_budget(budget), heavy_ratio=heavy_ratio, sink_tokens=sink_tokens,
        kv_bits=kv_bits, k_bits=k_bits, v_bits=v_bits, quant=quant, group_size=group_size, residual=residual,
        attention_kernel=attention_kernel,
    )


COMPRESSION_FLAGS = ("policy", "budget", "heavy_ratio", "sink_tokens", "kv_bits", "k_bits", "v_bits", "quant",
                     "group_size", "residual", "attention_kernel")


def apply_config_file(
    config: CompressionConfig, config_file: Optional[str], ctx: typer.Context
) -> tuple[CompressionConfig, dict]:
    """Merge ``--config FILE`` (JSON/TOML) under the compression flags given on the command line (``ctx``).

    Returns ``(config, settings)``: the merged config, and the settings the user asked for explicitly (the
    file's plus the flags given), which a loaded cache's config must match. Raises ConfigError.
    """
    from .config_file import load_config, read_config_values

    sources = {n: ctx.get_parameter_source(n) for n in COMPRESSION_FLAGS}
    given = {n for n, source in sources.items() if source is not None and source.name == "COMMANDLINE"}
    overrides = {k: v for k, v in config.to_dict().items() if k in given}
    if config_file is None:
        return config, overrides
    return load_config(config_file, overrides), {**read_config_values(config_file), **overrides}


# Options shared by every command that compresses (generate, eval, ...).
PolicyOpt = typer.Option("h2o", "--policy", help="Eviction policy: h2o, h2o-mean, local, sink or full.")
BudgetOpt = typer.Option("1.0", "--budget", help="Fraction in (0, 1] of the sequence, or an integer number of tokens.")
HeavyOpt = typer.Option(0.5, "--heavy-ratio", help="Share of the budget for heavy hitters, in [0, 1].")
SinkOpt = typer.Option(None, "--sink-tokens", help="First tokens always kept (default: 4 for sink, else 0).")
BitsOpt = typer.Option(16, "--kv-bits", help="Bits of stored keys and values: 16, 8 or 4.")
KBitsOpt = typer.Option(None, "--k-bits", help="Bits of keys (overrides --kv-bits).")
VBitsOpt = typer.Option(None, "--v-bits", help="Bits of values (overrides --kv-bits).")
QuantOpt = typer.Option("int", "--quant", help="Format: int (ours), nf4, fp4 or int8-blockwise (bitsandbytes).")
GroupOpt = typer.Option(32, "--group-size", help="head_dim elements per scale/zero: 32, 64 or 128.")
ResidualOpt = typer.Option(3, "--residual", help="Newest tokens always kept in 16-bit (window of N to 2N-1, quantized in blocks).")
KernelOpt = typer.Option(
    "auto", "--kernel", help="Decode attention: triton (fused, CUDA), torch, or auto (triton on CUDA when available)."
)
ModelOpt = typer.Option("smollm2-135m", "--model", help="Alias, local model directory or hub id.")
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
DtypeOpt = typer.Option(None, "--dtype", help="float32, float16 or bfloat16 (default: fp32 on CPU, bf16 on CUDA).")
ConfigFileOpt = typer.Option(None, "--config", help="Compression settings file (.json/.toml); flags given override it.")
SaveCacheOpt = typer.Option(None, "--save-cache", help="Save the compressed prompt cache to this safetensors file.")
LoadCacheOpt = typer.Option(None, "--load-cache", help="Start from a saved prompt cache (the prompt must extend it).")


@app.command()
@user_errors
def generate(
    ctx: typer.Context,
    prompt: str = typer.Argument(..., help="The prompt."),
    model: str = ModelOpt,
    policy: str = PolicyOpt,
    budget: str = BudgetOpt,
    heavy_ratio: float = HeavyOpt,
    sink_tokens: Optional[int] = SinkOpt,
    kv_bits: int = BitsOpt,
    k_bits: Optional[int] = KBitsOpt,
    v_bits: Optional[int] = VBitsOpt,
    quant: str = QuantOpt,
    group_size: int = GroupOpt,
    residual: int = ResidualOpt,
    attention_kernel: str = KernelOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens to generate at most."),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Apply the tokenizer's chat template."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; > 0 samples."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    config_file: Optional[str] = ConfigFileOpt,
    save_cache: Optional[str] = SaveCacheOpt,
    load_cache: Optional[str] = LoadCacheOpt,
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Let the planner pick budget, bits and group size to fit in this memory (e.g. 2GiB)."),
):
    """Generate text with a compressed KV cache, streaming tokens as they come."""
    from .generation import generate as run_generate
    from .models import load_model

    if not prompt.strip():
        fail(f"prompt {prompt!r} is empty; allowed: a non-empty text")
    config = compression_config(
        policy, budget, heavy_ratio, sink_tokens, kv_bits, k_bits, v_bits, quant, group_size, residual, attention_kernel
    )
    config, overrides = apply_config_file(config, config_file, ctx)
    if seed is not None:
        import torch

        torch.manual_seed(seed)
    if memory_limit is not None and load_cache is not None:
        fail("--memory-limit and --load-cache cannot be combined: a loaded cache keeps the setting it was saved with")
    if memory_limit is not None:
        from .planner import choose_for_prompt, describe_choice, parse_memory

        parse_memory(memory_limit)  # a bad limit fails before the model loads
    lm, tokenizer = load_model(model, device=device, dtype=dtype)
    if memory_limit is not None:
        row = choose_for_prompt(lm, tokenizer, prompt, memory_limit, max_new_tokens, chat=chat, base=config)
        config = row.config
        typer.echo(describe_choice(row, memory_limit), err=True)
    stream = None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    extra = {}
    if save_cache is not None or load_cache is not None:
        from .prompt_cache import prepare_prompt_cache

        cache = prepare_prompt_cache(
            lm, tokenizer, prompt, config, max_new_tokens, chat, load=load_cache, save=save_cache, expect=overrides
        )
        config, extra = cache.config, {"cache": cache}
    result = run_generate(
        lm, tokenizer, prompt, config, max_new_tokens=max_new_tokens, chat=chat, temperature=temperature,
        seed=seed, on_text=stream, **extra,
    )
    figures = {k: v for k, v in result.to_dict().items() if k != "token_ids"}
    figures["config"] = config.to_dict()
    figures["model"] = model
    if as_json:
        typer.echo(json.dumps(figures))
        return
    sys.stdout.write("\n")
    ratio = result.kv_bytes / result.kv_bytes_full_fp16 if result.kv_bytes_full_fp16 else 0.0
    typer.echo(
        f"[{result.prompt_tokens} prompt + {result.new_tokens} new tokens | capacity {result.capacity or 'all'} | "
        f"KV {result.kv_bytes / 2**20:.2f} MiB = {ratio:.1%} of fp16 | prefill {result.prefill_s:.2f} s | "
        f"decode {result.decode_tokens_per_s:.1f} tokens/s]",
        err=True,
    )


@app.command()
@user_errors
def plan(
    model: str = typer.Option(..., "--model", help="Local model directory or known model name (e.g. llama-2-7b)."),
    memory: str = typer.Option(..., "--memory", help="Memory limit: 24GiB, 80GB, 512MiB..."),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together."),
    prompt_len: int = typer.Option(2048, "--prompt-len", help="Prompt tokens per sequence."),
    gen_len: int = typer.Option(128, "--gen-len", help="New tokens per sequence."),
    weights_bits: int = typer.Option(16, "--weights-bits", help="Weights: 16 (in --dtype), 8 (LLM.int8) or 4 (NF4)."),
    dtype: str = typer.Option("float16", "--dtype", help="Compute and KV dtype: float16, bfloat16 or float32."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Profile report (JSON) giving the quality order."),
    policies: str = typer.Option("h2o", "--policies", help="Eviction policies to consider (comma-separated)."),
    budgets: str = typer.Option("1.0,0.5,0.25,0.1", "--budgets", help="Budgets: fractions or token counts."),
    bits: str = typer.Option("16,8,4", "--bits", help="KV bit widths to consider."),
    group_sizes: str = typer.Option("32,128", "--group-sizes", help="Group sizes to consider."),
    residuals: str = typer.Option(str(CompressionConfig.residual), "--residuals", help="Residual windows to consider."),
    quant: str = QuantOpt,
    heavy_ratio: float = HeavyOpt,
    sink_tokens: Optional[int] = SinkOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the whole plan as one JSON object."),
):
    """Plan memory: which compression settings fit, the largest batch and context for each, and a pick."""
    from .plan_view import print_plan
    from .planner import parse_list
    from .planner import plan as run_plan

    report = run_plan(
        model, memory, batch=batch, prompt_len=prompt_len, gen_len=gen_len, weights_bits=weights_bits, dtype=dtype,
        profile=profile, policies=parse_list(policies, "policies", str), budgets=parse_list(budgets, "budgets", parse_budget),
        bits=parse_list(bits, "bits"), group_sizes=parse_list(group_sizes, "group_sizes"),
        residuals=parse_list(residuals, "residuals"), quant=quant, heavy_ratio=heavy_ratio, sink_tokens=sink_tokens,
    )
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
    else:
        print_plan(report)


from .profiling.cli import register as _register_profiling  # noqa: E402  (eval + profile commands)

_register_profiling(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
