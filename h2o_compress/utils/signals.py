"""SIGTERM and SIGHUP as Ctrl-C for a block of work, so that it ends the way an interrupted run does (its files
closed, its workers and its Ray connection shut down) instead of the process being ended where it stands.

- `interrupting` turns the first SIGTERM or SIGHUP that arrives in the block into `Terminated`, a
  ``KeyboardInterrupt``, and records it; a signal whose handler is not the default one (ignored, as ``nohup``
  leaves SIGHUP, or a handler of the caller's) is left to that handler.
- `end_by_signal` then ends the process by that signal, as it would have ended without the block (exit status
  ``-15`` for SIGTERM as ``subprocess`` reports it, 143 in a shell).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

#: The signals `interrupting` turns into `Terminated` (SIGINT already raises ``KeyboardInterrupt``).
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))  # no SIGHUP: Windows


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived in an `interrupting` block (``signum``: which)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def interrupting(signals=SIGNALS) -> Iterator[list[int]]:
    """Within the block, the first of ``signals`` that arrives raises `Terminated` (later ones are ignored while
    the block cleans up); only signals whose handler is the default one, and only in the main thread (elsewhere
    the block runs as it is). Leaving restores the handlers of before.

    Yields:
        A list that holds the signal number once one arrived (empty otherwise): pass it to `end_by_signal`.
    """
    arrived: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return

    def handler(signum, frame):
        if not arrived:
            arrived.append(signum)
            raise Terminated(signum)

    previous = {sig: signal.getsignal(sig) for sig in signals}
    taken = [sig for sig, old in previous.items() if old == signal.SIG_DFL]
    for sig in taken:
        signal.signal(sig, handler)
    try:
        yield arrived
    finally:
        for sig in taken:
            signal.signal(sig, previous[sig])


def end_by_signal(signum: int) -> None:
    """End this process by ``signum`` with its default disposition (what the signal would have done outside an
    `interrupting` block); returns only where the signal does not end a process."""
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
