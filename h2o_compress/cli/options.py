"""The options shared by the commands, declared once (a leaf module: it imports nothing of the CLI).

`compression_options` adds the compression flags (``--policy``, ``--budget``, ... ``--kernel``) to a
command and hands it one validated [`CompressionConfig`][h2o_compress.config.CompressionConfig] built from them, plus the names the user gave on
the command line (so ``--config FILE`` can merge under them). The model-runtime options (``--model``,
``--device``, ``--dtype``, ``--threads``) are declared here too.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass, field
from typing import Optional

import typer
from typer.core import TyperCommand

from h2o_compress.formats import FORMATS, GROUP_SIZES
from h2o_compress.models import load_model
from h2o_compress.planner import plan
from h2o_compress.runtime.generation import generate
from h2o_compress.utils.defaults import default_of
from h2o_compress.config import ALLOWED_BITS, DEFAULT_MIN_CAPACITY, SETTING_DEFAULTS, CompressionConfig, check_format_options, check_usable, parse_budget  # noqa: F401 (parse_budget: re-exported)
from h2o_compress.policies import PolicyOption, describe_policies, option_declarations, policy_names_taking

# -- the compression options (one declaration each) -------------------------------------------------------
@dataclass(frozen=True)
class _Flag:
    annotation: object
    option: object


#: An option declared once: its parameter's annotation and its typer option (the entries of `option_group`).
Flag = _Flag


def _or(values) -> str:
    """``a, b or c``: the allowed values in a help text."""
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else "".join(values)


#: The defaults of the flags: CompressionConfig's own (each written once, in the dataclass).
DEFAULT = dict(SETTING_DEFAULTS)

COMPRESSION_FLAGS: dict[str, _Flag] = {
    "policy": _Flag(str, typer.Option(
        DEFAULT["policy"], "--policy", help=f"Eviction policy: {describe_policies()}.")),
    "budget": _Flag(str, typer.Option(
        str(DEFAULT["budget"]), "--budget", help="Fraction in (0, 1] of the sequence, or an integer number of tokens.")),
    "min_capacity": _Flag(Optional[int], typer.Option(
        DEFAULT["min_capacity"], "--min-capacity", help="With a fractional --budget: tokens a layer holds before it "
        f"evicts (nothing is evicted from a sequence this short; a longer one keeps max(budget x length, this)); "
        f"0 = off; when not given: {DEFAULT_MIN_CAPACITY}. A budget in tokens is unaffected.")),
    "heavy_ratio": _Flag(float, typer.Option(
        DEFAULT["heavy_ratio"], "--heavy-ratio", help="Share of the budget for heavy hitters, in [0, 1]; below 1 with eviction while generating (at "
        "least one recent token), 1 only for a context compressed once (ask).")),
    "sink_tokens": _Flag(Optional[int], typer.Option(
        DEFAULT["sink_tokens"], "--sink-tokens", help="First tokens always kept (attention sinks); when not given: 4 for --policy sink, else 0 (ask: 4).")),
    "kv_bits": _Flag(int, typer.Option(DEFAULT["kv_bits"], "--kv-bits", help=f"Bits of stored keys and values: {_or(ALLOWED_BITS[::-1])}.")),
    "k_bits": _Flag(Optional[int], typer.Option(DEFAULT["k_bits"], "--k-bits", help="Bits of keys (overrides --kv-bits).")),
    "v_bits": _Flag(Optional[int], typer.Option(DEFAULT["v_bits"], "--v-bits", help="Bits of values (overrides --kv-bits).")),
    "quant": _Flag(str, typer.Option(
        DEFAULT["quant"], "--quant", help=f"Format: {_or(FORMATS)} (int: ours; the others: bitsandbytes).")),
    "group_size": _Flag(int, typer.Option(DEFAULT["group_size"], "--group-size", help=f"head_dim elements per scale/zero: {_or(GROUP_SIZES)}.")),
    "residual": _Flag(int, typer.Option(
        DEFAULT["residual"], "--residual", help="Newest tokens kept in 16-bit (a ring of N; each token quantized once as it leaves).")),
    "layer_budgets": _Flag(str, typer.Option(
        DEFAULT["layer_budgets"], "--layer-budgets", help="Spread the capacity over the layers: uniform, pyramid (PyramidKV: "
        "more for the first layers, less for the last), global (KVzip: with --policy kvzip or lookahead, each "
        "layer's share of the best-scored tokens over the whole model) or FILE (a JSON list of per-layer weights, "
        "one per layer: each layer its weight's share); same total bytes.")),
    "high_bits_fraction": _Flag(float, typer.Option(
        DEFAULT["high_bits_fraction"], "--high-bits-fraction", help="Share in [0, 1] of the stored tokens kept at 8 bits, the top-ranked by "
        "the policy, the rest at 4 (needs --kv-bits 4, quant int; 0 = off).")),
    "head_budgets": _Flag(str, typer.Option(
        DEFAULT["head_budgets"], "--head-budgets", help="Spread each layer's capacity over its KV heads: uniform, or adaptive "
        "(Ada-KV: heavy hitters ranked over all heads together, same bytes; scoring policies; decode: the CPU kernel on CPU, the torch form on CUDA).")),
    "prefill_chunk_size": _Flag(int, typer.Option(
        DEFAULT["prefill_chunk_size"], "--prefill-chunk", help="Tokens per forward pass of a prompt's prefill: a longer "
        "prompt is fed in chunks (activations bounded by the chunk; the cache scores and evicts after each); 0 = the "
        f"whole prompt in one pass; default {DEFAULT['prefill_chunk_size']}.")),
    "attention_kernel": _Flag(str, typer.Option(
        DEFAULT["attention_kernel"], "--kernel",
        help="Decode step: auto (on CPU one native kernel call per layer, built once with gcc; on CUDA the Triton "
             "op), torch (torch code that --compile fuses) or triton (the Triton op, CUDA).")),
    "calibration": _Flag(Optional[str], typer.Option(
        DEFAULT["calibration"], "--calibration",
        help="With --policy calibrated or --key-offsets calibrated: the calibration file h2o-compress calibrate "
             "wrote (default: the model's own file in the cache root).")),
    "key_offsets": _Flag(str, typer.Option(
        DEFAULT["key_offsets"], "--key-offsets",
        help="none, or calibrated: store 4- or 8-bit int keys around the mean pre-RoPE key h2o-compress calibrate "
             "measured for the model (KVQuant; same bytes, less key error; read from --calibration, else the model's "
             "own or shipped file; not with --head-budgets adaptive, --high-bits-fraction or --kernel triton).")),
}


def policy_option_help(option: PolicyOption) -> str:
    """The help of a policy option's flag: ``With --policy X:`` (the registered policies that take it), its declared
    help, and its default where that is not ``None`` or ``False``."""
    text = f"With --policy {_or(policy_names_taking(option.name))}: {option.help}"
    if option.default is not None and option.default is not False:
        text = f"{text.rstrip().removesuffix('.')} (default {option.default})."
    return text


def policy_option_flag(option: PolicyOption) -> _Flag:
    """The CLI flag of a policy's own option, from its declaration (`policy_option`): a switch for a ``bool`` option,
    else an optional value of its type (``None``: the policy's default)."""
    if option.kind is bool:
        return _Flag(bool, typer.Option(False, option.flag, help=policy_option_help(option)))
    return _Flag(Optional[option.kind], typer.Option(None, option.flag, help=policy_option_help(option)))


#: The policies' own options (`h2o_compress.policies.option_declarations`), each a flag generated from its
#: declaration: the policies registered when this module is first imported.
COMPRESSION_FLAGS.update({name: policy_option_flag(option) for name, option in option_declarations().items()})


@dataclass(frozen=True)
class Compression:
    """What `compression_options` hands a command: the raw flag values, those given explicitly, and the
    command's own defaults (e.g. ``ask``'s), which a ``--config`` file's settings go over."""

    values: dict
    given: frozenset
    defaults: dict = field(default_factory=dict)

    def config(self, check: bool = True, frozen: bool = False) -> CompressionConfig:
        """A validated [`CompressionConfig`][h2o_compress.config.CompressionConfig] of the flags; with ``check``, also refused when the flags make
        no sense together ([`check_usable`][h2o_compress.config.check_usable], ``frozen``: for compress-then-ask) or a
        format flag given would be ignored ([`check_format_options`][h2o_compress.config.check_format_options]). Raises
        ConfigError."""
        values = dict(self.values)
        if "budget" in values:
            values["budget"] = parse_budget(values["budget"])
        config = CompressionConfig.from_values(values)
        if check:
            check_usable(config, frozen=frozen)
            check_format_options(config, self.given)
        return config

    def overrides(self, config: CompressionConfig) -> dict:
        """The fields of ``config`` the user gave on the command line."""
        return {k: v for k, v in {**config.to_dict(), **config.policy_options}.items() if k in self.given}

    def command_defaults(self) -> dict:
        """The command's own defaults of the flags not given (``budget`` parsed): what a ``--config`` file's
        settings go over (``ask`` keeps its policy and budget when the file sets only the bits)."""
        values = {k: v for k, v in self.defaults.items() if k not in self.given}
        if "budget" in values:
            values["budget"] = parse_budget(values["budget"])
        return values


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the parameter ``name`` of the command was given on its command line (not a default or the
    environment)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _with_default(option, default):
    """A copy of a typer option with another default (the flag, help and type unchanged)."""
    changed = copy.copy(option)
    changed.default = default
    return changed


def compression_options(fn=None, *, only: tuple[str, ...] | None = None, defaults: dict | None = None):
    """Decorator: add the compression flags (all, or ``only`` these) to a typer command, with the command's own
    ``defaults`` where given (e.g. ``ask``'s, [`h2o_compress.runtime.ask.ASK_DEFAULTS`][h2o_compress.runtime.ask.ASK_DEFAULTS]).

    The command receives them as one keyword argument ``compression`` (a `Compression`) and needs
    ``ctx: typer.Context`` as its first parameter (to tell flags given from defaults).
    """
    defaults = defaults or {}

    def decorate(command):
        names = tuple(only or COMPRESSION_FLAGS)
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "compression"]
        added = [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, annotation=COMPRESSION_FLAGS[n].annotation,
                default=_with_default(COMPRESSION_FLAGS[n].option, defaults[n]) if n in defaults
                else COMPRESSION_FLAGS[n].option,
            )
            for n in names
        ]

        @functools.wraps(command)
        def wrapper(ctx: typer.Context, *args, **kwargs):
            values = {n: kwargs.pop(n) for n in names}
            given = frozenset(n for n in names if given_on_command_line(ctx, n))
            return command(ctx, *args, compression=Compression(values, given, dict(defaults)), **kwargs)

        hints = {p.name: p.annotation for p in own + added}
        wrapper.__signature__ = signature.replace(parameters=own + added)
        wrapper.__annotations__ = hints
        return wrapper

    return decorate if fn is None else decorate(fn)


