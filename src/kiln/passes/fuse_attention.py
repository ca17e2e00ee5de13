"""Multi-head attention -> one kiln::Attention layer (SDPA / flash class).

Matches softmax(Q' @ K' (* or / c) + mask) @ V with Q' = Q * s1 and K' = K^T * s2
(torch's exporter scales both sides by sqrt(scale)), plus the exporter's guard
that zeroes NaN rows (Softmax -> IsNaN -> Where). The scores and probabilities
never reach device memory: [B, H, S, S] intermediates disappear.

The exporter writes K^T of a 4-D K as Reshape([-1, S, D]) -> Transpose -> Reshape(
[B, H, D, S]): a copy of K per layer, since K is itself a strided view of the QKV
GEMM. When the two shapes provably come from K's own Shape, the layer reads K
directly (k_transposed=0) and the chain is left to dead-code removal.

Window attention (Swin): the scores [B * W, H, N, N] of W windows an image take the relative position bias, then
go through a 5-D view [B, W, H, N, N] to take the shifted windows' mask [1, W, 1, N, N], and back. The layer then
runs on 5-D views of q, k and v ([B, W, H, N, D], split from the leading axis: no copy) with the bias and mask as
one constant [1, W, H, N, N], and its result is viewed back as [B * W, H, N, Dv].
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


def _windows(view: View, value: str):
    """value = Reshape(Add(Reshape(x, [B, W, H, Sq, Sk]), m), [B * W, H, Sq, Sk]) with m a constant that does not
    widen the scores (Swin's shifted-window mask): (x, m, W, [nodes]), else None. B may be -1 in either shape."""
    back = view.producer.get(value)
    if back is None or back.op_type != "Reshape" or back.domain or view.readers(value) != 1:
        return None
    add = view.producer.get(back.inputs[0])
    if add is None or add.op_type != "Add" or add.domain or view.readers(add.outputs[0]) != 1:
        return None
    for i in (0, 1):
        split = view.producer.get(add.inputs[i])
        if split is not None and split.op_type == "Reshape" and not split.domain \
                and view.readers(add.inputs[i]) == 1:
            break
    else:
        return None
    five, four, m = view.ints(split.inputs[1]), view.ints(back.inputs[1]), view.const(add.inputs[1 - i])
    if five is None or four is None or len(five) != 5 or len(four) != 4 or m is None or m.dim() > 5:
        return None
    w = five[1]
    if min(five[1:] + four[1:]) <= 0 or five[2:] != four[1:] or not m.is_floating_point():
        return None
    if -1 not in (five[0], four[0]) and four[0] != five[0] * w:
        return None
    if any(s not in (1, t) for s, t in zip(m.shape[::-1], five[:0:-1])) or (m.dim() == 5 and m.shape[0] != 1):
        return None  # the mask would widen the scores
    return split.inputs[0], add.inputs[1 - i], w, [back, add, split]


def _window_mask(graph: Graph, view: View, bias: str | None, window_mask: str, w: int, name: str) -> str | None:
    """The constant bias added to the scores [B * W, H, Sq, Sk] (Swin's relative position bias) and the windows' mask
    as one 5-D constant; None when the bias is not a constant."""
    m = view.const(window_mask)
    if bias is None:
        return window_mask
    b = view.const(bias)
    if b is None or not b.is_floating_point() or b.dim() > 4:
        return None
    if b.dim() == 4 and b.shape[0] != 1:  # one bias per window and image: [B * W, ...] -> [B, W, ...]
        b = b.reshape(-1, w, *b.shape[1:])
    out = f"{name}.window_mask"
    graph.initializers[out] = (b + m).to(torch.promote_types(b.dtype, m.dtype))
    return out


def _ints(graph: Graph, name: str, values: list[int]) -> str:
    graph.initializers[name] = torch.tensor(values, dtype=torch.int64)
    return name


def _reshape_nodes(graph: Graph, value: str, head: list[int], keep_from: int, out: str, opset: int) -> list[Node]:
    """Reshape(value, head + Shape(value)[keep_from:]): the leading axis split into windows or merged back."""
    shape, tail, target = f"{out}.shape", f"{out}.tail", f"{out}.target"
    return [Node("Shape", [value], [shape], name=shape, opset=opset),
            Node("Slice", [shape, _ints(graph, f"{out}.from", [keep_from]), _ints(graph, f"{out}.end", [_BIG])],
                 [tail], name=tail, opset=opset),
            Node("Concat", [_ints(graph, f"{out}.head", head), tail], [target], {"axis": 0}, name=target,
                 opset=opset),
            Node("Reshape", [value, target], [out], name=out, opset=opset)]


def run(graph: Graph) -> None:
    view = View(graph)
    for sm in [n for n in graph.nodes if n.op_type == "Softmax" and not n.domain]:
        if sm.opset < 13 or sm.attr("axis", -1) != -1:
            continue
        group = [sm]
        scores, mask = sm.inputs[0], None
        windows = _windows(view, scores)
        if windows is not None:
            scores, window_mask, w, nodes = windows
            group += nodes
        add = view.producer.get(scores)
        if add is not None and add.op_type == "Add" and not add.domain and view.readers(scores) == 1:
            left = view.producer.get(add.inputs[0])
            idx = 0 if left is not None and left.op_type in ("MatMul", "Mul", "Div") else 1
            scores, mask = add.inputs[idx], add.inputs[1 - idx]
            group.append(add)
        if windows is not None:
            mask = _window_mask(graph, view, mask, window_mask, w, sm.name)
            if mask is None:
                miss(graph, "attention", group, "the windows' scores take a bias that is not a constant")
                continue
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
        v, out, before, after = pv.inputs[1], pv.outputs[0], [], []
        if windows is not None:  # the layer on 5-D views: [B * W, ...] -> [B, W, ...] and back
            q, k, v = ((t, f"{sm.name}.windows_{role}") for role, t in (("q", q), ("k", k), ("v", v)))
            before = [n for t, o in (q, k, v) for n in _reshape_nodes(graph, t, [-1, w], 1, o, sm.opset)]
            q, k, v = (o for _, o in (q, k, v))
            out = f"{sm.name}.windows_out"
            after = _reshape_nodes(graph, out, [-1], 2, pv.outputs[0], sm.opset)
        attrs = {"scale": s1 * s2 * post, "k_transposed": k_transposed,
                 "nan_guard": 1 if guard and not _finite_mask(view, mask) else 0}
        fused = Node("Attention", [q, k, v] + ([mask] if mask else []), [out], attrs,
                     name=fused_name(group), domain="kiln")
        replace(graph, group, fused)
        at = graph.nodes.index(fused)
        graph.nodes[at:at + 1] = before + [fused] + after
        view.refresh()
