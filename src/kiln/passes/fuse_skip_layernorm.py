"""Add + LayerNormalization -> kiln::SkipLayerNorm: the residual add and the norm in one pass.

A sum of three, (x + y) + z with the inner sum read by nothing else, joins too (z as input 5): BERT's embeddings
(word + token type, then + position, whose table slice is a constant) were a generated add kernel and a norm.
A computed value plus a constant table of rows (GPT-2's token embeddings + the position table's slice, folded
to a constant) joins so too, the table as that third addend and no second: a bias vector stays apart."""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name, replace


def run(graph: Graph) -> None:
    view = View(graph)
    for ln in [n for n in graph.nodes if n.op_type == "LayerNormalization" and not n.domain]:
        if ln.attr("axis", -1) != -1 or len([o for o in ln.outputs if o]) != 1:
            continue
        add = view.producer.get(ln.inputs[0])
        if not _plain_add(add):
            continue
        inner = next((p for p in map(view.producer.get, add.inputs) if _plain_add(p) and add.inputs[0] != add.inputs[1]
                      and view.sole_reader(p.outputs[0]) is add and not _has_const(view, p)), None)
        if inner is not None:  # (x + y) + z
            addends, third, nodes = list(inner.inputs), add.inputs[1 - add.inputs.index(inner.outputs[0])], [inner]
        elif _has_const(view, add):
            table = _const_table(view, add)
            if table is None:
                continue  # a bias add, not a residual
            addends, third, nodes = [add.inputs[1 - add.inputs.index(table)], ""], table, []
        else:
            addends, third, nodes = list(add.inputs), "", []
        gamma = ln.inputs[1]
        beta = ln.inputs[2] if len(ln.inputs) > 2 else ""
        extra = add.outputs[0] if view.readers(add.outputs[0]) > 1 else ""
        nodes += [add, ln]
        fused = Node("SkipLayerNorm", addends + [gamma, beta] + (["", third] if third else []), [ln.outputs[0], extra],
                     {"epsilon": ln.attr("epsilon", 1e-5)}, name=fused_name(nodes), domain="kiln")
        replace(graph, nodes, fused)
        view.refresh()


def _plain_add(n) -> bool:
    return n is not None and n.op_type == "Add" and not n.domain and len(n.inputs) == 2


def _const_table(view: View, add):
    """The constant input of `add` when it is a table of rows (2-D or more) added to a computed value, else None."""
    consts = [i for i in add.inputs if view.const(i) is not None]
    if len(consts) != 1 or add.inputs[0] == add.inputs[1] or view.const(consts[0]).dim() < 2:
        return None
    return consts[0]


def _has_const(view: View, n) -> bool:
    return any(view.const(i) is not None for i in n.inputs)
