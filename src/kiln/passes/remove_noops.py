"""No-op removal: Identity, inference Dropout, and Transpose pairs that cancel."""

from __future__ import annotations

from ..ir.graph import Graph
from .rewrite import View, bypass


def _is_noop(view: View, node) -> bool:
    if node.domain:
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        # Inference: Dropout passes its input through unless training_mode is a true constant.
        mask_used = len(node.outputs) > 1 and node.outputs[1] and view.readers(node.outputs[1])
        training = node.inputs[2] if len(node.inputs) > 2 else ""
        t = view.const(training) if training else None
        return not mask_used and (not training or (t is not None and not bool(t.reshape(-1)[0])))
    return False


def run(graph: Graph) -> None:
    view = View(graph)
    for node in list(graph.nodes):
        if _is_noop(view, node):
            bypass(graph, view, node, node.inputs[0])
        elif node.op_type == "Transpose" and node.domain == "":
            first = view.producer.get(node.inputs[0])
            if first is None or first.op_type != "Transpose" or first.domain or view.readers(first.outputs[0]) != 1:
                continue
            p1, p2 = first.attr("perm"), node.attr("perm")
            if p1 and p2 and [p1[i] for i in p2] == list(range(len(p1))):
                if bypass(graph, view, node, first.inputs[0]):
                    graph.nodes.remove(first)
                    view.refresh()
