"""Progress display for long work (builds, tactic search, calibration).

On a terminal: a live spinner with the current step and elapsed time. Elsewhere
(CI logs, pipes): one plain line per step.
"""

from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class _Steps:
    def __init__(self, console: Console, progress: Progress | None):
        self._console, self._p = console, progress
        self._task = progress.add_task("", total=None) if progress else None
        self._start = time.perf_counter()

    def step(self, message: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=escape(message))
        else:
            self._console.print(f"[dim]kiln build [{time.perf_counter() - self._start:6.1f} s] {escape(message)}[/]")


@contextlib.contextmanager
def build_progress():
    console = Console(file=sys.stderr, highlight=False)
    if not console.is_terminal:
        yield _Steps(console, None)
        return
    with Progress(SpinnerColumn(), TextColumn("[bold]kiln build[/] {task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as p:
        yield _Steps(console, p)
