"""Progress display for long work (builds, tactic search, calibration)."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class _Steps:
    def __init__(self, progress: Progress):
        self._p = progress
        self._task = progress.add_task("building", total=None)

    def step(self, message: str) -> None:
        self._p.update(self._task, description=message)
        self._p.console.log(f"[dim]{message}[/]") if not self._p.console.is_terminal else None


@contextlib.contextmanager
def build_progress():
    console = Console(file=sys.stderr)
    with Progress(SpinnerColumn(), TextColumn("[bold]kiln build[/] {task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as p:
        yield _Steps(p)
