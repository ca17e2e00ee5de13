"""The one progress display: plain lines off a terminal, for steps and for counted items."""

import io

from rich.console import Console

from kiln.ir.shapes import fmt_shape
from kiln.progress import ProgressDisplay, progress


def _plain(label: str, total=None) -> tuple[ProgressDisplay, io.StringIO]:
    buf = io.StringIO()
    return ProgressDisplay(Console(file=buf, highlight=False, width=200), label, None, total, ""), buf


def test_steps_print_one_line_each():
    d, buf = _plain("kiln build")
    d.step("loading [model]")
    d.step("timing tactics")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("kiln build [") and lines[0].endswith("loading [model]")
    assert lines[1].endswith("timing tactics")


def test_counted_items_print_one_line_per_run_of_a_message():
    d, buf = _plain("kiln calibrate", total=5)
    for msg in ("amax pass", "amax pass", "amax pass", "histogram pass", "histogram pass"):
        d.advance(msg)
    d.close(ok=True)
    lines = buf.getvalue().splitlines()
    assert [ln.split("] ", 1)[1] for ln in lines] == ["amax pass done", "histogram pass done"]


def test_failed_work_does_not_claim_its_last_pass_done(capsys):
    try:
        with progress("kiln calibrate", total=2) as bar:
            bar.advance("amax pass")
            raise RuntimeError("stop")
    except RuntimeError:
        pass
    assert "done" not in capsys.readouterr().err  # pytest's stderr is not a terminal: the plain form


def test_shape_text():
    assert fmt_shape((1, 3, None, "seq")) == "1x3x?xseq"
    assert fmt_shape(()) == "scalar" and fmt_shape([4, ""]) == "4x?"
