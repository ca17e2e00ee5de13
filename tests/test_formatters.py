"""One shape formatter: kiln.ir.shapes.fmt_shape is the only place that joins dims with 'x' (inspect's per-axis
ranges build on it for their own 'min..max' dims), so every message and table writes shapes the same way."""

from pathlib import Path

from kiln.ir.shapes import fmt_shape

SRC = Path(__file__).resolve().parents[1] / "src" / "kiln"
ALLOWED = {"ir/shapes.py", "tools/inspect.py"}  # inspect: compact_range joins '[1..8]'-style axes, not dims


def test_no_module_formats_shapes_by_itself():
    joiners = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if '"x".join(' in p.read_text() or "'x'.join(" in p.read_text())
    assert set(joiners) <= ALLOWED, f"format shapes with kiln.ir.shapes.fmt_shape: {sorted(set(joiners) - ALLOWED)}"


def test_unknown_and_symbolic_dims_and_scalars():
    assert fmt_shape([2, None, "seq", ""]) == "2x?xseqx?"
    assert fmt_shape(()) == "scalar" and fmt_shape((1, 3)) == "1x3"
