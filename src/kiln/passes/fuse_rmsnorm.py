"""RMSNorm as exporters write it -> one kiln::RMSNorm layer.

    x * 1/sqrt(mean(x^2, axis=-1) + eps) * gamma     (Llama-style decoders)

The Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul chain becomes one pass over x instead
of five kernels and four intermediates.

When x is a residual Add of two computed values (every norm of a decoder layer after the first), the add
joins the layer as its third input: RMSNorm(a, gamma, b) normalizes a + b and, when anything else reads the
sum (the next residual Add), writes it as its second output, as kiln::SkipLayerNorm does for LayerNorm.
"""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name, replace


def _is_square_of(view: View, node):
    """Pow(x, 2) or Mul(x, x): returns x."""
    if node is None or node.domain:
        return None
    if node.op_type == "Pow" and view.scalar(node.inputs[1]) == 2.0:
        return node.inputs[0]
    if node.op_type == "Mul" and node.inputs[0] == node.inputs[1]:
        return node.inputs[0]
    return None


def _last_axis_mean(view: View, r) -> bool:
    if r.op_type != "ReduceMean" or r.domain or not r.attr("keepdims", 1):
        return False
    axes = r.attr("axes")
    if axes is None and len(r.inputs) > 1 and r.inputs[1]:
        axes = view.ints(r.inputs[1])
    return axes == [-1]


def run(graph: Graph) -> None:
    view = View(graph)
    for r in [n for n in graph.nodes if n.op_type == "ReduceMean"]:
        if not _last_axis_mean(view, r):
            continue
        sq = view.producer.get(r.inputs[0])
        x = _is_square_of(view, sq)
        if x is None or view.readers(sq.outputs[0]) != 1:
            continue
        add = view.sole_reader(r.outputs[0])
        if (add is None or add.op_type != "Add"
                or (eps := view.scalar(view.other_input(add, r.outputs[0]) or "")) is None):
            continue
        sqrt = view.sole_reader(add.outputs[0])
        if sqrt is None or sqrt.op_type != "Sqrt":
            continue
        nxt = view.sole_reader(sqrt.outputs[0])
        group = [sq, r, add, sqrt]
        if nxt is not None and nxt.op_type == "Reciprocal":
            mul = view.sole_reader(nxt.outputs[0])
            if mul is None or mul.op_type != "Mul" or view.other_input(mul, nxt.outputs[0]) != x:
                continue
            group += [nxt, mul]
        elif nxt is not None and nxt.op_type == "Div" and nxt.inputs == [x, sqrt.outputs[0]]:
            mul = nxt
            group.append(nxt)
        else:
            continue
        out, gamma = mul.outputs[0], ""
        scale = view.sole_reader(out)
        other = view.other_input(scale, out) if scale is not None and scale.op_type == "Mul" else None
        if other and view.const(other) is not None and view.const(other).dim() == 1:
            gamma, out = other, scale.outputs[0]
            group.append(scale)
        inputs, outputs = [x, gamma], [out]
        add = _residual_add(view, x)
        if add is not None:
            inside = {id(n) for n in group}
            read_after = x in view.outputs or any(id(n) not in inside for n in view.consumers.get(x, []))
            inputs, outputs = [add.inputs[0], gamma, add.inputs[1]], [out, x if read_after else ""]
            group.insert(0, add)
        fused = Node("RMSNorm", inputs, outputs, {"epsilon": eps}, name=fused_name(group), domain="kiln")
        replace(graph, group, fused)
        view.refresh()


def _residual_add(view: View, x: str):
    """The plain Add of two distinct computed values that produces x, else None (a bias add is no residual)."""
    add = view.producer.get(x)
    if (add is None or add.op_type != "Add" or add.domain or len(add.inputs) != 2 or add.inputs[0] == add.inputs[1]
            or any(not i or view.const(i) is not None for i in add.inputs)):
        return None
    return add
