"""After fuse_qdq: integer weights that no quantized layer took (their layer runs in float) become float weights.

fold_constants leaves DequantizeLinear of integer weights in place, so that fuse_qdq can run the layer on the
integers; where fuse_qdq did not (the activation is not quantized, or the layer's pattern does not fuse), the
DequantizeLinear is evaluated once here instead of in every run.
"""

from __future__ import annotations

from ..ir.graph import Graph
from . import fold_constants


def run(graph: Graph) -> None:
    fold_constants.run(graph, keep_quantized=False)
