"""``h2o-compress generate`` as one Python call: [`GenerateJob`][h2o_compress.jobs.GenerateJob] checks every setting when it is made (nothing
is loaded or written before all are known to be good), [`GenerateJob.run`][h2o_compress.jobs.GenerateJob.run] loads the model, lets the planner
pick the setting under a memory limit, loads or saves the prompt cache, generates and gathers the figures the
command prints. [`run_generate`][h2o_compress.jobs.run_generate] does both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from h2o_compress.config import CompressionConfig, check_usable
from h2o_compress.utils.checks import check_threads
from h2o_compress.jobs.checks import CacheRunFields
from h2o_compress.models import DEFAULT_MODEL
from h2o_compress.persistence import check_cache_paths
from h2o_compress.planner import PlanRow, choose_for_prompt, describe_choice, parse_memory
from h2o_compress.planner.plan import PICKED, read_whole_fallback
from h2o_compress.runtime.generation import (
    ON_TEXT, GenerationResult, check_config, check_prompt, encode_prompt, generate, run_generation,
)
from h2o_compress.utils.checks import check_callback
from h2o_compress.utils.defaults import default_of
from h2o_compress.utils.errors import ConfigError
from h2o_compress import models
from h2o_compress.models.weights import floating_dtype
from h2o_compress.runtime.prefill import context_window
from h2o_compress.runtime.prompt_cache import prepare_prompt_cache
from h2o_compress.utils.memory import PeakMemory


@dataclass
class GenerateReport:
    """What [`GenerateJob.run`][h2o_compress.jobs.GenerateJob.run] returns.

    Attributes:
        result: the [`GenerationResult`][h2o_compress.runtime.generation.GenerationResult] (text, token counts, bytes, times).
        config: the setting the cache ran with (the planner's pick under ``memory_limit``, the file's with
            ``load_cache``).
        figures: what ``generate --json`` prints: the result's figures (without ``token_ids``) plus ``config``
            (its ``min_capacity`` the floor in force: the default where none was given),
            ``model``, ``kv_dtype``, ``weights_bits``; with ``memory_limit`` ``planned_peak_bytes``,
            ``measured_peak_bytes`` (bytes) and ``measured_peak_kind``; with a prompt cache ``cache_load_s`` or
            ``cache_save_s`` (seconds, also the ``prefill_s``: the prompt went through the cache).
        plan: the planner's row under ``memory_limit`` (``None`` otherwise).
    """

    result: GenerationResult
    config: CompressionConfig
    figures: dict
    plan: PlanRow | None = None

    def to_dict(self) -> dict:
        """The figures (a copy), as ``generate --json`` prints them."""
        return dict(self.figures)


@dataclass
class GenerateJob(CacheRunFields):
    """One generation from a model named by path or alias, checked when made.

    Attributes:
        prompt: the prompt text.
        model: alias, local model directory or hub id ([`h2o_compress.load_model`][h2o_compress.load_model]).
        config: the compression setting (default: no compression); with ``memory_limit``, the base the planner
            keeps all but budget, bits and group size of ([`choose_for_prompt`][h2o_compress.planner.choose_for_prompt]).
        max_new_tokens: as for [`h2o_compress.generate`][h2o_compress.generate].
        chat: as for [`h2o_compress.generate`][h2o_compress.generate].
        temperature: as for [`h2o_compress.generate`][h2o_compress.generate].
        seed: as for [`h2o_compress.generate`][h2o_compress.generate]; also seeds torch before the model loads.
        compile: as for [`h2o_compress.generate`][h2o_compress.generate].
        memory_limit: bytes, or a text such as ``"2GiB"``: the planner picks the setting for the model as loaded,
            and the figures give planned against measured peak memory.
        save_cache: a file to save the prompt cache to (the part a follow-up prompt shares); an existing file must
            be a cache file unless ``overwrite``.
        load_cache: a saved prompt cache to start from (the prompt must extend it).
        given: the settings asked for explicitly (e.g. the command line's flags): a loaded cache's setting must
            match them, and ``memory_limit`` refuses those it picks itself.
        load: keyword arguments of [`h2o_compress.load_model`][h2o_compress.load_model] (``device``, ``dtype``, ``weights_bits``,
            ``device_map``, ...).
        threads: torch CPU threads set before loading (``None``: torch's default).
        trust_remote_code: let the model directory run its own code.

    Raises (when made):
        InputError: empty prompt, or one that is not UTF-8.
        ModelLoadError: ``model`` is not a non-empty text.
        ConfigError: bad ``max_new_tokens``/``temperature``/``seed``/``compile``/``threads``/``memory_limit``,
            ``memory_limit`` with ``load_cache``, or with a setting it picks in ``given``; a switch (``chat``,
            ``overwrite``, ``trust_remote_code``) that is not a bool; a ``load`` that ``load_model`` would refuse.
        CacheFileError: a ``save_cache`` that cannot be written, or a ``load_cache`` that is not a cache file.
    """

    prompt: str
    model: str = DEFAULT_MODEL
    config: CompressionConfig | None = None
    max_new_tokens: int = default_of(generate, "max_new_tokens")
    chat: bool = default_of(generate, "chat")
    temperature: float = default_of(generate, "temperature")
    seed: int | None = None
    compile: bool | None = None
    memory_limit: str | int | None = None

    def __post_init__(self) -> None:
        check_prompt(self.prompt)
        self._validate_shared()
        self.config = check_usable(check_config(self.config))  # the capacity-free rules; run() adds the capacity's
        self.request = self._generation_request()  # max_new_tokens, temperature, seed, chat, compile
        if self.memory_limit is not None and self.load_cache is not None:
            raise ConfigError("--memory-limit and --load-cache cannot be combined: a loaded cache keeps the setting "
                              "it was saved with")
        if self.memory_limit is not None:
            parse_memory(self.memory_limit)
            fixed = [name for name in PICKED if name in self.given]
            if fixed:
                flags = ", ".join("--" + name.replace("_", "-") for name in fixed)
                raise ConfigError(
                    f"--memory-limit picks budget, bits and group size itself, so {flags} (given on the command line "
                    "or in --config) would be ignored; allowed: --memory-limit without them, or those settings "
                    "without --memory-limit")
        check_cache_paths(self.save_cache, self.load_cache, self.overwrite)
        check_threads(self.threads)

    def run(self, on_text: Callable[[str], None] | None = None,
            on_plan: Callable[[str], None] | None = None) -> GenerateReport:
        """Load the model and generate.

        Args:
            on_text: receives each new piece of text as it is generated (streaming).
            on_plan: with ``memory_limit``, receives the planner's one-line choice before generation starts.

        Returns:
            A [`GenerateReport`][h2o_compress.jobs.GenerateReport].

        Raises:
            ModelLoadError: the model cannot be loaded.
            ConfigError: nothing fits ``memory_limit``, or a setting that leaves no recent window at this capacity.
            InputError, CacheFileError, CacheStateError: see [`h2o_compress.generate`][h2o_compress.generate] and
                `prepare_prompt_cache`.
        """
        import torch

        check_callback("on_text", on_text, ON_TEXT)  # the rest was checked when the job was made
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.seed is not None:
            torch.manual_seed(self.seed)
        # before the weights: the planner counts them, and on a CPU the whole process (the limit bounds its peak)
        peak = PeakMemory(whole_process=True) if self.memory_limit is not None else None
        lm, tokenizer = models.load_model(self.model, trust_remote_code=self.trust_remote_code, **self.load)
        if peak is not None:
            peak.loaded()  # the weights are resident: count them, not the transient of loading them
        tokens = encode_prompt(tokenizer, self.prompt, self.chat, context_window(lm)).shape[1]
        config, row = self._planned(lm, tokenizer, tokens, on_plan, None if peak is None else peak.held(lm))
        if self.load_cache is None:  # the capacity is known now: refuse a split that leaves no recent window
            check_usable(config, config.capacity(tokens + self.max_new_tokens))
        cache, load_s = None, None
        if self.save_cache is not None or self.load_cache is not None:
            started = time.perf_counter()
            cache = prepare_prompt_cache(
                lm, tokenizer, self.prompt, config, self.max_new_tokens, self.chat, load=self.load_cache,
                save=self.save_cache, expect=self.given, overwrite=self.overwrite,
            )
            load_s = time.perf_counter() - started
            config = cache.config
        # the job's request, for the setting it runs with where that is another (the planner's pick, a loaded cache's)
        request = self.request if config == self.request.config else self._generation_request(config)
        result = run_generation(lm, tokenizer, self.prompt, request, on_text, cache)
        figures = self._figures(result, config, floating_dtype(lm), row, peak, load_s)
        return GenerateReport(result, config, figures, row)

    def _planned(self, lm, tokenizer, tokens: int, on_plan: Callable[[str], None] | None,
                 held: int | None = None) -> tuple[CompressionConfig, PlanRow | None]:
        """The setting to generate with: the job's ``config``, or, with ``memory_limit``, the planner's pick for
        the loaded ``lm`` and the prompt's ``tokens`` (told to ``on_plan`` in one line), counting the ``held`` bytes
        of the process once loaded (on a CPU, `PeakMemory.held`: its whole resident set) where they exceed the
        weights.

        Returns:
            ``(config, row)``: the setting and the planner's row (``None`` without ``memory_limit``).

        Raises:
            ConfigError: nothing fits ``memory_limit``.
        """
        if self.memory_limit is None:
            return self.config, None
        row = choose_for_prompt(lm, tokenizer, self.prompt, self.memory_limit, self.max_new_tokens, chat=self.chat,
                                base=self.config, compiled=self.compile, held=held)
        row, fallback = read_whole_fallback(lm, row, tokens, self.memory_limit)
        if on_plan is not None:
            on_plan(describe_choice(row, self.memory_limit) + ("" if fallback is None else "; " + fallback))
        return row.config, row

    def _figures(self, result: GenerationResult, config: CompressionConfig, dtype, row: PlanRow | None,
                 peak: PeakMemory | None, load_s: float | None) -> dict:
        """What ``generate --json`` prints (`GenerateReport.figures`).

        Args:
            result: the generation.
            config: the setting it ran with.
            dtype: the model's floating dtype (the KV cache's).
            row: the planner's row under ``memory_limit`` (then ``peak`` measures the peak memory), or ``None``.
            load_s: seconds the prompt cache took to load or save (then the prefill's), or ``None``.
        """
        figures = {k: v for k, v in result.to_dict().items() if k != "token_ids"}
        figures["config"] = config.to_dict() | {"min_capacity": config.floor}  # the floor in force, not None
        figures["min_capacity"] = config.floor  # the floor in force (the config's None: the default)
        figures["max_new_tokens"] = self.max_new_tokens  # with the prompt: the length the capacity was set for
        figures["model"] = self.model
        figures["kv_dtype"] = str(dtype).removeprefix("torch.")
        figures["weights_bits"] = models.resolve_weights_bits(self.model, **self.load)  # None resolved: 8 or 16
        if row is not None:
            figures["planned_peak_bytes"] = row.total_bytes
            figures["measured_peak_bytes"], figures["measured_peak_kind"] = peak.measure()
        if load_s is not None:  # the prompt went through the cache before generate: that time is not "prefill"
            figures["prefill_s"] = load_s
            figures["cache_load_s" if self.load_cache is not None else "cache_save_s"] = load_s
        return figures


def run_generate(prompt: str, model: str = DEFAULT_MODEL, config: CompressionConfig | None = None,
                 on_text: Callable[[str], None] | None = None, on_plan: Callable[[str], None] | None = None,
                 **settings) -> GenerateReport:
    """What ``h2o-compress generate`` runs: ``GenerateJob(prompt, model, config, **settings).run(on_text, on_plan)``.

    Args:
        prompt: the prompt text.
        model: alias, local model directory or hub id.
        config: the compression setting (default: none).
        on_text: receives each new piece of text (streaming).
        on_plan: receives the planner's choice under ``memory_limit``.
        settings: the other fields of [`GenerateJob`][h2o_compress.jobs.GenerateJob] (``max_new_tokens`` in tokens, ``memory_limit`` in
            bytes or as ``"2GiB"``, ``save_cache``/``load_cache`` paths, ``load``, ...).

    Returns:
        A [`GenerateReport`][h2o_compress.jobs.GenerateReport] (``.result.text``, ``.figures``).

    Raises:
        H2OCompressError: the errors of [`GenerateJob`][h2o_compress.jobs.GenerateJob] (every setting, before
            anything is loaded) and [`GenerateJob.run`][h2o_compress.jobs.GenerateJob.run]; a ConfigError for an
            unknown setting or an ``on_text``/``on_plan`` that is not callable.
    """
    job = GenerateJob.from_call(("prompt", "model", "config"), (prompt, model, config), settings, on_text=on_text,
                                on_plan=on_plan)
    return job.run(on_text, on_plan)
