"""Command line: ``h2o-compress generate|batch|ask|plan|eval|profile|calibrate``, one module per command.

- `h2o_compress.cli.options`: the options shared by the commands, declared once (a leaf module).
- `h2o_compress.cli.common`: one-line errors (``error: ...``, exit code 2, never a traceback), threads, ``--config``.
- `h2o_compress.cli.generate`, `h2o_compress.cli.batch` (a file of prompts), `h2o_compress.cli.ask` (compress-then-ask), `h2o_compress.cli.plan`, `h2o_compress.cli.evaluate` (``eval perplexity|needle|agreement``), `h2o_compress.cli.profile`.
"""

from __future__ import annotations

import typer

from h2o_compress.cli.ask import ask
from h2o_compress.cli.batch import batch
from h2o_compress.cli.calibrate import calibrate_command
from h2o_compress.cli.common import fail, user_errors
from h2o_compress.cli.evaluate import eval_app
from h2o_compress.cli.generate import generate
from h2o_compress.cli.options import Command, RayCommand, parse_budget
from h2o_compress.cli.plan import plan
from h2o_compress.cli.profile import ProfileCommand, profile_command
from h2o_compress.utils.version import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Compress the KV cache of transformers LMs.")


def _version(shown: bool) -> None:
    if shown:
        typer.echo(f"h2o-compress {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """h2o-compress: H2O eviction + 4/8-bit quantization of the KV cache."""


app.command("generate", cls=Command)(generate)  # usage lines as click writes them (PROMPT, not {prompt})
app.command("ask", cls=Command)(ask)
app.command("batch", cls=RayCommand)(batch)
app.command("plan", cls=Command)(plan)
app.add_typer(eval_app, name="eval")
app.command("profile", cls=ProfileCommand)(profile_command)
app.command("calibrate", cls=Command)(calibrate_command)
click_app = typer.main.get_command(app)  # the click command behind `app`: the docs' CLI reference (mkdocs-click)


def main() -> None:
    """Console-script entry point."""
    app()


__all__ = ["app", "fail", "main", "parse_budget", "user_errors"]
