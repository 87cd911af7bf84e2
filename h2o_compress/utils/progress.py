"""Progress of the long steps (a first-run model conversion, compress-then-ask's scoring pass and compressed
prefill), reported only to whoever asked for it (a leaf module).

The library never prints progress on its own: a step calls `report`, which does nothing unless a callback
was installed with `report_progress` (the CLI installs a rich bar on stderr; a Python caller may pass any
`ProgressFn`). Reports come once per chunk, layer or tensor of a step, never per token of a decode loop.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

ProgressFn = Callable[[str, int, "int | None"], None]
"""``on_progress(stage, done, total)``: ``stage`` names the step (e.g. ``"scoring the context"``), ``done`` of
``total`` units are finished (``total`` ``None``: not known yet). A stage is over once ``done >= total``; a new
``stage`` text starts the next step."""

_REPORTER: ContextVar[ProgressFn | None] = ContextVar("h2o_compress_progress", default=None)


@contextmanager
def report_progress(on_progress: ProgressFn | None) -> Iterator[None]:
    """Send the progress of every step run inside the block (in this thread or task) to ``on_progress``;
    ``None`` silences it. The previous callback is restored after the block.

    Example:
        >>> with report_progress(lambda stage, done, total: print(stage, done, total)):
        ...     context = compress(model, tokenizer, text)  # doctest: +SKIP
    """
    token = _REPORTER.set(on_progress)
    try:
        yield
    finally:
        _REPORTER.reset(token)


def reporting() -> bool:
    """Whether a callback is installed (`report_progress`): a step may skip preparing its reports if not."""
    return _REPORTER.get() is not None


def report(stage: str, done: int, total: int | None = None) -> None:
    """Tell the installed callback (if any) that ``done`` of ``total`` units of ``stage`` are finished."""
    callback = _REPORTER.get()
    if callback is not None:
        callback(stage, done, total)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """A step of unknown length: reported as started (``0`` of ``None``) on entry and finished (``1`` of ``1``)
    when the block ends without an error."""
    report(name, 0, None)
    yield
    report(name, 1, 1)
