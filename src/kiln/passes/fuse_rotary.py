"""Rotary position embedding as HF Llama/Qwen2/Mistral export it -> one kiln::Rotary layer (ops/rotary.py).

    x * cos + Concat(Neg(Slice(x, h, end)), Slice(x, 0, h)) * sin        (q * cos + rotate_half(q) * sin)

Per q or k, the Neg, the Concat's copy and the Muls and Add (one generated kernel after fuse_elementwise)
become one pass over x: three kernels and two intermediates fewer. cos and sin may be constants (static
positions) or computed (position ids); the Muls and the Add match in either operand order.
"""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name, replace


def _slice_of(view: View, node) -> tuple[str, int, int, int] | None:
    """A Slice with constant bounds over one axis, step 1: (data, start, end, axis)."""
    if node is None or node.op_type != "Slice" or node.domain or node.opset < 10 or len(node.inputs) < 3:
        return None
    starts, ends = view.ints(node.inputs[1]), view.ints(node.inputs[2])
    axes = view.ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else [0]
    steps = view.ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    if starts is None or ends is None or axes is None or steps != [1] or not len(starts) == len(ends) == len(axes) == 1:
        return None
    return node.inputs[0], starts[0], ends[0], axes[0]


def _rotate_half(view: View, cat) -> tuple[str, int, int, int, list[Node]] | None:
    """Concat(Neg(Slice(x, h, end)), Slice(x, 0, h)): (x, h, end, slice axis, the nodes)."""
    if cat.op_type != "Concat" or cat.domain or len(cat.inputs) != 2:
        return None
    neg, low = view.producer.get(cat.inputs[0]), view.producer.get(cat.inputs[1])
    if neg is None or neg.op_type != "Neg" or neg.domain or view.sole_reader(neg.outputs[0]) is not cat:
        return None
    hi, lo = _slice_of(view, view.producer.get(neg.inputs[0])), _slice_of(view, low)
    if (hi is None or lo is None or view.sole_reader(neg.inputs[0]) is not neg
            or view.sole_reader(low.outputs[0]) is not cat):
        return None
    (x, h, end, axis), (x_lo, start_lo, h_lo, axis_lo) = hi, lo
    if x != x_lo or axis != axis_lo or start_lo != 0 or h_lo != h or h <= 0 or end <= h:
        return None
    return x, h, end, axis, [low, view.producer[neg.inputs[0]], neg]


def _times(view: View, value: str, node) -> str | None:
    """For a Mul reading `value`, its other input (a Mul of value by itself is not a rotary product)."""
    if node is None or node.op_type != "Mul" or node.domain:
        return None
    other = view.other_input(node, value)
    return other if other and other != value else None


def run(graph: Graph) -> None:
    view = View(graph)
    for cat in [n for n in graph.nodes if n.op_type == "Concat"]:
        found = _rotate_half(view, cat)
        if found is None:
            continue
        x, h, end, axis, rotate = found
        mul_sin = view.sole_reader(cat.outputs[0])
        sin = _times(view, cat.outputs[0], mul_sin)
        add = view.sole_reader(mul_sin.outputs[0]) if sin is not None else None
        if add is None or add.op_type != "Add" or add.domain:
            continue
        other = view.other_input(add, mul_sin.outputs[0])
        mul_cos = view.producer.get(other) if other else None
        cos = _times(view, x, mul_cos)
        if cos is None or view.sole_reader(mul_cos.outputs[0]) is not add or x not in mul_cos.inputs:
            continue
        group = [mul_cos, *rotate, cat, mul_sin, add]
        attrs = {"split": h, "end": end, "axis": axis, "concat_axis": cat.attr("axis")}
        replace(graph, group, Node("Rotary", [x, cos, sin], [add.outputs[0]], attrs, name=fused_name(group),
                                   domain="kiln"))
        view.refresh()