# -- model-runtime options --------------------------------------------------------------------------------
ModelOpt = typer.Option(default_of(load_model, "name_or_path"), "--model", help="Alias, local model directory or hub id.")
DeviceOpt = typer.Option(default_of(load_model, "device"), "--device", help="auto, cpu, cuda or cuda:N.")
DtypeOpt = typer.Option(None, "--dtype", help="float32, float16 or bfloat16 (default: fp32 on CPU, bf16 on CUDA).")
ThreadsOpt = typer.Option(
    None, "--threads", help="torch CPU threads (default: torch's; 1-2 is much faster on a busy machine).")
TrustOpt = typer.Option(
    False, "--trust-remote-code",
    help="Allow a model directory or hub repo to run its own Python code (its auto_map). Off by default.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object.")
# -- generation options (generate, ask) --------------------------------------------------------------------
ChatOpt = typer.Option(default_of(generate, "chat"), "--chat/--no-chat", help="Apply the tokenizer's chat template.")
TemperatureOpt = typer.Option(default_of(generate, "temperature"), "--temperature", help="0 = greedy; > 0 samples.")
SamplingSeedOpt = typer.Option(None, "--seed", help="Random seed for sampling.")
StreamJsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of streaming text.")
OverwriteOpt = typer.Option(
    False, "--overwrite", help="Let --save-cache replace an existing file that is not a cache file.")
