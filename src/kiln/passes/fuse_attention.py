"""Multi-head attention -> one kiln::Attention layer (SDPA / flash class).

Matches softmax(Q' @ K' (* or / c) + mask) @ V with Q' = Q * s1 and K' = K^T * s2
(torch's exporter scales both sides by sqrt(scale)), plus the exporter's guard
that zeroes NaN rows (Softmax -> IsNaN -> Where). The scores and probabilities
never reach device memory: [B, H, S, S] intermediates disappear.
"""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name, miss, replace


def _unscale(view: View, value: str):
    """(source, factor, node) when value = source * const or source / const, else (value, 1.0, None)."""
    n = view.producer.get(value)
    if n is not None and n.op_type in ("Mul", "Div") and not n.domain and view.readers(value) == 1:
        c = view.scalar(n.inputs[1])
        if c is None and n.op_type == "Mul":
            c, src = view.scalar(n.inputs[0]), n.inputs[1]
        else:
            src = n.inputs[0]
        if c is not None and c != 0:
            return src, (c if n.op_type == "Mul" else 1.0 / c), n
    return value, 1.0, None


def _guard(view: View, probs: str):
    """Where(IsNaN(p), 0, p) after the softmax: (guarded value, [nodes]) or (probs, [])."""
    users = view.consumers.get(probs, [])
    isnan = next((u for u in users if u.op_type == "IsNaN"), None)
    where = next((u for u in users if u.op_type == "Where"), None)
    if len(users) == 2 and isnan and where and where.inputs[0] == isnan.outputs[0] and where.inputs[2] == probs \
            and view.scalar(where.inputs[1]) == 0.0 and view.readers(isnan.outputs[0]) == 1:
        return where.outputs[0], [isnan, where]
    return probs, []


def run(graph: Graph) -> None:
    view = View(graph)
    for sm in [n for n in graph.nodes if n.op_type == "Softmax" and not n.domain]:
        if sm.opset < 13 or sm.attr("axis", -1) != -1:
            continue
        group = [sm]
        scores, mask = sm.inputs[0], None
        add = view.producer.get(scores)
        if add is not None and add.op_type == "Add" and not add.domain and view.readers(scores) == 1:
            left = view.producer.get(add.inputs[0])
            idx = 0 if left is not None and left.op_type in ("MatMul", "Mul", "Div") else 1
            scores, mask = add.inputs[idx], add.inputs[1 - idx]
            group.append(add)
        scores, post, scale_node = _unscale(view, scores)
        if scale_node:
            group.append(scale_node)
        qk = view.producer.get(scores)
        if qk is None or qk.op_type != "MatMul" or qk.domain or view.readers(scores) != 1:
            continue
        group.append(qk)
        q, s1, n1 = _unscale(view, qk.inputs[0])
        kt, s2, n2 = _unscale(view, qk.inputs[1])
        group += [n for n in (n1, n2) if n]
        probs, guard = _guard(view, sm.outputs[0])
        if not guard and view.readers(sm.outputs[0]) != 1:
            miss(graph, "attention", group, "the softmax output is read by other layers")
            continue
        group += guard
        pv = view.sole_reader(probs)
        if pv is None or pv.op_type != "MatMul" or pv.inputs[0] != probs:
            miss(graph, "attention", group, "the probabilities are not multiplied by V in one MatMul")
            continue
        group.append(pv)
        attrs = {"scale": s1 * s2 * post, "k_transposed": 1, "nan_guard": 1 if guard else 0}
        fused = Node("Attention", [q, kt, pv.inputs[1]] + ([mask] if mask else []), [pv.outputs[0]], attrs,
                     name=fused_name(group), domain="kiln")
        replace(graph, group, fused)
        view.refresh()
