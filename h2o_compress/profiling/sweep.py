"""``h2o-compress profile``: sweep (policy x budget x kv bits) on one model and measure, per configuration,
what it saves and what it costs (DESIGN.md §4):

- KV bytes (``cache.nbytes()``), and the keys and values held against the uncompressed cache in the model's own
  dtype (float32 on a CPU; `CompressedCache.held_nbytes` / `full_nbytes`, like with like);
- peak memory per context length: ``torch.cuda.max_memory_allocated`` on CUDA, the peak resident set of an
  isolated worker process on CPU (one fresh process per configuration), the peak restarted before each length
  (`reset_peak_memory`: not the load, not a peak inherited from the parent), with what the run added above what
  was held before it and the workspace (that less the KV cache), beside the weights' bytes;
- prefill and decode tokens/s per context length;
- streaming perplexity of the corpus (`perplexity`), greedy agreement with the uncompressed output
  (`h2o_compress.evaluation.agreement`) and, optionally, passkey retrieval (`h2o_compress.evaluation.needle`) and lm-evaluation-harness task scores
  (`h2o_compress.integrations.lm_eval_tasks.score_model`: the ``h2o-compress`` model type on the loaded model).

The uncompressed configuration (``full``, unquantized) always runs first: it is the reference of every ratio.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path

import torch

from h2o_compress.config import ALLOWED_BITS, CompressionConfig, check_usable
from h2o_compress.utils.errors import ConfigError, InputError, short
from h2o_compress.runtime.generation import GenerationResult, make_cache
from h2o_compress.utils.memory import peak_resident_bytes, resident_bytes, restart_peak_resident
from h2o_compress.utils.outputs import OutputDir
from h2o_compress.utils.progress import report_progress
from h2o_compress.evaluation.agreement import agreement_eval, reference_generations
from h2o_compress.evaluation.corpus import (
    REPORTING, TEXT_NAMES, expand_text_names, load_prompts, load_text, tokenize_text,
)
from h2o_compress.evaluation.needle import ANSWER_TOKENS, check_needle_args, needle_eval, plant_needle
from h2o_compress.evaluation.perplexity import streaming_perplexity
from h2o_compress.runtime.compiled import decode_step, resolve_compile, warmup_steps
from h2o_compress.models.weights import floating_dtype
from h2o_compress.evaluation.stream import greedy_decode, model_device, read_stream, step_function, sync
from h2o_compress.utils.checks import check_count
from h2o_compress.utils.defaults import default_of
from h2o_compress.runtime.prefill import context_window
from h2o_compress.attention.choice import check_kernel
from h2o_compress.integrations.lm_eval_tasks import check_tasks, score_model
from h2o_compress.integrations.ray_sweep import RaySweep, check_address, import_ray
from h2o_compress.models import converted_dir, load_model, placement_options, resolve_device
from h2o_compress.models.loading import ALIASES
from h2o_compress.profiling.report import check_out_dir, finalize, record_problem, missing_dirs, prepare_out_dir, remove_empty_dirs, write_report
from h2o_compress.profiling.rows import RowStore, row_key

REFERENCE = CompressionConfig(policy="full", kv_bits=16)
_DEFAULTS = CompressionConfig()


#: ``load_model``'s placement arguments and their defaults (a [`ProfileSettings`][h2o_compress.profiling.ProfileSettings] keeps only those that
#: differ, and always ``weights_bits``, resolved: 8 or 16 for the default ``None``).
PLACEMENT_DEFAULTS = {"weights_bits": default_of(load_model, "weights_bits"), "device_map": None, "max_memory": None,
                      "offload_folder": None}


@dataclass
class ProfileSettings:
    """What [`run_profile`][h2o_compress.profiling.run_profile] sweeps and how much it reads.

    Attributes:
        model: as for [`h2o_compress.load_model`][h2o_compress.load_model].
        device: as for [`h2o_compress.load_model`][h2o_compress.load_model].
        dtype: as for [`h2o_compress.load_model`][h2o_compress.load_model].
        policies: eviction policies tried at every budget below 1.
        budgets: fractions in (0, 1] (or integer token counts); 1.0 means no eviction (policy ``full``).
        kv_bits: storage bits tried (16, 8, 4).
        seq_lens: context lengths (tokens) of the speed and memory runs: a prefill of that many corpus tokens,
            then ``decode_tokens`` greedy decode steps.
        ppl_tokens: tokens of the streaming-perplexity run, read ``chunk_size`` tokens per forward pass (default
            1: token by token, the exact decode semantics; larger chunks are faster but hide part of the
            compression's cost, as the tokens of a chunk see each other uncompressed).
        agreement_prompts: how many shipped prompts to generate from (``max_new_tokens`` each); 0 skips; at most
            the number shipped (``len(load_prompts())``).
        needle_lengths: context lengths of the passkey retrieval cells (as ``eval needle`` checks them; each
            answer `ANSWER_TOKENS` tokens); empty: no passkey runs.
        needle_depths: depths of the passkey retrieval cells.
        text_file: the main text (perplexity, speed and passkey runs): a shipped text's name
            (`TEXT_NAMES`) or a file path; ``None``: ``sherlock``, the tuning
            text.
        quality_texts: more texts (names of `TEXT_NAMES`, ``reporting`` for
            the three reporting texts, or file paths) on which each configuration's streaming perplexity
            (``ppl_tokens``, ``chunk_size``) and, with ``needle_lengths``, passkey accuracy are also measured
            (``record["corpora"]``); the main text and repeats are dropped. Each is read in the constructor
            (InputError naming it and what is allowed).
        min_capacity: the floor of the fractional budgets in tokens (``None``: the library default; 0: the budget
            alone, for sweeps over sequences shorter than the floor).
        heavy_ratio: fixed compression options of every configuration.
        quant: fixed compression options of every configuration.
        group_size: fixed compression options of every configuration.
        residual: fixed compression options of every configuration.
        high_bits_fraction: share of the stored tokens kept at 8 bits in the 4-bit configurations (0: off); the 16-
            and 8-bit rows are measured without it, and a sweep with no 4-bit row refuses it
            ([`check_meaningful`][h2o_compress.profiling.ProfileSettings.check_meaningful]).
        head_budgets: ``uniform`` or ``adaptive`` (Ada-KV) for every evicting configuration.
        attention_kernel: the decode step's attention in every configuration (``auto``, ``torch`` or ``triton``;
            [`CompressionConfig`][h2o_compress.CompressionConfig]), checked against ``device`` before any work.
        isolate: run each configuration in a fresh worker process (needed for the CPU peak RSS);
            ``None`` = on CPU only.
        threads: torch CPU threads in the worker (``None`` = torch's default).
        compile: run decode steps through the compiled step (``None``: on with CUDA; see
            [`h2o_compress.generate`][h2o_compress.generate]); compilation runs in the warm-up, outside the timings.
        trust_remote_code: let the model directory run its own code (``load_model``'s flag).
        lm_eval_tasks: lm-evaluation-harness task names scored for every configuration (the reference included)
            with the ``h2o-compress`` model type on the already-loaded model; empty (default) skips. Needs the
            ``lm-eval`` extra.
        lm_eval_limit: at most this many documents per task (``None``: all).
        lm_eval_include_path: a folder of extra task YAML files (lm-eval's ``--include-path``).
        placement: ``load_model``'s ``weights_bits``/``device_map``/``max_memory``/``offload_folder`` (empty:
            ``load_model``'s defaults on ``device``). Kept with ``weights_bits`` resolved (8 on CPU for the embedded
            model by default, else 16: the report and the rows' key say which weights were measured) and without
            the other defaults.
    """

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str | None = None
    policies: tuple[str, ...] = ("h2o", "local", "sink")
    budgets: tuple[float, ...] = (1.0, 0.5, 0.2, 0.1)
    kv_bits: tuple[int, ...] = (16, 8, 4)
    seq_lens: tuple[int, ...] = (256, 512, 1024)
    decode_tokens: int = 16
    ppl_tokens: int = 512
    chunk_size: int = 1
    agreement_prompts: int = 3
    max_new_tokens: int = 32
    needle_lengths: tuple[int, ...] = ()
    needle_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    text_file: str | None = None
    quality_texts: tuple[str, ...] = ()
    min_capacity: int | None = None
    heavy_ratio: float = _DEFAULTS.heavy_ratio
    quant: str = _DEFAULTS.quant
    group_size: int = _DEFAULTS.group_size
    residual: int = _DEFAULTS.residual
    high_bits_fraction: float = 0.0
    head_budgets: str = _DEFAULTS.head_budgets
    attention_kernel: str = _DEFAULTS.attention_kernel
    isolate: bool | None = None
    threads: int | None = None
    trust_remote_code: bool = False
    compile: bool | None = None
    lm_eval_tasks: tuple[str, ...] = ()
    lm_eval_limit: int | None = None
    lm_eval_include_path: str | None = None
    placement: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        device = self._check_placement()
        for name in ("policies", "budgets", "kv_bits", "seq_lens", "needle_lengths", "needle_depths", "lm_eval_tasks"):
            setattr(self, name, tuple(getattr(self, name)))
            if not getattr(self, name) and name not in ("needle_lengths", "needle_depths", "lm_eval_tasks"):
                raise ConfigError(f"{name} is empty; allowed: at least one value")
        for bits in self.kv_bits:
            if bits not in ALLOWED_BITS:
                raise ConfigError(f"kv bits {short(bits)} is not supported; allowed: 4, 8, 16")
        for length in self.seq_lens:
            check_count("seq_len", length, minimum=2)
        check_count("decode_tokens", self.decode_tokens)
        check_count("ppl_tokens", self.ppl_tokens, minimum=2)
        check_count("chunk_size", self.chunk_size)
        check_count("agreement_prompts", self.agreement_prompts, minimum=0, unit="shipped prompts",
                    maximum=len(load_prompts()))  # more would report a count the rows never measured
        check_count("max_new_tokens", self.max_new_tokens)
        if self.threads is not None:
            check_count("threads", self.threads, unit="threads", maximum=4096)
        try:  # as eval needle checks them (the lengths against the model's context: once it is loaded)
            for depth in self.needle_depths:
                plant_needle("", "", depth)
            if self.needle_lengths:
                check_needle_args(self.needle_lengths, self.needle_depths, max_new_tokens=ANSWER_TOKENS)
        except ConfigError as exc:
            raise ConfigError(f"needle {exc}") from None
        self.check_meaningful(self.configs())  # configs() validates policies, budgets and the fixed options
        self.quality_texts = self._quality_names()
        self.read_quality_texts()  # every one readable: before a directory is made or a model loads

        check_kernel(self.attention_kernel, device)
        if self.lm_eval_tasks or self.lm_eval_limit is not None or self.lm_eval_include_path is not None:
            check_tasks(self.lm_eval_tasks, self.lm_eval_limit, self.lm_eval_include_path, "--lm-eval-tasks",
                        index=False)

    def _check_placement(self) -> torch.device:
        """Check ``placement`` now (not in a worker after the first configuration) and keep it as the rows' key
        compares it: the defaults left out (the CLI's full dict and the API's {} are one sweep), ``weights_bits``
        resolved (`h2o_compress.models.loading.default_weights_bits` for ``None``). Returns where the weights go.

        Raises:
            ConfigError: ``placement`` not a dict, an unknown key or a value ``load_model`` refuses.
            ModelLoadError: 8/4-bit weights bitsandbytes cannot run here.
        """
        if not isinstance(self.placement, dict):
            raise ConfigError(f"placement={short(self.placement)} is invalid; allowed: a dict of load_model's "
                              "weights_bits, device_map, max_memory, offload_folder")
        unknown = set(self.placement) - set(PLACEMENT_DEFAULTS)
        if unknown:
            raise ConfigError(f"placement keys {sorted(unknown)} are unknown; allowed: weights_bits, device_map, "
                              "max_memory, offload_folder")
        placed = placement_options(self.device, self.dtype, **self.placement, name_or_path=self.model)
        kept = {k: v for k, v in self.placement.items() if v != PLACEMENT_DEFAULTS[k]}
        self.placement = {**kept, "weights_bits": placed["_bits"]}
        return placed["_device"]

    def check_meaningful(self, configs: list[CompressionConfig]) -> None:
        """Refuse, as ``generate`` does, settings whose rows would be measured with a setting that means nothing:

        - ``high_bits_fraction`` > 0 without 4 in ``kv_bits``: it keeps some 4-bit tokens at 8 bits, so no row of
          the sweep would use it. In a sweep that has 4-bit rows it applies to them only (their label says
          ``hi8``); the 16- and 8-bit rows are measured without it, as the comparison.
        - a configuration that leaves no recent window ([`check_usable`][h2o_compress.config.check_usable]) at the capacity
          of a length the sweep measures (each ``seq_lens``, ``ppl_tokens`` and ``needle_lengths``; an integer
          budget is its own capacity): e.g. the 4 sink tokens of ``sink`` with ``--budgets 3``, or budget 0.2 of a
          16-token context.

        Raises:
            ConfigError: naming the option, the configuration and what is allowed.
        """
        if self.high_bits_fraction and 4 not in self.kv_bits:
            raise ConfigError(
                f"high_bits_fraction={self.high_bits_fraction!r} keeps some 4-bit tokens at 8 bits, but kv_bits "
                f"{', '.join(map(str, self.kv_bits))} has no 4-bit row, so it would be ignored; allowed: 4 in "
                "--kv-bits, or high_bits_fraction 0")
        lengths = sorted({*self.seq_lens, self.ppl_tokens, *self.needle_lengths})
        for config in configs:
            for length in lengths if config.budget_is_fraction else [None]:
                try:
                    check_usable(config, config.capacity(length) if length is not None else None)
                except ConfigError as exc:
                    where = f" at the {length}-token length the sweep measures" if length is not None else ""
                    raise ConfigError(f"profile row {label(config)}{where}: {exc}") from None

    def _quality_names(self) -> tuple[str, ...]:
        """``quality_texts`` expanded (``reporting``), without repeats and the main text. Raises ConfigError for a
        value that is not a string."""
        values = (self.quality_texts,) if isinstance(self.quality_texts, (str, os.PathLike)) else self.quality_texts
        values = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in values]
        for value in values:
            if not isinstance(value, str):
                raise ConfigError(f"quality text {short(value)} is not a name or path; allowed: "
                                  f"{', '.join(TEXT_NAMES)}, {REPORTING} or a text file path")
        main = self.text_file if self.text_file is not None else "sherlock"
        return tuple(name for name in expand_text_names(values) if name != main)

    def read_quality_texts(self) -> dict[str, str]:
        """``{name: text}`` of each of ``quality_texts``.

        Raises:
            InputError: a value is neither a shipped text's name nor a readable, non-empty text file (the message
                names it and what is allowed).
        """
        texts = {}
        for name in self.quality_texts:
            try:
                texts[name] = load_text(name)
            except InputError as exc:
                problem = str(exc).split("; allowed:")[0]  # one list of what is allowed
                raise InputError(f"quality text {short(name)}: {problem}; allowed: {', '.join(TEXT_NAMES)}, "
                                 f"{REPORTING} or a readable text file") from None
        return texts

    def configs(self) -> list[CompressionConfig]:
        """The sweep: the reference first, then every (kv bits, budget, policy); a budget of 1 runs once per
        bit width as ``full``. Raises ConfigError for a bad policy, budget or option."""
        fixed = dict(min_capacity=self.min_capacity, heavy_ratio=self.heavy_ratio, quant=self.quant,
                     group_size=self.group_size, residual=self.residual, attention_kernel=self.attention_kernel)
        configs = [CompressionConfig(**{**REFERENCE.to_dict(), **fixed, "kv_bits": 16})]
        for bits in self.kv_bits:
            for budget in self.budgets:
                no_eviction = isinstance(budget, float) and budget >= 1
                for policy in ["full"] if no_eviction else self.policies:
                    mixed = self.high_bits_fraction if bits == 4 else 0.0  # 8-bit tokens among 4-bit ones
                    config = CompressionConfig(policy=policy, budget=budget, kv_bits=bits, **fixed,
                                               high_bits_fraction=mixed,
                                               head_budgets="uniform" if policy == "full" else self.head_budgets)
                    if config not in configs:
                        configs.append(config)
        return configs


def _bits_name(bits: int) -> str:
    """``4-bit``, ``8-bit``, or ``unquantized`` for 16 (kept in the model's dtype: float32 on a CPU)."""
    return "unquantized" if bits == 16 else f"{bits}-bit"


def label(config: CompressionConfig) -> str:
    """Short name of a configuration, e.g. ``h2o 0.2 4-bit``, ``full unquantized`` (keys and values in the
    model's own dtype, float32 on a CPU) or ``h2o 0.5 k 8-bit v 4-bit``."""
    bits = _bits_name(config.key_bits) if config.key_bits == config.value_bits else \
        f"k {_bits_name(config.key_bits)} v {_bits_name(config.value_bits)}"
    if config.high_bits_fraction:
        bits += f" hi8 {config.high_bits_fraction:g}"
    if config.policy == "full" or config.capacity(1 << 30) is None:
        return f"full {bits}"
    heads = "" if config.head_budgets == "uniform" else f" {config.head_budgets} heads"
    return f"{config.policy} {config.budget:g}{heads} {bits}"


def peak_memory_bytes(device: torch.device) -> tuple[int | None, str]:
    """``(bytes, kind)``: CUDA peak allocated since the last `reset_peak_memory`, or this process's peak resident
    set on a CPU (``VmHWM``, restarted by `reset_peak_memory`; ``None`` where the platform cannot tell)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_memory_allocated"
    try:
        return peak_resident_bytes(), "cpu_peak_rss"
    except (OSError, ImportError):  # no /proc and no resource module (Windows)
        return None, "cpu_peak_rss"


def memory_now(device: torch.device) -> int | None:
    """Bytes held now: CUDA memory allocated on ``device``, or the process's resident set on a CPU (``None``
    where the platform cannot tell)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return resident_bytes()


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak-memory window at what is held now: CUDA's peak statistics, or on a CPU (Linux) the
    process's peak resident set (a peak inherited from the parent process or left by loading the model is
    forgotten). Returns whether the window was restarted (``False``: a CPU that cannot restart it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    return restart_peak_resident()


def model_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers (its weights as loaded, quantized ones as stored)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.inference_mode()
def measure_speed(
    model, config: CompressionConfig, corpus_ids: torch.Tensor, seq_len: int, decode_tokens: int,
    compile: bool | None = None,
) -> dict:
    """Prefill ``seq_len`` corpus tokens in one pass, then ``decode_tokens`` greedy decode steps (compiled: the
    step is compiled on a throwaway cache first, and the timed cache's first
    `warmup_steps` steps, which record its CUDA graph on CUDA, are left out of the
    speed).

    Returns a dict: seq_len, capacity, prefill_tokens_per_s, decode_tokens_per_s, kv_bytes, kv_bytes_full_fp16,
    kv_bytes_held and kv_bytes_full (`CompressedCache.held_nbytes`, `full_nbytes`: the uncompressed cache in the
    model's dtype), memory (bytes, `measured_memory`: peak_memory_bytes, memory_before_bytes,
    peak_memory_delta_bytes, workspace_bytes), decode_kernel (what the layers' decode attention ran: ``cpu``,
    ``triton`` or ``torch``, joined by ``+`` where layers differ) and compiled (the decode step ran compiled).
    """
    device = model_device(model)
    ids = corpus_ids[:, :seq_len].to(device)
    reset_peak_memory(device)
    before = memory_now(device)
    cache = make_cache(model, config, max_length=ids.shape[1] + decode_tokens)
    step = step_function(model, resolve_compile(compile, cache, device, model))
    if step is not decode_step:  # compile for these shapes, untimed
        warm = make_cache(model, config, max_length=ids.shape[1] + decode_tokens)
        logits, _ = read_stream(model, warm, ids, None)
        greedy_decode(model, warm, logits, 3, step=step)
        del warm
        reset_peak_memory(device)
        before = memory_now(device)
    # a compiled step's first calls with a new cache record its CUDA graph (CUDA): not a decode speed
    untimed = min(warmup_steps(device), decode_tokens - 1) if step is not decode_step else 0
    logits, prefill_s = read_stream(model, cache, ids, None)
    _, decode_s = greedy_decode(model, cache, logits, decode_tokens + 1, step=step, untimed=untimed)
    sync(device)
    return {
        "seq_len": ids.shape[1],
        "capacity": cache.capacity,
        "prefill_tokens_per_s": ids.shape[1] / prefill_s if prefill_s > 0 else 0.0,
        "decode_tokens_per_s": (decode_tokens - untimed) / decode_s if decode_s > 0 else 0.0,
        "kv_bytes": cache.nbytes(),
        "kv_bytes_full_fp16": cache.full_fp16_nbytes(),
        "kv_bytes_held": cache.held_nbytes(),
        "kv_bytes_full": cache.full_nbytes(),
        **measured_memory(device, before, cache.nbytes()),
        "decode_kernel": cache.decode_kernel,
        "compiled": step is not decode_step,
    }


def measured_memory(device: torch.device, before: int | None, kv_bytes: int) -> dict:
    """The memory of one run, its peak window opened by `reset_peak_memory` when ``before`` was read (bytes,
    ``None`` where the platform cannot tell): ``peak_memory_bytes`` (the peak held during the run: on a CPU the
    process's resident set, weights and runtime included; on CUDA the memory allocated), ``memory_before_bytes``
    (held when the run started), ``peak_memory_delta_bytes`` (the peak above it: what the run added) and
    ``workspace_bytes`` (that less the ``kv_bytes`` of its cache: activations, attention scratch, allocator
    slack)."""
    peak, _ = peak_memory_bytes(device)
    delta = None if peak is None or before is None else max(peak - before, 0)
    return {"peak_memory_bytes": peak, "memory_before_bytes": before, "peak_memory_delta_bytes": delta,
            "workspace_bytes": None if delta is None else max(delta - kv_bytes, 0)}


def check_model_context(model, settings: ProfileSettings, text_tokens: int) -> None:
    """Refuse, before any measurement, the settings that need more positions than the loaded model has: the
    perplexity stream (``ppl_tokens``, or the whole text when shorter) and each passkey length plus its answer.

    Raises:
        InputError: naming the setting and the largest value the model allows.
    """
    limit = context_window(model)
    if not limit:
        return
    stream = min(settings.ppl_tokens, text_tokens)
    if stream > limit:
        raise InputError(f"ppl_tokens={settings.ppl_tokens} reads {stream} tokens, more than the model's context of "
                         f"{limit} tokens; allowed: ppl_tokens at most {limit}")
    too_long = [n for n in settings.needle_lengths if n + ANSWER_TOKENS > limit]
    if too_long:
        raise InputError(f"needle lengths {', '.join(map(str, too_long))} + {ANSWER_TOKENS} answer tokens exceed "
                         f"the model's context of {limit} tokens; allowed: needle lengths at most "
                         f"{limit - ANSWER_TOKENS}")


def measure_config(model, tokenizer, settings: ProfileSettings, config: CompressionConfig, references=None) -> dict:
    """Every measure of one configuration on a loaded model (see the module docstring).

    ``references``: uncompressed generations of the agreement prompts; ``None`` for the reference
    configuration, whose own generations are returned under ``"generations"``.
    """
    started = time.perf_counter()
    device = model_device(model)
    text = load_text(settings.text_file)
    corpus_ids = tokenize_text(tokenizer, text, max(max(settings.seq_lens), settings.ppl_tokens))
    check_model_context(model, settings, corpus_ids.shape[1])
    with torch.inference_mode():  # warm-up: first-call initialisation (and compilation) is not part of any timing
        read_stream(model, make_cache(model, config, max_length=16), corpus_ids[:, :8].to(device), None)
    record: dict = {"label": label(config), "config": config.to_dict(),
                    "model_dtype": str(floating_dtype(model)).replace("torch.", ""), "weights_bytes": model_bytes(model)}
    record["memory_after_warmup_bytes"], record["memory_kind"] = memory_now(device), peak_memory_bytes(device)[1]
    record["speed"] = [
        measure_speed(model, config, corpus_ids, n, settings.decode_tokens, settings.compile)
        for n in sorted(settings.seq_lens)
    ]
    record["perplexity"] = _perplexity(model, corpus_ids, settings, config)
    if settings.agreement_prompts:
        prompts = load_prompts()[: settings.agreement_prompts]
        if references is None:
            references = reference_generations(model, tokenizer, prompts, settings.max_new_tokens)
            record["generations"] = references
        agreement = agreement_eval(model, tokenizer, config, prompts, settings.max_new_tokens, references,
                                   compile=settings.compile)
        record["agreement"] = {k: v for k, v in agreement.to_dict().items() if k != "config"}
    if settings.needle_lengths:
        record["needle"] = _needle(model, tokenizer, settings, config, text)
    if settings.quality_texts:
        record["corpora"] = {name: _corpus_quality(model, tokenizer, settings, config, name)
                             for name in settings.quality_texts}
    if settings.lm_eval_tasks:
        record["lm_eval"] = score_model(model, tokenizer, config, settings.lm_eval_tasks, settings.lm_eval_limit,
                                        settings.lm_eval_include_path)
    record["seconds"] = time.perf_counter() - started
    return record


def _perplexity(model, corpus_ids: torch.Tensor, settings: ProfileSettings, config: CompressionConfig) -> dict:
    """Streaming perplexity of the first ``settings.ppl_tokens`` of ``corpus_ids`` (``chunk_size`` tokens a pass),
    as a record keeps it (the report adds ``ratio`` against its reference)."""
    ppl = streaming_perplexity(model, corpus_ids[:, : settings.ppl_tokens], config, settings.chunk_size)
    skip = ("config", "reference_perplexity", "perplexity_ratio")
    return {k: v for k, v in ppl.to_dict().items() if k not in skip}


def _needle(model, tokenizer, settings: ProfileSettings, config: CompressionConfig, text: str) -> dict:
    """Passkey retrieval (``settings.needle_lengths`` x ``needle_depths``) with ``text`` as the haystack."""
    needle = needle_eval(model, tokenizer, config, settings.needle_lengths, settings.needle_depths,
                         max_new_tokens=ANSWER_TOKENS, reference=False, corpus=text, compile=settings.compile)
    return {k: v for k, v in needle.to_dict().items() if k != "config"}


def _corpus_quality(model, tokenizer, settings: ProfileSettings, config: CompressionConfig, name: str) -> dict:
    """One entry of ``record["corpora"]``: the perplexity of quality text ``name`` over ``tokens`` tokens read as
    the main text is, and its passkey accuracy (a fraction; ``None`` without ``needle_lengths``)."""
    text = load_text(name)
    ppl = _perplexity(model, tokenize_text(tokenizer, text, settings.ppl_tokens), settings, config)
    accuracy = None
    if settings.needle_lengths:
        accuracy = _needle(model, tokenizer, settings, config, text)["overall"].get("compressed")
    return {"perplexity": ppl["perplexity"], "tokens": ppl["tokens"], "needle_accuracy": accuracy}


def _load(settings: ProfileSettings):
    if settings.threads:
        torch.set_num_threads(settings.threads)
    return load_model(settings.model, device=settings.device, dtype=settings.dtype,
                      trust_remote_code=settings.trust_remote_code, **settings.placement)


def _worker(settings: ProfileSettings, config: CompressionConfig, references) -> dict:
    """Body of the isolated worker process: load the model, record the memory after loading, measure."""
    model, tokenizer = _load(settings)
    after_load = memory_now(model_device(model))
    record = measure_config(model, tokenizer, settings, config, references)
    record["memory_after_load_bytes"] = after_load
    return record


class _InProcess:
    """Runs configurations in this process with one loaded model (CUDA, or when isolation is off)."""

    def __init__(self, settings: ProfileSettings, model=None, tokenizer=None):
        self.settings = settings
        self.model, self.tokenizer = (model, tokenizer) if model is not None else _load(settings)

    def __call__(self, config: CompressionConfig, references) -> dict:
        record = measure_config(self.model, self.tokenizer, self.settings, config, references)
        record["memory_after_load_bytes"] = None
        return record


def _isolated(settings: ProfileSettings):
    if settings.model in ALIASES:  # a first run converts the model here (its progress reported), not in a worker
        converted_dir(settings.model)
    context = multiprocessing.get_context("spawn")

    def run(config: CompressionConfig, references) -> dict:
        pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context)
        try:
            result = pool.submit(_worker, settings, config, references).result()
        except BaseException:  # interrupted (a signal, Ctrl-C) or failed: the worker ends now, not after its row
            _end_workers(pool)
            raise
        pool.shutdown(wait=True)
        return result

    return run


def _end_workers(pool: concurrent.futures.ProcessPoolExecutor, grace: float = 3.0) -> None:
    """End every worker process of ``pool`` (SIGTERM, then SIGKILL after ``grace`` seconds) and shut it down, so an
    interrupted sweep leaves no process behind: multiprocessing's resource tracker, which only the workers and this
    process hold open, then ends with this process (it is not stopped here: the pool's own finalizers still
    unregister their semaphores with it)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(1.0)
    pool.shutdown(wait=True, cancel_futures=True)  # its worker is gone: returns at once


class ProfileInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived during a sweep (raised so that its workers end and no partial row is written)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _interruptible(signals=(signal.SIGTERM, signal.SIGHUP)):
    """Within the block, SIGTERM/SIGHUP raise `ProfileInterrupted` (SIGINT already raises
    KeyboardInterrupt), once: a second signal while the sweep cleans up is ignored. Afterwards the previous handlers
    are back, and the signal that arrived is delivered to them (by default: the process ends by that signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def handler(signum, frame):
        if not arrived:
            arrived.append(signum)
            raise ProfileInterrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if arrived:
            signal.raise_signal(arrived[0])  # the previous handler's behaviour (by default: terminate)


def _cpu_name() -> str:
    """The CPU model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def environment(settings: ProfileSettings) -> dict:
    """Versions, platform and device facts for the report."""
    import importlib.metadata as md


    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    device = resolve_device(settings.device)
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": settings.threads or torch.get_num_threads(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cuda": torch.version.cuda,
        "packages": {name: version(name) for name in
                     ("h2o-compress", "torch", "transformers", "rouge-score", "matplotlib", "rich", "typer")},
    }
    return env


def _ray_worker(settings: ProfileSettings, config: CompressionConfig, references) -> dict:
    """Body of a Ray task: `_worker`, plus the environment the task ran in (its node's device)."""
    record = _worker(settings, config, references)
    record["environment"] = environment(settings)
    return record


class _LocalSweep:
    """Runs configurations one after another on this machine (the executor of a sweep without Ray)."""

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self) -> "_LocalSweep":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def describe(self) -> dict:
        return {"kind": "local"}

    def run(self, settings, items, references, on_start, on_done) -> None:
        for index, config in items:
            on_start(index)
            on_done(index, self.runner(config, references))


def _progress(show: bool):
    """A rich progress bar: configurations done / running / left, and the time elapsed."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("done,"),
               TextColumn("{task.fields[running]} running, {task.fields[left]} left"), TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), disable=not show)


def run_profile(settings: ProfileSettings, out_dir: str | Path | None = None, show_progress: bool = True,
                model=None, tokenizer=None, ray_address: str | None = None, resume: bool = True) -> dict:
    """Run the sweep and return the report dict; with ``out_dir``, also write report.json, report.md, the PNG
    plots and report.html there (see [`h2o_compress.profiling.report.write_report`][h2o_compress.profiling.write_report]). report.json is
    rewritten after each configuration (``"complete": false``) so an interrupted sweep keeps its figures.

    Resume: with ``out_dir``, each configuration is also saved as it finishes in ``out_dir/rows``
    (`h2o_compress.profiling.rows`), and a rerun of the same sweep into the same directory reuses the rows whose key (the
    configuration, the model, every measurement setting, the text and the package versions) is unchanged;
    ``report["rows_reused"]`` says how many. ``resume=False`` measures every row again (replacing its saved row).

    Args:
        model: an already loaded model to measure in this process (then ``settings.model`` only names it in
            the report; no isolation; not with ``ray_address``).
        tokenizer: the tokenizer of ``model``.
        ray_address: run each configuration as a Ray task (`h2o_compress.integrations.ray_sweep`): ``"local"`` starts a local Ray
            instance, ``"auto"`` joins the cluster running on this machine, ``"ray://HEAD:10001"`` or
            ``"HEAD:6379"`` an existing cluster; ``None`` (default) runs here. The reference runs first (the
            agreement of every other row compares with its generations), then the rest in parallel.

    Signals: SIGTERM and SIGHUP (from the main thread; SIGINT as KeyboardInterrupt) end the running worker process
    (`_end_workers`) or cancel the Ray tasks in flight, keep the rows already finished (never a partial one)
    and are then delivered again, so the process ends by that signal.

    ``out_dir`` must be new, empty of report files, or the output directory of an earlier sweep
    (`check_out_dir`), checked before any work; when the run fails, the
    directories it created and left empty are removed again.

    Raises:
        ConfigError: bad settings (an unknown lm-eval task name included); an empty ``ray_address``; Ray asked for
            but not installed (the message names the ``ray`` extra) or not reachable; ``ray_address`` with
            ``model``. ModelLoadError: the model cannot be loaded.
        InputError: ``settings.text_file`` or one of ``settings.quality_texts`` cannot be read; ``out_dir`` (or its
            ``rows``) exists and is not a directory (or is a symbolic link), or holds report files profile did not
            write; a measurement needs more positions than the model has.
    """
    if settings.text_file is not None:
        load_text(settings.text_file)  # readable text: before a directory is made or a model loads
    settings.read_quality_texts()
    if ray_address is not None:
        check_address(ray_address)
        import_ray()  # the missing extra is named before anything runs
    created: list[Path] = []
    if out_dir is not None:
        check_out_dir(out_dir)
        RowStore.check(out_dir)  # rows/ a symbolic link (or a file): refused before anything is written
        created = missing_dirs(out_dir)
    try:
        with _interruptible():  # SIGTERM/SIGHUP end the workers and leave only complete rows
            return _run_profile(settings, out_dir, show_progress, model, tokenizer, ray_address, resume)
    except BaseException:
        remove_empty_dirs(created)  # a failed run leaves no empty directory behind (nothing with a file in it)
        raise


def _run_profile(settings: ProfileSettings, out_dir, show_progress: bool, model, tokenizer, ray_address,
                 resume: bool) -> dict:
    """[`run_profile`][h2o_compress.profiling.run_profile] once ``out_dir`` is checked."""
    if settings.lm_eval_tasks:  # unknown task names (lm-eval's task index: seconds, so not in the constructor):
        # before Ray starts, a model loads or a file is written
        check_tasks(settings.lm_eval_tasks, settings.lm_eval_limit, settings.lm_eval_include_path, "--lm-eval-tasks")
    sweep, isolate = _executor(settings, model, ray_address)
    store = None
    if out_dir is not None:
        prepare_out_dir(out_dir)  # fail before the sweep, not after it
        store = RowStore(out_dir)
    configs = settings.configs()
    report = _report_head(settings, isolate, sweep, ray_address)
    text = load_text(settings.text_file)
    quality = settings.read_quality_texts()
    keys = [row_key(asdict(settings), c.to_dict(), text, isolate, quality) for c in configs]
    labels = [label(c) for c in configs]
    records = _reused_rows(store, keys, labels, settings.agreement_prompts) if store is not None and resume else {}
    report["rows_reused"] = len(records)

    to_run = len(records) < len(configs)  # else nothing to run: no model loaded, no Ray started
    if to_run and sweep is None:
        sweep = _LocalSweep(_isolated(settings) if isolate else _InProcess(settings, model, tokenizer))
    # the executor starts (Ray connects) before the progress bar shows: a failure is one error line
    # the rows' own steps (a kvzip scoring pass) report nothing: the sweep's bar is the one shown
    with sweep if to_run else nullcontext(), _progress(show_progress) as bar, report_progress(None):
        if records:
            bar.console.print(f"profile: reusing {len(records)} of {len(configs)} rows finished earlier in "
                              f"{store.dir}")
        rows = _RowsBar(bar, labels, records)

        def on_done(index: int, record: dict) -> None:
            record = _as_saved(record)
            if store is not None:
                store.save(keys[index], labels[index], record)
            records[index] = record
            rows.done(index)
            report["results"] = [_public(records[i]) for i in sorted(records)]
            if out_dir is not None:  # a sweep that dies half-way still leaves its figures
                OutputDir(out_dir).write("report.json", json.dumps(report, indent=2, default=str))

        if to_run:
            report["executor"] = sweep.describe()
            _run_rows(sweep, settings, configs, records, rows.start, on_done)
    report["environment"] = records[0].get("environment") or report["environment"]
    report["results"] = [_public(records[i]) for i in range(len(configs))]
    report["complete"] = True
    finalize(report)
    if out_dir is not None:
        write_report(report, out_dir)
    return report


def _executor(settings: ProfileSettings, model, ray_address: str | None) -> tuple:
    """Where the sweep's rows run: a [`RaySweep`][h2o_compress.integrations.ray_sweep.RaySweep] with
    ``ray_address``, else ``None`` (a local sweep, made once there is a row to run), and whether each row runs
    in a fresh worker process (Ray: always; locally: ``settings.isolate``, by default on CPU only; never with a
    loaded ``model``).

    Returns:
        ``(sweep, isolate)``.

    Raises:
        ConfigError: ``ray_address`` with ``model``; Ray not installed or not reachable.
    """
    if ray_address is not None:
        if model is not None:
            raise ConfigError("a loaded model cannot be sent to Ray tasks; allowed: ray_address=None with model=, "
                              "or settings.model naming a model every Ray worker can load")
        sweep = RaySweep(ray_address, _ray_worker, settings.threads, settings.device)  # fails early without Ray
        return sweep, True  # every task runs in a fresh worker process (max_calls=1)
    device = resolve_device(settings.device)
    if model is not None:
        return None, False  # a loaded model is measured in this process
    isolate = (device.type == "cpu") if settings.isolate is None else settings.isolate
    return None, isolate


def _report_head(settings: ProfileSettings, isolate: bool, sweep, ray_address: str | None) -> dict:
    """The report before any row is measured: when and how it was made, the settings, the environment and the
    executor, no results yet (``"complete": false``)."""
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["h2o-compress"] + sys.argv[1:]) if Path(sys.argv[0]).name == "h2o-compress" else None,
        "settings": {**asdict(settings), "isolate": isolate},
        # on Ray, the driver's (it may have no GPU): replaced by the reference task's own at the end
        "environment": environment(settings if sweep is None else replace(settings, device="cpu")),
        "executor": {"kind": "ray", "address": ray_address} if sweep is not None else {"kind": "local"},
        "results": [],
        "complete": False,
    }


def _reused_rows(store: RowStore, keys: list, labels: list[str], agreement_prompts: int) -> dict[int, dict]:
    """The rows an earlier run of the same sweep saved in ``store`` and that validate, by configuration index; a
    row file that does not validate is warned about and measured again (its file replaced), never trusted.

    Args:
        store: the sweep's row files.
        keys: each configuration's row key (`row_key`), in sweep order (the reference first).
        labels: each configuration's label, in the same order.
        agreement_prompts: how many generations the reference row must hold.
    """
    records: dict[int, dict] = {}
    for i in range(len(keys)):
        found = store.load(keys[i], labels[i])
        if found is None:
            continue
        problem = record_problem(found, "record")
        if problem is None and i == 0:
            problem = _references_problem(found, agreement_prompts)
        if problem is not None:
            warnings.warn(f"profile: the row file {store.path(keys[i], labels[i])} does not validate ({problem}); "
                          "measuring that configuration again", stacklevel=3)
            continue
        records[i] = found
    return records


def _as_saved(record: dict) -> dict:
    """A finished row as it reads back from its row file: the reference's GenerationResults as plain dicts, every
    value through JSON (``default=str``)."""
    if record.get("generations"):
        record["generations"] = [asdict(g) if is_dataclass(g) else g for g in record["generations"]]
    return json.loads(json.dumps(record, default=str))


def _run_rows(sweep, settings: ProfileSettings, configs: list[CompressionConfig], records: dict[int, dict],
              on_start, on_done) -> None:
    """Measure every configuration not in ``records`` on ``sweep``: the reference (index 0) first, as the
    agreement of every other row compares with its generations, then the rest.

    Args:
        sweep: a started executor (`_LocalSweep` or `RaySweep`).
        configs: the sweep's configurations, the reference first.
        records: the rows done so far, by index; ``on_done`` adds each finished one.
        on_start: called with a row's index as it starts.
        on_done: called with a row's index and record as it finishes.
    """
    references = _references(records.get(0))
    if 0 not in records:
        sweep.run(settings, [(0, configs[0])], None, on_start, on_done)
        references = _references(records[0])
    pending = [(i, c) for i, c in enumerate(configs) if i not in records]
    sweep.run(settings, pending, references, on_start, on_done)


class _RowsBar:
    """The sweep's task on a progress bar: rows done, the labels of those running, and how many are left.

    Args:
        bar: a started rich ``Progress``.
        labels: every configuration's label, by index.
        records: the rows done so far, by index (read as they grow).
    """

    def __init__(self, bar, labels: list[str], records: dict[int, dict]) -> None:
        self.bar, self.labels, self.records, self.running = bar, labels, records, set()
        self.task = bar.add_task("profile", total=len(labels), completed=len(records), running=0,
                                 left=len(labels) - len(records))

    def start(self, index: int) -> None:
        """Row ``index`` has started."""
        self.running.add(index)
        self._show()

    def done(self, index: int) -> None:
        """Row ``index`` has finished (and is in ``records``)."""
        self.running.discard(index)
        self._show(advance=1)

    def _show(self, advance: int = 0) -> None:
        names = ", ".join(self.labels[i] for i in sorted(self.running))
        self.bar.update(self.task, advance=advance, description=f"profile: {short(names, 60, repr_=False)}" if names
                        else "profile", running=len(self.running),
                        left=len(self.labels) - len(self.records) - len(self.running))


def _references(record: dict | None) -> list | None:
    """The reference row's generations (the agreement's reference) as GenerationResults, or ``None``."""
    generations = (record or {}).get("generations")
    return None if generations is None else [GenerationResult(**g) for g in generations]


def _references_problem(record: dict, prompts: int) -> str | None:
    """Why the reference row's saved generations (one per agreement prompt) cannot be read back (``None``: they
    can, or the sweep has no agreement prompts)."""
    if not prompts:
        return None
    generations = record.get("generations")
    if not isinstance(generations, list) or len(generations) != prompts:
        return f"record.generations is {short(generations, 60)}; allowed: a list of {prompts} generations"
    try:
        _references(record)
    except (TypeError, ValueError, AttributeError) as exc:
        return f"record.generations cannot be read back: {short(str(exc), 80, repr_=False)}"
    return None


def _public(record: dict) -> dict:
    """A row as the report shows it: without the reference's generations and the worker's environment."""
    return {k: v for k, v in record.items() if k not in ("generations", "environment")}
