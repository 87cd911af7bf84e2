"""``h2o-compress batch`` as one Python call: [`BatchJob`][h2o_compress.jobs.BatchJob] checks every setting and both files when it is made
(nothing is loaded or written before all are known to be good); [`BatchJob.run`][h2o_compress.jobs.BatchJob.run] loads the model, sizes the
batch (``"auto"``: the planner's largest under the memory limit), answers the prompts not yet in OUTPUT through
[`generate_batch`][h2o_compress.runtime.batch.generate_batch] and appends each answer as it finishes.
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

from h2o_compress import models
from h2o_compress.config import CompressionConfig, check_usable
from h2o_compress.utils.checks import check_threads
from h2o_compress.jobs.batch_files import AnswerFile, read_requests
from h2o_compress.jobs.checks import JobRequest
from h2o_compress.utils.checks import check_callback
from h2o_compress.models import DEFAULT_MODEL
from h2o_compress.models.weights import input_device
from h2o_compress.planner import describe, format_bytes, parse_memory
from h2o_compress.planner.plan import fit_batch
from h2o_compress.integrations.ray_batch import import_ray_data, ray_session, run_on_ray
from h2o_compress.integrations.ray_sweep import check_address
from h2o_compress.runtime.batch import (
    BatchStats, check_batch_size, generate_batch_checked, row_config,
)
from h2o_compress.runtime.batch_requests import BatchResult, prepare
from h2o_compress.runtime.generation import check_config, generate
from h2o_compress.utils.defaults import default_of
from h2o_compress.utils.errors import ConfigError
from h2o_compress.utils.memory import PeakMemory, available_memory


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun`` in the number it takes: ``"1 prompt"``, ``"2 prompts"`` (``plural``: when not
    ``noun`` + ``"s"``)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _ident(request) -> str:
    """The id of a line of INPUT (a request dict, or the error result of a line that is not one)."""
    return str(request.id if isinstance(request, BatchResult) else request["id"])


def _release_memory() -> None:
    """Give back the memory of what was just dropped (the planning copy of the model) before the actors load."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during `BatchJob.run`: a ``KeyboardInterrupt`` that says what OUTPUT keeps.

    Attributes:
        output: the OUTPUT path.
        kept: the answers in OUTPUT (each complete line; a line cut by the signal is removed by the next run).
        left: the prompts of INPUT not answered yet (the same command answers them: it resumes).
    """

    def __init__(self, output: str, kept: int, left: int):
        self.output, self.kept, self.left = output, kept, left
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """The line the CLI prints."""
        return (f"interrupted: {self.output} keeps {counted(self.kept, 'answer')}; rerun the same command to resume "
                f"({counted(self.left, 'prompt')} left)")


@dataclass
class BatchReport:
    """What [`BatchJob.run`][h2o_compress.jobs.BatchJob.run] returns: the [`BatchStats`][h2o_compress.runtime.batch.BatchStats] of the run, the batch
    size it ran with and why (``batch_reason``), ``skipped`` (prompts already answered in OUTPUT), the seconds end to
    end (model load excluded), the peak memory measured (bytes, and its kind), with ``--batch-size auto`` the
    planner's total for the batch it ran (``planned_bytes``: on a CPU the whole process, as the peak) and
    ``figures``: the ``--json`` summary."""

    stats: BatchStats
    batch_size: int
    batch_reason: str
    skipped: int
    seconds: float
    peak_bytes: int
    peak_kind: str
    figures: dict = field(default_factory=dict)
    planned_bytes: int | None = None


@dataclass
class BatchJob(JobRequest):
    """Answer every prompt of INPUT into OUTPUT, checked when made.

    Attributes:
        input: a JSONL file (``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}`` per line, with
            optional ``max_new_tokens``, ``temperature``, ``seed``) or a text file (one prompt per line).
        output: the JSONL answers file, appended to (never replaced): one line per prompt (``id``, ``text``,
            ``prompt_tokens``, ``new_tokens``, ``finish_reason``, and ``error`` for a refused prompt); ids already
            in it are skipped (resume).
        model: as for [`h2o_compress.generate`][h2o_compress.generate].
        config: as for [`h2o_compress.generate`][h2o_compress.generate].
        max_new_tokens: as for [`h2o_compress.generate`][h2o_compress.generate]; the default a line may override.
        chat: as for [`h2o_compress.generate`][h2o_compress.generate].
        temperature: as for [`h2o_compress.generate`][h2o_compress.generate]; the default a line may override.
        seed: as for [`h2o_compress.generate`][h2o_compress.generate]; the default a line may override.
        compile: as for [`h2o_compress.generate`][h2o_compress.generate].
        batch_size: sequences per group, or ``"auto"``: the largest that fits ``memory_limit`` (or the device's free
            memory) for the longest prompt plus its new tokens, with the weights as loaded
            ([`fit_batch`][h2o_compress.planner.fit_batch]).
        memory_limit: bytes or a text such as ``"2GiB"`` (only with ``batch_size="auto"``).
        load: as for [`GenerateJob`][h2o_compress.jobs.GenerateJob].
        threads: as for [`GenerateJob`][h2o_compress.jobs.GenerateJob].
        trust_remote_code: as for [`GenerateJob`][h2o_compress.jobs.GenerateJob].
        ray: a Ray address (``"local"``: a local instance, ``"auto"``, ``HOST:PORT``, ``ray://HOST:PORT``): the
            prompts are answered by Ray Data actors, one per GPU or per ``threads`` CPUs, each loading the model once
            (`run_on_ray`); this process plans, and writes OUTPUT as
            answers come back (the same semantics). ``None``: here.

    Raises (when made):
        ConfigError: a bad setting, ``memory_limit`` without ``batch_size="auto"``; with ``ray``: Ray not installed,
            no cluster for ``auto``, nothing answering at an address.
        InputError: INPUT missing, not text, or empty; OUTPUT a directory, the input, or a file that is not answers.
    """

    input: str
    output: str
    model: str = DEFAULT_MODEL
    config: CompressionConfig | None = None
    max_new_tokens: int = default_of(generate, "max_new_tokens")
    batch_size: int | str = 8
    memory_limit: str | int | None = None
    chat: bool = default_of(generate, "chat")
    temperature: float = default_of(generate, "temperature")
    seed: int | None = None
    compile: bool | None = None
    load: dict = field(default_factory=dict)
    threads: int | None = None
    trust_remote_code: bool = False
    ray: str | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        self._validate_shared()
        self.config = check_config(self.config)
        self.request = self._generation_request()  # max_new_tokens, temperature, seed, chat, compile: a line's defaults
        if self.batch_size != "auto":
            check_batch_size(self.batch_size)
            if self.memory_limit is not None:
                raise ConfigError("--memory-limit sizes the batch, so it goes with --batch-size auto; allowed: "
                                  "--batch-size auto --memory-limit SIZE, or --batch-size N alone")
        if self.memory_limit is not None:
            parse_memory(self.memory_limit)
        check_threads(self.threads, here=self.ray is None)  # with Ray: threads of the cluster's machines
        if self.ray is not None:
            import_ray_data()
            self.ray = check_address(self.ray, reach=True)
        self.requests = read_requests(self.input)
        self.done = AnswerFile.check(self.output, self.input)

    def run(self, on_result: Callable[[BatchResult, BatchStats], None] | None = None,
            on_step: Callable[[int, int], None] | None = None, on_plan: Callable[[str], None] | None = None,
            on_start: Callable[[int, int], None] | None = None) -> BatchReport:
        """Load the model and answer the prompts OUTPUT does not hold yet (with ``ray``: connect first, then load).

        Args:
            on_result: receives each answer (after it is written) and the stats so far.
            on_step: receives ``(rows that produced a token, rows in the group)`` per step (a progress bar; not
                called with ``ray``).
            on_plan: receives the line saying which batch size runs and why.
            on_start: receives ``(prompts to answer, prompts already answered)`` once the files are read.

        Returns:
            A [`BatchReport`][h2o_compress.jobs.BatchReport].

        Raises:
            ModelLoadError: the model cannot be loaded.
            ConfigError: with ``batch_size="auto"``, not even one sequence fits the memory; with ``ray``, a cluster
                that cannot be started or reached.
            InputError: OUTPUT is being written by another run.
            BatchInterrupted: Ctrl-C (a ``KeyboardInterrupt``): OUTPUT keeps every answer written.
        """
        import torch

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        kept = set(self.done)
        remote = self.ray is not None and any(isinstance(r, dict) and r["id"] not in kept for r in self.requests)
        try:
            with ray_session(self.ray, self.verbose) if remote else nullcontext(), \
                    AnswerFile(self.output, self.input) as answers:
                kept = answers.done
                return self._answer(answers, on_result, on_step, on_plan, on_start)
        except KeyboardInterrupt:
            raise BatchInterrupted(self.output, len(kept), self._left(kept)) from None

    def _answer(self, answers: AnswerFile, on_result, on_step, on_plan, on_start) -> BatchReport:
        """`run` with OUTPUT open (and Ray connected)."""
        todo = [r for r in self.requests if _ident(r) not in answers.done]
        if on_start is not None:
            on_start(len(todo), len(self.requests) - len(todo))
        peak = PeakMemory(whole_process=True)  # on a CPU a memory limit bounds the whole process
        lm, tokenizer = models.load_model(self.model, trust_remote_code=self.trust_remote_code, **self.load)
        peak.loaded()
        held = peak.held(lm) if self.batch_size == "auto" else None  # the process once loaded: auto counts it
        config, batch_size, reason, planned = self._setting(lm, tokenizer, held)
        if on_plan is not None:
            on_plan(reason)
        started = time.perf_counter()
        refused = [r for r in todo if isinstance(r, BatchResult)]
        for result in refused:  # lines that are not a request: answered with their error first
            answers.write(result)
            if on_result is not None:
                on_result(result, BatchStats(prompts=1, errors=1))
        generation = {"max_new_tokens": self.max_new_tokens, "batch_size": batch_size, "chat": self.chat,
                      "temperature": self.temperature, "seed": self.seed, "compile": self.compile}
        requests = self._seeded(todo)
        if self.ray is not None and requests:
            del lm, tokenizer  # the actors load their own: no second copy held here while they run
            _release_memory()
            run = run_on_ray(requests, self._model_for_workers(), config, generation, self.load, self.threads,
                             self.trust_remote_code, str(self.load.get("device", "auto")))
        else:
            if self.batch_size == "auto":  # a planned size; the rest was checked when the job was made
                check_batch_size(batch_size)
            check_callback("on_step", on_step)
            run = generate_batch_checked(lm, tokenizer, requests, config, on_step=on_step, **generation)
        for result in run:
            answers.write(result)
            if on_result is not None:
                on_result(result, run.stats)
        stats = run.stats
        stats.prompts, stats.errors = stats.prompts + len(refused), stats.errors + len(refused)
        seconds = time.perf_counter() - started
        peak_bytes, peak_kind = (run.peak_bytes, run.peak_kind) if hasattr(run, "peak_bytes") else peak.measure()
        report = BatchReport(stats, batch_size, reason, len(self.requests) - len(todo), seconds, peak_bytes, peak_kind,
                             planned_bytes=planned)
        report.figures = summary(report, self.config)
        if hasattr(run, "actors"):
            report.figures["ray_actors"] = run.actors
        return report

    def _left(self, answered: set[str]) -> int:
        """The prompts of INPUT whose answer is not in ``answered`` (ids)."""
        return sum(_ident(r) not in answered for r in self.requests)

    def _model_for_workers(self) -> str:
        """The model as Ray's workers are to load it: a relative directory made absolute (their working
        directory may differ); an alias or hub id as it is."""
        if os.path.isdir(self.model) and not os.path.isabs(self.model):
            return os.path.abspath(self.model)
        return self.model

    def _seeded(self, todo: list) -> list[dict]:
        """The requests of ``todo`` to run; with a job ``seed``, a line without its own gets ``seed`` plus its line
        index, so a resumed run samples each line as the uninterrupted one did."""
        index = {id(r): i for i, r in enumerate(self.requests)}
        requests = [r for r in todo if isinstance(r, dict)]
        if self.seed is None:
            return requests
        return [r if "seed" in r else {**r, "seed": (self.seed + index[id(r)]) % 2**64} for r in requests]

    def _setting(self, lm, tokenizer, held: int | None = None) -> tuple[CompressionConfig, int, str, int | None]:
        """The setting every row runs with (a budget fraction taken of the longest sequence of the whole INPUT,
        answered lines included, so a resumed run keeps what the first one kept), the batch size and a line saying
        why, and with ``--batch-size auto`` the planned total bytes of that batch. ``held``: the bytes the process
        holds once the model is loaded (`PeakMemory.held`), which ``--batch-size auto`` counts."""
        prepared = [prepare(lm, tokenizer, r, i, self.chat, self.max_new_tokens, self.temperature, self.seed)
                    for i, r in enumerate(self.requests) if isinstance(r, dict)]
        prepared = [p for p in prepared if not isinstance(p, BatchResult)]
        if not prepared:
            return self.config, 1, "batch size 1 (no prompt to run)", None
        prompt_len = max(p.ids.numel() for p in prepared)
        longest = max(p.ids.numel() + p.max_new_tokens for p in prepared)
        config = row_config(self.config, longest)
        check_usable(config, config.capacity(longest))
        if self.batch_size != "auto":
            return config, self.batch_size, f"batch size {self.batch_size} (--batch-size)", None
        gen_len = max(longest - prompt_len, 1)
        limit, source = self.memory_limit, "--memory-limit"
        if limit is None:
            limit, source = available_memory(input_device(lm)), "free memory"
            if limit is None:
                raise ConfigError("--batch-size auto cannot read this device's free memory; allowed: --memory-limit "
                                  "SIZE, or --batch-size N")
        row = fit_batch(lm, config, limit, prompt_len, gen_len, held=held)
        if row.max_batch < 1:
            raise ConfigError(
                f"--batch-size auto: not even one sequence of {prompt_len} + {gen_len} tokens fits {source} "
                f"{format_bytes(parse_memory(limit))} with {setting_text(self.config, config, longest, row.kv_dtype)} "
                f"(one needs {format_bytes(row.total_bytes)}: {row.loaded_text}, KV cache {format_bytes(row.cache.total)}, workspace "
                f"{format_bytes(row.workspace_bytes)}); allowed: more memory, a smaller budget or fewer bits")
        size = min(row.max_batch, len(prepared))
        planned = fit_batch(lm, config, limit, prompt_len, gen_len, held=held, batch=size).total_bytes
        return config, size, (
            f"batch size {size} (auto): the largest that fits {source} {format_bytes(parse_memory(limit))} is "
            f"{counted(row.max_batch, 'sequence')} of {prompt_len} + {gen_len} tokens with "
            f"{setting_text(self.config, config, longest, row.kv_dtype)} ({row.loaded_text}, KV cache {format_bytes(row.cache.total)} per sequence)"
            + (f"; {counted(len(prepared), 'prompt')} in the input" if size < row.max_batch else "")), planned


def setting_text(given: CompressionConfig, config: CompressionConfig, longest: int, kv_dtype: str) -> str:
    """The setting as the user gave it (``given``: ``h2o 20% int4 g32 r3``), with what its fractional budget
    became for the job's ``longest`` sequence (prompt + new tokens) where ``config`` (`row_config`) differs:
    ``(nothing evicted: 150 tokens <= --min-capacity 192)`` or ``(410 tokens kept per layer and KV head)``."""
    text = describe(given, kv_dtype)
    if config == given:
        return text
    capacity = config.capacity(longest)
    if capacity is None:
        return f"{text} (nothing evicted: {longest} tokens <= --min-capacity {given.floor})"
    return f"{text} ({capacity} tokens kept per layer and KV head)"


def summary(report: BatchReport, config: CompressionConfig) -> dict:
    """The ``--json`` summary of a batch run: the stats, the rates (tokens/s) and memory (bytes)."""
    stats = report.stats
    return {
        **stats.to_dict(), "batch_size": report.batch_size, "batch_reason": report.batch_reason,
        "skipped": report.skipped, "seconds": report.seconds,
        "end_to_end_tokens_per_s": stats.new_tokens / report.seconds if report.seconds > 0 else 0.0,
        "peak_bytes": report.peak_bytes, "peak_kind": report.peak_kind, "config": config.to_dict(),
        **({} if report.planned_bytes is None else {"planned_peak_bytes": report.planned_bytes}),
    }


def run_batch(input: str, output: str, model: str = DEFAULT_MODEL, config: CompressionConfig | None = None,
              **settings) -> BatchReport:
    """What ``h2o-compress batch`` runs: ``BatchJob(input, output, model, config, **settings).run()``.

    Raises:
        H2OCompressError: the errors of [`BatchJob`][h2o_compress.jobs.BatchJob] (every setting, before anything is
            loaded) and [`BatchJob.run`][h2o_compress.jobs.BatchJob.run].
    """
    return BatchJob.from_call(("input", "output", "model", "config"), (input, output, model, config), settings).run()
