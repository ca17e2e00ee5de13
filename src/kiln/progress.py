"""Progress display for long work (builds, tactic search, calibration passes).

On a terminal: a live rich display (a spinner, or a bar when the number of items is known) with the current
step and the elapsed time. Elsewhere (CI logs, pipes): one plain line per step.
"""

from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class ProgressDisplay:
    """`step(msg)`: now doing msg. `advance(msg)`: one of `total` items, described by msg, is done."""

    def __init__(self, console: Console, label: str, progress: Progress | None, total: int | None, first: str):
        self._console, self._label, self._p = console, label, progress
        self._task = progress.add_task(escape(first), total=total) if progress else None
        self._start = time.perf_counter()
        self._pending: str | None = None  # counted items, plain output: the message not yet printed

    def step(self, message: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=escape(message))
        else:
            self._line(message)

    def advance(self, message: str) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=1, description=escape(message))
            return
        # One line per run of items with the same message (a calibration pass), printed when it ends.
        if self._pending is not None and message != self._pending:
            self._line(f"{self._pending} done")
        self._pending = message

    def close(self, ok: bool) -> None:
        if self._p is None and ok and self._pending is not None:
            self._line(f"{self._pending} done")

    def _line(self, message: str) -> None:
        self._console.print(f"[dim]{self._label} [{time.perf_counter() - self._start:6.1f} s] {escape(message)}[/]")


@contextlib.contextmanager
def progress(label: str, total: int | None = None, first: str = ""):
    """A ProgressDisplay on stderr, labelled `label` ('kiln build'); a bar of `total` items when given."""
    console = Console(file=sys.stderr, highlight=False)
    if not console.is_terminal:
        display = ProgressDisplay(console, label, None, total, first)
        ok = False
        try:
            yield display
            ok = True
        finally:
            display.close(ok)
        return
    columns = ((SpinnerColumn(), TextColumn(f"[bold]{label}[/] {{task.description}}"), TimeElapsedColumn())
               if total is None else
               (TextColumn(f"[bold]{label}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn()))
    # What the work prints to stdout stays on stdout unless stdout is this terminal too (then it prints above the
    # bar, as rich redirects it): a pipe or file that stdout is keeps exactly what the command writes.
    with Progress(*columns, console=console, transient=True, redirect_stdout=_stdout_is_terminal()) as p:
        yield ProgressDisplay(console, label, p, total, first)


def _stdout_is_terminal() -> bool:
    """The device itself, not rich's verdict: TTY_COMPATIBLE / FORCE_COLOR make every console a terminal."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # no stdout, or a closed one
        return False


class _Silent:
    """terminal_progress's display where nothing is drawn."""

    def step(self, message: str) -> None:
        pass

    def advance(self, message: str) -> None:
        pass


@contextlib.contextmanager
def terminal_progress(label: str, total: int | None = None, first: str = "", enabled: bool = True):
    """progress() where `enabled` and stderr is a terminal (rich's test: a TTY, or TTY_COMPATIBLE=1 /
    FORCE_COLOR in the environment); elsewhere nothing at all, not even plain lines. For work whose items would
    only clutter a log or a library caller's output: tensors loaded, requests finished, zoo cases."""
    if not enabled or not Console(file=sys.stderr).is_terminal:
        yield _Silent()
        return
    with progress(label, total, first) as display:
        yield display


def build_progress():
    """The build's display: steps labelled 'kiln build'."""
    return progress("kiln build")
