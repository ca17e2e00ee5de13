"""Rolls and window partitions that move whole rows of the last axis -> one row gather.

Swin's shifted windows are written as torch.roll (exported as Slice, Slice, Concat per axis), a zero Pad, and the
window partition Reshape -> Transpose -> Reshape; its window merge and the roll back are the same in reverse. Each
of those steps is a copy of the activation: up to five kernels. None of them touches the last axis (the
channels): they only move rows of it. So the chain is one Gather of rows, y = x.reshape(-1, C)[index], whose index
is the same chain applied to the row numbers arange(rows).reshape(x.shape[:-1] + [1]). That index is shape
arithmetic (Shape, Range and the chain's own ops on it): the engine computes it on the host once per input shape
and the device runs one gather kernel (kernels/gather_rows.py).

A Pad of all-zero pads (Swin pads to whole windows; at sizes that are whole windows already it pads nothing, yet
fills and copies the tensor) is dropped first.

Matched: a connected set of Slice, Concat, Reshape and Transpose nodes whose values are read only
inside it, with one input x and one output, that copies (a Concat, or a Transpose that moves axes of more than one
element before a Reshape) and provably keeps the last axis: x's rank and last size C are known from its producers
(a Reshape to a constant shape, a MatMul, Gemm or Conv on a constant weight, a Transpose, a LayerNormalization,
elementwise ops of those), every Reshape but the last ends in C, every Transpose keeps the last axis last, and no
Slice or Concat works on it. The last Reshape may merge rows (Swin's patch merging: 2 x 2 rows of C -> one of 4C):
the gathered rows are contiguous, so any shape of their size is a view of them. A chain of views only (a Slice, a
lone Transpose an attention reads strided) is left alone.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from .rewrite import View, bypass, replace

_LAYOUT = ("Slice", "Concat", "Reshape", "Transpose", "Pad")
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Gelu", "Cast", "Identity", "Neg",
                "Sqrt", "Softmax", "LayerNormalization"}


def _shape(view: View, value: str, depth: int = 0) -> list | None:
    """value's shape as far as its producers make it plain (None for a size not known here), or None when not even
    its rank is."""
    if depth > 24:
        return None
    for v in view.graph.inputs:
        if v.name == value:
            return [d if isinstance(d, int) else None for d in v.shape] if v.shape is not None else None
    c = view.const(value)
    if c is not None:
        return list(c.shape)
    n = view.producer.get(value)
    if n is None or n.domain:
        return None
    if n.op_type == "Reshape":
        t = view.ints(n.inputs[1])
        return [d if d > 0 else None for d in t] if t is not None and 0 not in t else None
    if n.op_type == "Transpose":
        x = _shape(view, n.inputs[0], depth + 1)
        perm = n.attr("perm")
        return [x[p] for p in perm] if x is not None and perm is not None and sorted(perm) == list(range(len(x))) \
            else None
    if n.op_type in ("MatMul", "Gemm", "Conv"):
        w = view.const(n.inputs[1])
        if w is None or w.dim() < 2:
            return None
        if n.op_type == "Conv":
            return [None, w.shape[0]] + [None] * (w.dim() - 2)
        if n.op_type == "Gemm":
            return [None, w.shape[0] if n.attr("transB", 0) else w.shape[1]]
        a = _shape(view, n.inputs[0], depth + 1)
        return a[:-1] + [w.shape[-1]] if a is not None and w.dim() == 2 and len(a) >= 2 else None
    if n.op_type in _ELEMENTWISE:
        if n.op_type in ("LayerNormalization", "Softmax") or len(n.inputs) == 1:
            return _shape(view, n.inputs[0], depth + 1)
        known = [_shape(view, i, depth + 1) for i in n.inputs[:2]]
        if any(k is None for k in known):
            return None
        rank = max(len(k) for k in known)
        padded = [[1] * (rank - len(k)) + k for k in known]
        out = []
        for a, b in zip(*padded):  # broadcast: a size over 1 wins; 1 and unknown are unknown
            sizes = {d for d in (a, b) if d not in (None, 1)}
            if len(sizes) > 1:
                return None
            out.append(sizes.pop() if sizes else 1 if a == b == 1 else None)
        return out
    return None


def _zero_pad(view: View, n: Node) -> bool:
    pads = view.ints(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] else n.attr("pads")
    return (n.attr("mode", "constant") in ("constant", b"constant") and pads is not None and not any(pads)
            and (len(n.inputs) < 4 or not n.inputs[3]))


def _layout(view: View, n: Node) -> bool:
    """A layout node whose parameters are constants."""
    if n.domain or n.op_type not in _LAYOUT or not n.outputs or n.opset < 13:
        return False
    if n.op_type == "Slice":
        return all(view.ints(i) is not None for i in n.inputs[1:] if i) and len(n.inputs) >= 3
    if n.op_type == "Reshape":
        return view.ints(n.inputs[1]) is not None
    if n.op_type == "Transpose":
        return n.attr("perm") is not None
    if n.op_type == "Pad":
        return _zero_pad(view, n)
    return True  # Concat


def _data_inputs(n: Node) -> list[str]:
    return list(n.inputs) if n.op_type == "Concat" else [n.inputs[0]]


def _region(view: View, sink: Node) -> list[Node] | None:
    """The layout nodes feeding sink whose values nothing outside reads, in graph order."""
    region, grown = {id(sink): sink}, True
    while grown:
        grown = False
        for n in list(region.values()):
            for value in _data_inputs(n):
                p = view.producer.get(value)
                if p is None or id(p) in region or not _layout(view, p) or value in view.outputs:
                    continue
                if all(id(r) in region for r in view.consumers.get(value, [])) and len(p.outputs) == 1:
                    region[id(p)] = p
                    grown = True
    return [n for n in view.graph.nodes if id(n) in region]


def _keeps_rows(view: View, region: list[Node], x: str):
    """Whether the region moves whole rows of x's last axis, and copies: (C, True) / (C, False), else None."""
    shape = _shape(view, x)
    if not shape or shape[-1] is None:
        return None
    last = shape[-1]
    shapes = {x: shape}  # sizes where known
    copies = False
    for n in region:
        shape = shapes.get(n.inputs[0])
        if shape is None:
            return None
        r = len(shape)
        if n.op_type == "Reshape":
            t = view.ints(n.inputs[1])
            if 0 in t and not n.attr("allowzero", 0):
                return None
            if n is region[-1]:  # the gathered rows, contiguous, take any shape of their size: a view
                break
            if t[-1] != last:
                return None
            shapes[n.outputs[0]] = [s if s > 0 else None for s in t]
        elif n.op_type == "Transpose":
            perm = n.attr("perm")
            if sorted(perm) != list(range(r)) or perm[-1] != r - 1:
                return None
            moved = [p for p in perm if shape[p] != 1]
            copies |= moved != sorted(moved)
            shapes[n.outputs[0]] = [shape[p] for p in perm]
        elif n.op_type == "Slice":
            axes = view.ints(n.inputs[3]) if len(n.inputs) > 3 and n.inputs[3] else list(range(len(
                view.ints(n.inputs[1]))))
            axes = [a + r if a < 0 else a for a in axes]
            if any(a >= r - 1 or a < 0 for a in axes):
                return None
            shapes[n.outputs[0]] = [None if i in axes else s for i, s in enumerate(shape)]
        elif n.op_type == "Concat":
            axis = n.attr("axis")
            axis = axis + r if axis < 0 else axis
            if not 0 <= axis < r - 1 or any(len(shapes.get(i, ())) != r for i in n.inputs):
                return None
            copies = True
            shapes[n.outputs[0]] = [None if i == axis else s for i, s in enumerate(shape)]
        else:  # a zero Pad
            shapes[n.outputs[0]] = shape
    return last, copies


