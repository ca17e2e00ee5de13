"""How a shape reads in messages and tables: (1, 3, None, 'seq') -> '1x3x?xseq', () -> 'scalar'."""

from __future__ import annotations


def fmt_shape(shape) -> str:
    """Dims joined by 'x'; an unknown dim (None or '') reads '?', a symbolic one by its name."""
    dims = ["?" if d is None or d == "" else str(d) for d in shape]
    return "x".join(dims) if dims else "scalar"
