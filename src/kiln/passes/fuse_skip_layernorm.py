"""Add + LayerNormalization -> kiln::SkipLayerNorm: the residual add and the norm in one pass."""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name, replace


def run(graph: Graph) -> None:
    view = View(graph)
    for ln in [n for n in graph.nodes if n.op_type == "LayerNormalization" and not n.domain]:
        if ln.attr("axis", -1) != -1 or len([o for o in ln.outputs if o]) != 1:
            continue
        add = view.producer.get(ln.inputs[0])
        if add is None or add.op_type != "Add" or add.domain:
            continue
        if any(view.const(i) is not None for i in add.inputs):
            continue  # a bias add, not a residual
        gamma = ln.inputs[1]
        beta = ln.inputs[2] if len(ln.inputs) > 2 else ""
        extra = add.outputs[0] if view.readers(add.outputs[0]) > 1 else ""
        fused = Node("SkipLayerNorm", [add.inputs[0], add.inputs[1], gamma, beta], [ln.outputs[0], extra],
                     {"epsilon": ln.attr("epsilon", 1e-5)}, name=fused_name([add, ln]), domain="kiln")
        replace(graph, [add, ln], fused)
        view.refresh()