CompileOpt = typer.Option(
    None, "--compile/--no-compile",
    help="torch.compile the decode step (fullgraph; CUDA graphs on CUDA). Default: on with CUDA, off on CPU "
         "(eager measured faster there: benchmarks/results/decode_speed_cpu.md). The first step pays the compile.")
ConfigFileOpt = typer.Option(None, "--config", help="Compression settings file (.json/.toml); flags given override it.")


# -- weights and placement options (generate, eval, profile; plan takes --weights-bits) -----------------------
WeightsBitsOpt = typer.Option(
    default_of(load_model, "weights_bits"), "--weights-bits", show_default=False,
    help="Weights: 16 (in --dtype), 8 (on CPU torch's packed int8 kernel, on CUDA LLM.int8) or 4 (on CPU torch's "
         "packed int4 kernel in groups of 32, on CUDA NF4; bitsandbytes on CUDA and with --device-map). "
         "Default: 8 on CPU for the embedded smollm2-135m (faster than fp32 at nearly its perplexity), 16 "
         "for other models, on CUDA and with --device-map; --weights-bits 16 loads fp32 weights on CPU.")
PlanWeightsBitsOpt = typer.Option(  # plan's default (16): it plans a model not loaded here, as a GPU loads it
    default_of(plan, "weights_bits"), "--weights-bits", help="Weights of the planned model: 16 (in --dtype), 8 (LLM.int8) or 4 (NF4).")
