"""Command line: ``h2o-compress generate|batch|serve|ask|plan|eval|profile|calibrate``, one module per command.

- `h2o_compress.cli.options`: the options shared by the commands, declared once (a leaf module).
- `h2o_compress.cli.common`: one-line errors (``error: ...``, exit code 2, never a traceback), threads, ``--config``.
- `h2o_compress.cli.generate`, `h2o_compress.cli.batch` (a file of prompts), `h2o_compress.cli.serve` (the OpenAI API over HTTP), `h2o_compress.cli.ask` (compress-then-ask), `h2o_compress.cli.plan`, `h2o_compress.cli.evaluate` (``eval perplexity|needle|agreement``), `h2o_compress.cli.profile`.
"""

from __future__ import annotations

import os

import typer

from h2o_compress.cli.lazy import LazyCommand, LazyGroup
from h2o_compress.utils.version import __version__

_OPTIONS = "h2o_compress.cli.options"
#: The commands, in the order ``--help`` lists them: each module is imported only when its command runs (or its own
#: ``--help`` is asked), so ``h2o-compress --help`` and ``--version`` load neither torch nor transformers.
COMMANDS = {
    "generate": LazyCommand(
        "h2o_compress.cli.generate", "generate", cls=f"{_OPTIONS}:Command",
        summary="Generate text with a compressed KV cache, streaming tokens as they come. With --memory-limit the "
                "planner picks the setting for the weights as loaded (--weights-bits) and the summary gives planned "
                "vs measured peak memory."),
    "ask": LazyCommand(
        "h2o_compress.cli.ask", "ask", cls=f"{_OPTIONS}:Command",
        summary="Compress a document once (defaults: kvzip with global layer budgets and adaptive heads, budget 0.2 "
                "of the document, heavy ratio 1 with 4 sinks, 4 bits), then answer each --question from the same "
                "compressed context."),
    "batch": LazyCommand(
        "h2o_compress.cli.batch", "batch", cls=f"{_OPTIONS}:RayCommand",
        summary="Answer every prompt of INPUT into OUTPUT, --batch-size sequences decoded at once through one "
                "compressed KV cache (continuous batching: each prompt is prefilled alone and a finished row takes "
                "the next prompt at once, so rows are idle only at the end of the job: the summary gives that idle "
                "share)."),
    "serve": LazyCommand(
        "h2o_compress.cli.serve", "serve", cls=f"{_OPTIONS}:RayCommand",
        summary="Serve the model over HTTP with the OpenAI API (completions and chat completions, streamed or not), "
                "requests decoded together through compressed KV caches; /health and Prometheus /metrics. Stops "
                "gracefully on SIGTERM (--grace-period); with --ray, as a Ray Serve deployment."),
    "plan": LazyCommand(
        "h2o_compress.cli.plan", "plan", cls=f"{_OPTIONS}:Command",
        summary="Plan memory: which compression settings fit, the largest batch and context for each, and a pick."),
    "profile": LazyCommand(
        "h2o_compress.cli.profile", "profile_command", cls="h2o_compress.cli.profile:ProfileCommand",
        summary="Sweep policies x budgets x KV bits: KV bytes, peak memory, speed, perplexity, agreement and "
                "optionally lm-eval scores, as a report."),
    "calibrate": LazyCommand(
        "h2o_compress.cli.calibrate", "calibrate_command", cls=f"{_OPTIONS}:Command",
        summary="Fit the calibrated eviction policy for a model (once; minutes on a CPU): the uncompressed model "
                "reads the calibration text, each token is labelled with the attention later queries give it, and a "
                "predictor per layer and KV head is fitted (KVzap-style, arXiv 2601.07891); the mean pre-RoPE key "
                "of each layer and KV head is measured on the same text (KVQuant, arXiv 2401.18079; not for a model "
                "without a fixed RoPE). Use it with --policy calibrated, and --key-offsets calibrated for 4- or "
                "8-bit keys."),
    "eval": LazyCommand(
        "h2o_compress.cli.evaluate", "eval_app",
        summary="Measure quality under compression against the uncompressed cache on your model and text."),
}

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Compress the KV cache of transformers LMs.",
                  cls=LazyGroup.declare(COMMANDS))


def _version(shown: bool) -> None:
    if shown:
        typer.echo(f"h2o-compress {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """h2o-compress: H2O eviction + 4/8-bit quantization of the KV cache."""


def __getattr__(name: str):
    """``click_app``: the click command behind `app` with every command imported (the docs' CLI reference,
    mkdocs-click); ``fail``, ``user_errors`` and ``parse_budget``: the helpers of `h2o_compress.cli.common` and
    `h2o_compress.cli.options`, imported on first use (PEP 562).

    Raises:
        AttributeError: no such name.
    """
    if name == "click_app":
        globals()["click_app"] = typer.main.get_command(app).load_all()  # built once
        return globals()["click_app"]
    if name in ("fail", "user_errors"):
        from h2o_compress.cli import common  # deferred: imports torch; `--help` and `--version` must not

        return getattr(common, name)
    if name == "parse_budget":
        from h2o_compress.cli.options import parse_budget  # deferred: imports torch, as common does

        return parse_budget
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: OpenMP's wait policy the CLI runs torch under unless ``OMP_WAIT_POLICY`` is set: a thread waiting for work at a
#: barrier sleeps instead of spinning. With libgomp's default (spin first), torch's threads on a machine whose cores
#: other processes also use keep waiting at each barrier for a thread that is descheduled, which made a short prompt's
#: prefill many times slower; a decode step runs the decoder layers' one-row products on one thread
#: (`h2o_compress.models.int8_linear.one_row_product`), so it meets few barriers either way.
OMP_WAIT_POLICY = "PASSIVE"


def main() -> None:
    """Console-script entry point: sets `OMP_WAIT_POLICY` (unless the environment does), read once when torch is
    first imported, which is when a command's module is (`COMMANDS`), then runs `app`."""
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    app()


__all__ = ["COMMANDS", "app", "click_app", "fail", "main", "parse_budget", "user_errors"]