def _ints(graph: Graph, name: str, values) -> str:
    graph.initializers[name] = torch.tensor(values, dtype=torch.int64)
    return name


def _rewrite(graph: Graph, view: View, region: list[Node], x: str, last: int) -> None:
    sink = region[-1]
    base, opset = f"{sink.name}.rows", sink.opset
    c = lambda suffix, values: _ints(graph, f"{base}.{suffix}", values)
    nodes: list[Node] = []

    def add(op, inputs, suffix, **attrs):
        out = f"{base}.{suffix}"
        nodes.append(Node(op, inputs, [out], attrs, name=out, opset=opset))
        return out

    # Row numbers shaped like x with its last axis 1, through the same chain (shape arithmetic, on the host)
    lead = add("Slice", [add("Shape", [x], "shape"), c("zero", [0]), c("minus_one", [-1])], "lead")
    rows = add("Div", [add("Size", [x], "size"), _ints(graph, f"{base}.c", last)], "count")
    numbers = add("Reshape", [add("Range", [_ints(graph, f"{base}.start", 0), rows, _ints(graph, f"{base}.step", 1)],
                                  "range"), add("Concat", [lead, c("one", [1])], "row_shape", axis=0)], "numbers")
    renamed = {x: numbers}
    final = region[-1] if region[-1].op_type == "Reshape" else None  # its shape is kept as it is, on the rows
    for i, n in enumerate(region[:-1] if final else region):
        ins = [renamed.get(v, v) for v in n.inputs]
        if n.op_type == "Pad":
            renamed[n.outputs[0]] = ins[0]
            continue
        if n.op_type == "Reshape":
            ins[1] = c(f"shape{i}", view.ints(n.inputs[1])[:-1] + [1])
        out = f"{base}.{i}"
        nodes.append(Node(n.op_type, ins, [out], dict(n.attrs), name=out, opset=n.opset))
        renamed[n.outputs[0]] = out
    moved = renamed[final.inputs[0] if final else sink.outputs[0]]
    index = add("Reshape", [moved, c("flat", [-1])], "index")
    if final:
        out_shape = final.inputs[1]
    else:
        out_shape = add("Concat", [add("Slice", [add("Shape", [moved], "moved_shape"), c("zero", [0]),
                                                 c("minus_one", [-1])], "moved_lead"), c("width", [last])],
                        "out_shape", axis=0)
    table = add("Reshape", [x, c("table_shape", [-1, last])], "table")
    gathered = f"{base}.gathered"
    gather = Node("Gather", [table, index], [gathered], {"axis": 0}, name=f"{base}.gather")
    replace(graph, region, gather)
    at = graph.nodes.index(gather)
    graph.nodes[at:at + 1] = nodes + [gather, Node("Reshape", [gathered, out_shape], [sink.outputs[0]],
                                                    dict(final.attrs) if final else {}, name=f"{base}.reshape",
                                                    opset=opset)]
    view.refresh()


def run(graph: Graph) -> None:
    view = View(graph)
    for pad in [n for n in graph.nodes if n.op_type == "Pad" and _layout(view, n)]:
        bypass(graph, view, pad, pad.inputs[0])  # pads nothing, yet fills and copies the tensor
    found = []  # all found before any is rewritten: a rewritten chain's output shape is no constant any more
    for sink in [n for n in graph.nodes if n.op_type in ("Concat", "Reshape", "Pad")]:
        if not _layout(view, sink):
            continue
        readers = view.consumers.get(sink.outputs[0], [])
        if sink.outputs[0] not in view.outputs and readers and all(_layout(view, r) for r in readers):
            continue  # not the chain's end
        region = _region(view, sink)
        inputs = {v for n in region for v in _data_inputs(n)} - {n.outputs[0] for n in region}
        if len(inputs) != 1:
            continue
        x = inputs.pop()
        kept = _keeps_rows(view, region, x)
        if kept is not None and kept[1]:
            found.append((region, x, kept[0]))
    for region, x, last in found:
        _rewrite(graph, view, region, x, last)
