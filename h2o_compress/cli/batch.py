"""``h2o-compress batch``: answer a file of prompts, many at a time, through compressed KV caches.

Every option and both files are checked before anything is loaded or written; answers are appended to OUTPUT as
each prompt finishes, so a killed run loses nothing it answered and the same command resumes it.
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from h2o_compress.config import COMMAND_POLICY
from h2o_compress.cli.common import load_options, merged_config, user_errors
from h2o_compress.cli.options import (
    ChatOpt, CompileOpt, Compression, ConfigFileOpt, DeviceOpt, DtypeOpt, JsonOpt, ModelOpt, SamplingSeedOpt,
    TemperatureOpt, ThreadsOpt, TrustOpt, compression_options, placement_flags,
)
from h2o_compress.jobs.batch import BatchInterrupted, BatchJob, counted
from h2o_compress.planner import format_bytes
from h2o_compress.utils.defaults import default_of
from h2o_compress.utils.progress import report_progress
from h2o_compress.utils.signals import Terminated, end_by_signal, interrupting


def parse_batch_size(value: str) -> int | str:
    """``--batch-size``: ``auto`` or an integer (checked by the job)."""
    return "auto" if value.strip().lower() == "auto" else int(value) if value.strip().lstrip("-").isdigit() else value


@user_errors
@compression_options(defaults={"policy": COMMAND_POLICY})
@placement_flags
def batch(
    ctx: typer.Context,
    input: str = typer.Argument(..., help="Prompts: JSONL ({\"id\": ..., \"prompt\": \"...\"} or \"messages\": [...] "
                                "per line; optional max_new_tokens, temperature, seed) or text, one prompt per line."),
    output: str = typer.Option(..., "--output", "-o", help="Answers (JSONL), appended as each prompt finishes; "
                               "ids already there are skipped, so rerunning the command resumes."),
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(
        default_of(BatchJob, "max_new_tokens"), "--max-new-tokens", help="Tokens per answer at most (a line's own "
        "max_new_tokens wins)."),
    batch_size: str = typer.Option(
        str(default_of(BatchJob, "batch_size")), "--batch-size", help="Sequences decoded together, or auto: the "
        "largest that fits --memory-limit (or the free memory) for the longest prompt plus its new tokens."),
    memory_limit: Optional[str] = typer.Option(
        None, "--memory-limit", help="With --batch-size auto: the memory to fit (e.g. 8GiB)."),
    device: str = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    chat: bool = ChatOpt,
    temperature: float = TemperatureOpt,
    seed: Optional[int] = SamplingSeedOpt,
    as_json: bool = JsonOpt,
    config_file: Optional[str] = ConfigFileOpt,
    threads: Optional[int] = ThreadsOpt,
    trust_remote_code: bool = TrustOpt,
    compile_step: Optional[bool] = CompileOpt,
    ray: Optional[str] = typer.Option(
        None, "--ray", metavar="[ADDRESS]", help="Answer on a Ray cluster with Ray Data (pip install "
        "'h2o-compress\\[ray]'): one actor per GPU, or per --threads CPUs, each loading the model once; --ray alone "
        "starts a local Ray instance for this run, --ray auto joins the cluster already running here (ray start "
        "--head), --ray HOST:PORT or ray://HOST:PORT another one. OUTPUT is written here, as without."),
    verbose: bool = typer.Option(
        False, "--verbose", help="With --ray: show Ray's own messages (log records, progress bars, the workers' "
        "output); without it, only Ray's errors reach stderr."),
    compression: Compression = None,
    placement: dict = None,
):
    """Answer every prompt of INPUT into OUTPUT, --batch-size sequences decoded at once through one compressed KV
    cache (continuous batching: each prompt is prefilled alone and a finished row takes the next prompt at once, so
    rows are idle only at the end of the job: the summary gives that idle share)."""
    config, _ = merged_config(compression, config_file)
    job = BatchJob(  # checks every option and both files: nothing is loaded or written before all are good
        input, output, model, config, max_new_tokens=max_new_tokens, batch_size=parse_batch_size(batch_size),
        memory_limit=memory_limit, chat=chat, temperature=temperature, seed=seed, compile=compile_step,
        load=load_options(device, dtype, placement, config.attention_kernel), threads=threads,
        trust_remote_code=trust_remote_code, ray=ray, verbose=verbose)
    try:  # SIGTERM/SIGHUP as Ctrl-C: OUTPUT closed and Ray shut down (with --ray) before the process ends
        with interrupting() as arrived, BatchProgress() as progress, report_progress(progress.stage):
            report = job.run(on_result=progress.answered, on_step=progress.stepped, on_start=progress.begin,
                             on_plan=lambda line: progress.console.print(line, style="dim"))
    except BatchInterrupted as stopped:  # say what is kept and how to go on; Ctrl-C exits 130, a signal by itself
        typer.echo(stopped.message, err=True)
        if arrived:
            end_by_signal(arrived[0])
        raise typer.Exit(130) from None
    except Terminated as stopped:  # after the answers (the summary): nothing to say, the process ends by it
        end_by_signal(stopped.signum)
    typer.echo(json.dumps(report.figures) if as_json else summary_line(report.figures), err=not as_json)


class BatchProgress(Progress):
    """The bar of a batch run on stderr: prompts done of all, tokens/s, the rows in use."""

    def __init__(self):
        super().__init__(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                         TimeElapsedColumn(), console=Console(stderr=True))
        self.task, self.tokens, self.elapsed = None, 0, None
        self.stages: dict[str, int | None] = {}

    def stage(self, stage: str, done: int, total: int | None) -> None:
        """A long step of the library before the answers (the first run's model conversion, a scoring pass) as a
        line of its own above the batch bar, removed once done: the ``ProgressFn`` of ``report_progress``."""
        if stage not in self.stages:
            self.stages[stage] = self.add_task(stage, total=total, rate="")
        task = self.stages[stage]
        if task is None:  # done already
            return
        self.update(task, completed=done, total=total)
        if total is not None and done >= total:
            self.remove_task(task)
            self.stages[stage] = None

    def begin(self, todo: int, skipped: int) -> None:
        if skipped:
            self.console.print(f"resuming: {counted(skipped, 'prompt')} already answered in the output", style="dim")
        self.task = self.add_task("batch", total=todo, rate="")

    def stepped(self, produced: int, rows: int) -> None:
        self.tokens += produced
        elapsed = self.tasks[self.task].elapsed or 0.0
        rate = f"{self.tokens / elapsed:.1f} tok/s" if elapsed else ""
        self.update(self.task, rate=f"{rate} | batch {rows}")

    def answered(self, result, stats) -> None:
        self.advance(self.task)
        elapsed = self.tasks[self.task].elapsed or 0.0
        if not self.tokens and elapsed:  # no decode steps seen here (--ray): the rate of the answers received
            self.update(self.task, rate=f"{stats.new_tokens / elapsed:.1f} tok/s")


def summary_line(figures: dict) -> str:
    """The stderr summary of a batch run."""
    actors = figures.get("ray_actors")
    on_actors = f" on {counted(actors, 'Ray actor')}" if actors else ""
    return (
        f"[{counted(figures['prompts'], 'prompt')} ({counted(figures['errors'], 'error')}, {figures['skipped']} "
        f"already answered) | {figures['prompt_tokens']} prompt + {counted(figures['new_tokens'], 'new token')} | "
        f"batch {figures['batch_size']}{on_actors} | decode "
        f"{figures['decode_tokens_per_s']:.1f} tok/s, end to end {figures['end_to_end_tokens_per_s']:.1f} tok/s | "
        f"idle rows {figures['idle_share']:.0%} | KV {format_bytes(figures['kv_bytes_per_sequence'])} per sequence | "
        f"peak {memory_kind_text(figures.get('peak_kind'))}{format_bytes(figures['peak_bytes'])}"
        f"{' per actor' if actors else ''}]"
    )


def memory_kind_text(kind: str | None) -> str:
    """What a measured peak counts, as words before its bytes: ``process memory `` for a CPU process's whole
    resident set (weights, runtime, tokenizer, KV cache, workspace), ``growth `` above what it held before loading,
    ``GPU memory `` on CUDA; empty for a kind not known."""
    if kind is None:
        return ""
    if kind.startswith("cpu_peak_rss_growth"):
        return "growth "
    return {"cpu_peak_rss": "process memory ", "cpu_peak_rss_with_load": "process memory ",
            "cuda_max_memory_allocated": "GPU memory "}.get(kind, "")
