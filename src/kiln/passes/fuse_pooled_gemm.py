"""Global average pool -> flatten -> FusedGemm -> kiln::PooledGemm: a CNN's head as one layer.

Exporters write ResNet's head as ReduceMean over H and W (keepdims) or GlobalAveragePool, a Reshape to
[-1, C] (or Flatten), then the classifier GEMM. At batch 1 that is a pool kernel and a cuBLAS
GEMM on 64x8 tiles reading 4 MB of weights (docs/design/small-kernels.md); one of the fused layer's tactics pools
and multiplies in a single kernel.
"""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name, replace


def _spatial_pool(view: View, node: Node | None) -> bool:
    """A mean over the last two axes of a 4-D tensor, keepdims or not."""
    if node is None or node.domain:
        return False
    if node.op_type == "GlobalAveragePool":
        return True
    if node.op_type != "ReduceMean" or node.attr("noop_with_empty_axes", 0):
        return False
    axes = view.ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else node.attr("axes")
    return axes is not None and sorted(a % 4 for a in axes) == [2, 3]


def _flattens_channels(view: View, node: Node | None, channels: int) -> bool:
    """[N, C, 1, 1] -> [N, C]: Flatten at axis 1, or a Reshape to [-1, C]."""
    if node is None or node.domain:
        return False
    if node.op_type == "Flatten":
        return node.attr("axis", 1) == 1
    return node.op_type == "Reshape" and view.ints(node.inputs[1]) == [-1, channels]


def run(graph: Graph) -> None:
    view = View(graph)
    for gemm in [n for n in graph.nodes if n.op_type == "FusedGemm" and n.domain == "kiln"]:
        w = view.const(gemm.inputs[1])
        if w is None or w.dim() != 2:
            continue
        chain = [gemm]
        flat = view.producer.get(gemm.inputs[0])
        if _flattens_channels(view, flat, w.shape[0]) and view.sole_reader(flat.outputs[0]) is gemm:
            chain.insert(0, flat)
        pool = view.producer.get(chain[0].inputs[0])
        if not _spatial_pool(view, pool) or view.sole_reader(pool.outputs[0]) is not chain[0]:
            continue
        kept_dims = pool.op_type == "GlobalAveragePool" or bool(pool.attr("keepdims", 1))
        if kept_dims != (len(chain) == 2):  # [N, C, 1, 1] must be flattened; [N, C] must not be
            continue
        fused = Node("PooledGemm", [pool.inputs[0], *gemm.inputs[1:]], list(gemm.outputs), dict(gemm.attrs),
                     name=fused_name([pool, *chain]), domain="kiln")
        replace(graph, [pool, *chain], fused)
        view.refresh()