PLACEMENT_FLAGS: dict[str, _Flag] = {
    "weights_bits": _Flag(Optional[int], WeightsBitsOpt),
    "device_map": _Flag(Optional[str], typer.Option(
        None, "--device-map", help="Split the model with accelerate: auto, balanced, balanced_low_0, sequential, "
        "or a JSON object (or .json file) {module: GPU index, cuda:N, cpu or disk}. Leave --device at auto.")),
    "max_memory": _Flag(Optional[str], typer.Option(
        None, "--max-memory", help="Per-device limits for a --device-map strategy, e.g. 0=20GiB,1=20GiB,cpu=64GiB.")),
    "offload_folder": _Flag(Optional[str], typer.Option(
        None, "--offload-folder", help="Directory for the weights of modules a --device-map puts on disk.")),
}


def placement_flags(command):
    """Decorator: add ``--weights-bits``, ``--device-map``, ``--max-memory`` and ``--offload-folder`` to a typer
    command, handed to it as one keyword argument ``placement`` (a dict of the raw values, keyed like
    [`h2o_compress.load_model`][h2o_compress.load_model]'s arguments; see `h2o_compress.cli.common.load_options`)."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "placement"]
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=f.annotation, default=f.option)
             for n, f in PLACEMENT_FLAGS.items()]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        return command(*args, placement={n: kwargs.pop(n) for n in PLACEMENT_FLAGS}, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=own + added)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
    return wrapper


def option_group(name: str, flags: dict[str, _Flag], gather=dict):
    """Decorator: one option per flag of ``flags``, put where the command's parameter ``name`` stands (so
    ``--help`` lists them there, in the order of ``flags``), handed to the command as that one keyword argument.

    Args:
        name: the command's placeholder parameter (e.g. ``options: Generation = None``).
        flags: the options, by parameter name.
        gather: what the command gets: ``gather(**values)`` of the values by parameter name (default: a dict).
    """

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        params = []
        for param in signature.parameters.values():
            params += [param] if param.name != name else [
                inspect.Parameter(n, param.kind, annotation=f.annotation, default=f.option) for n, f in flags.items()]

        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            return command(*args, **{name: gather(**{n: kwargs.pop(n) for n in flags})}, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


RAY_LOCAL = "local"


class Command(TyperCommand):
    """A command whose usage line names its arguments as click does (``PROMPT``, ``[NAME]``, ``FILES...``):
    typer writes a required one as ``{prompt}``, which reads like a placeholder left unfilled."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                pieces += param.get_usage_pieces(ctx)
                continue
            name = param.metavar or param.name.upper()
            pieces.append((name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else ""))
        return pieces


class RayCommand(Command):
    """A command whose ``--ray`` takes an optional value (typer cannot declare one: ``profile``, ``batch``): a bare
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
