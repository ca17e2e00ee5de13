"""Multi-head attention -> one kiln::Attention layer (SDPA / flash class).

Matches softmax(Q' @ K' (* or / c) + mask) @ V with Q' = Q * s1 and K' = K^T * s2
(torch's exporter scales both sides by sqrt(scale)), plus the exporter's guard
that zeroes NaN rows (Softmax -> IsNaN -> Where). The scores and probabilities
never reach device memory: [B, H, S, S] intermediates disappear.

The exporter writes K^T of a 4-D K as Reshape([-1, S, D]) -> Transpose -> Reshape(
[B, H, D, S]): a copy of K per layer, since K is itself a strided view of the QKV
GEMM. When the two shapes provably come from K's own Shape, the layer reads K
directly (k_transposed=0) and the chain is left to dead-code removal.
"""

from __future__ import annotations

import torch

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


def _finite_mask(view: View, mask: str | None) -> bool:
    """A mask finite by construction: a constant, or Where(cond, a, b) of finite constants (HF's BERT masks
    with float32's lowest value; Kiln's FP16 weights saturate rather than overflow). Then no score row
    is all -inf, softmax cannot return NaN, and the exporter's NaN guard has nothing to do."""
    if not mask:
        return True
    n = view.producer.get(mask)
    values = [mask] if n is None else n.inputs[1:] if n.op_type == "Where" and not n.domain else []
    consts = [view.const(v) for v in values]
    return bool(consts) and all(c is not None and c.is_floating_point() and bool(torch.isfinite(c).all())
                                for c in consts)


def _guard(view: View, probs: str):
    """Where(IsNaN(p), 0, p) after the softmax: (guarded value, [nodes]) or (probs, [])."""
    users = view.consumers.get(probs, [])
    isnan = next((u for u in users if u.op_type == "IsNaN"), None)
    where = next((u for u in users if u.op_type == "Where"), None)
    if len(users) == 2 and isnan and where and where.inputs[0] == isnan.outputs[0] and where.inputs[2] == probs \
            and view.scalar(where.inputs[1]) == 0.0 and view.readers(isnan.outputs[0]) == 1:
        return where.outputs[0], [isnan, where]
    return probs, []


_BIG = 2**62  # Slice bounds beyond this mean "to the end" (exporters write INT64_MAX / INT64_MIN)


def _shape_terms(view: View, value: str):
    """A 1-D int64 shape value as a list of ints and (tensor, start, end) slices of Shape(tensor), or None."""
    const = view.const(value)
    if const is not None:
        return view.ints(value) if const.dim() <= 1 else None
    n = view.producer.get(value)
    if n is None or n.domain:
        return None
    if n.op_type == "Shape":
        return [(n.inputs[0], n.attr("start", 0) or None, n.attr("end"))]
    if n.op_type == "Concat" and n.attr("axis", 0) in (0, -1):
        parts = [_shape_terms(view, i) for i in n.inputs]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]
    if n.op_type == "Slice" and len(n.inputs) in (3, 4, 5):
        src = _shape_terms(view, n.inputs[0])
        bounds = [view.const(i) if i else None for i in n.inputs[1:]]
        if src is None or len(src) != 1 or not isinstance(src[0], tuple) or src[0][1:] != (None, None):
            return None  # only slices of a whole Shape
        if any(b is not None and b.numel() != 1 for b in bounds) or bounds[0] is None or bounds[1] is None:
            return None
        axes, steps = (bounds + [None, None])[2:4]
        if (axes is not None and int(axes) not in (0, -1)) or (steps is not None and int(steps) != 1):
            return None
        start, end = int(bounds[0]), int(bounds[1])
        return [(src[0][0], None if start == 0 or start <= -_BIG else start, None if end >= _BIG else end)]
    return None


def _untransposed_k(view: View, kt: str):
    """kt = swap of K's last two axes written as Reshape -> Transpose([0, 2, 1]) -> Reshape: (K, [nodes]) or None."""
    r2 = view.producer.get(kt)
    t = view.producer.get(r2.inputs[0]) if r2 is not None and r2.op_type == "Reshape" and not r2.domain else None
    r1 = view.producer.get(t.inputs[0]) if t is not None and t.op_type == "Transpose" and not t.domain else None
    if r1 is None or r1.op_type != "Reshape" or r1.domain or t.attr("perm") != [0, 2, 1]:
        return None
    k = r1.inputs[0]
    merged = [-1, (k, -2, -1), (k, -1, None)]  # [B * H, S, D]
    split = [(k, None, -2), (k, -1, None), (k, -2, -1)]  # [B, H, D, S]
    if _shape_terms(view, r1.inputs[1]) != merged or _shape_terms(view, r2.inputs[1]) != split:
        return None
    if any(view.readers(n.outputs[0]) != 1 for n in (r1, t, r2)):
        return None
    return k, [r1, t, r2]


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
        k_transposed, k = 1, kt
        untransposed = _untransposed_k(view, kt)
        if untransposed is not None:
            k, chain = untransposed
            k_transposed = 0
            group += chain
        attrs = {"scale": s1 * s2 * post, "k_transposed": k_transposed,
                 "nan_guard": 1 if guard and not _finite_mask(view, mask) else 0}
        fused = Node("Attention", [q, k, pv.inputs[1]] + ([mask] if mask else []), [pv.outputs[0]], attrs,
                     name=fused_name(group), domain="kiln")
        replace(graph, group, fused)
        view.refresh()
