"""Registers the evaluation commands (:mod:`.commands`) on the main ``h2o-compress`` typer app."""

from __future__ import annotations


def register(app) -> None:
    """Add ``eval`` (perplexity, needle, agreement) and ``profile`` to ``app``."""
    from . import commands

    if not hasattr(commands, "profile_command"):
        # ``python -m h2o_compress.cli``: importing the commands re-imports h2o_compress.cli under its package
        # name, whose own (never run) app lands here while the commands module is still half-built.
        return
    app.add_typer(commands.eval_app, name="eval")
    app.command("profile")(commands.profile_command)
