"""The CLI's bar for the library's long steps (`h2o_compress.utils.progress`): a first-run model conversion,
compress-then-ask's scoring pass and compressed prefill. One transient rich bar on stderr per step, shown only while
the step runs (so a command's streamed answer on stdout never shares the screen with it), drawn only when stderr
is a terminal, and not at all under ``--json``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from h2o_compress.utils.progress import report_progress


class StageBar:
    """A [`ProgressFn`][h2o_compress.utils.progress.ProgressFn] that draws each stage as a transient rich bar on
    stderr: started at the stage's first report, replaced by the next stage, closed once ``done >= total``."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = None
        self._task = None
        self._stage: str | None = None

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        """Show ``done`` of ``total`` for ``stage`` (a new stage replaces the bar's task; ``total`` ``None``: an
        open-ended bar); close the bar once the stage is done."""
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = _progress()
            self._bar.start()
        if stage != self._stage or (total is None and self._bar.tasks[-1].total is not None):  # rich keeps a total
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task, self._stage = self._bar.add_task(stage, total=total), stage
        self._bar.update(self._task, completed=done, total=total)
        if total is not None and done >= total:
            self.close()

    def close(self) -> None:
        """Stop the bar (it disappears); the next report starts a new one."""
        if self._bar is not None:
            self._bar.stop()
        self._bar = self._task = self._stage = None


def _progress():
    """A transient rich bar on stderr: the stage, its bar (a pulse while the total is not known), done/total (left
    out while the total is not known: no ``0/?``) and the time elapsed."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Counts(MofNCompleteColumn):
        def render(self, task):
            return Text("") if task.total is None else super().render(task)

    columns = (TextColumn("{task.description}"), BarColumn(bar_width=16), Counts(), TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), transient=True)


@contextmanager
def stage_progress(enabled: bool = True) -> Iterator[StageBar]:
    """Inside the block, the library's long steps report to a [`StageBar`][h2o_compress.cli.progress.StageBar]
    (``enabled=False``: to nothing, e.g. under ``--json``); any bar left is closed at the end, also on an error."""
    bar = StageBar(enabled)
    try:
        with report_progress(bar):
            yield bar
    finally:
        bar.close()
