"""Reductions over consecutive equal slices, concatenated, as one reduction: Concat(axis 0) of
ReduceSum(Slice(x, s_k, s_k + L), axes=[0], keepdims=1) for k < n with s_(k+1) = s_k + L becomes
Slice(x, s_0, s_0 + n*L) -> Reshape [n, L, ...] -> ReduceSum(axes=[1], keepdims=0). Also for ReduceMean,
ReduceMax and ReduceMin.

That is an embedding bag of fixed-size bags once torch.onnx's loop over the bags is unrolled
(passes/inline_control_flow.py, passes/lower_sequences.py): one Slice and one reduction per bag, thousands of
tiny kernels at a large batch, become one reshaped reduction. The new shape [n, L] + x's trailing dims is
shape arithmetic (Shape, Concat) that runs on the host. The slices' bounds are constants the exporter derived
from x's shape; were x shorter than s_0 + n*L (a clamped slice), the Reshape would refuse the run with an
error rather than return other numbers.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node

_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin")


def _const_ints(consts: dict, name: str) -> list[int] | None:
    t = consts.get(name) if name else None
    return None if t is None or t.dtype not in (torch.int32, torch.int64) else t.reshape(-1).tolist()


def _reduced_axes(node: Node, consts: dict) -> list[int] | None:
    if len(node.inputs) > 1 and node.inputs[1]:
        return _const_ints(consts, node.inputs[1])
    return node.attr("axes")


def _segment(node: Node | None, producers: dict, consts: dict, op: str) -> tuple[str, int, int] | None:
    """(x, start, end) when `node` is `op`(Slice(x, [start], [end]) along axis 0, axes=[0], keepdims=1), else None."""
    if node is None or node.op_type != op or node.domain or node.attr("keepdims", 1) != 1:
        return None
    if _reduced_axes(node, consts) != [0]:
        return None
    s = producers.get(node.inputs[0])
    if s is None or s.op_type != "Slice" or s.domain or s.opset < 10 or len(s.inputs) < 3:
        return None
    ins = s.inputs + [""] * (5 - len(s.inputs))
    starts, ends = _const_ints(consts, ins[1]), _const_ints(consts, ins[2])
    axes = _const_ints(consts, ins[3]) if ins[3] else [0]
    steps = _const_ints(consts, ins[4]) if ins[4] else [1]
    if not (starts and ends and len(starts) == len(ends) == 1 and axes == [0] and steps == [1]):
        return None
    return ins[0], starts[0], ends[0]


def run(graph: Graph) -> None:
    producers = graph.producers()
    consts = graph.initializers
    out: list[Node] = []
    for node in graph.nodes:
        fused = _fused(node, producers, consts) if node.op_type == "Concat" and not node.domain else None
        out += fused if fused is not None else [node]
    graph.nodes = out


def _fused(concat: Node, producers: dict, consts: dict) -> list[Node] | None:
    if concat.attr("axis") != 0 or len(concat.inputs) < 2:
        return None
    first = producers.get(concat.inputs[0])
    op = first.op_type if first is not None else None
    if op not in _REDUCTIONS:
        return None
    segments = [_segment(producers.get(i), producers, consts, op) for i in concat.inputs]
    if any(s is None for s in segments) or len({x for x, _, _ in segments}) != 1:
        return None
    x, start, _ = segments[0]
    length = segments[0][2] - start
    if start < 0 or length <= 0 or any(s != start + k * length or e != s + length
                                       for k, (_, s, e) in enumerate(segments)):
        return None
    n, opset, base = len(segments), concat.opset, concat.name

    def const(suffix: str, values: list[int]) -> str:
        consts[f"{base}/{suffix}"] = torch.tensor(values, dtype=torch.int64)
        return f"{base}/{suffix}"

    def make(op_type, ins, suffix, attrs=None):
        return Node(op_type, ins, [f"{base}/{suffix}"], attrs or {}, name=f"{base}/{suffix}", opset=opset,
                    sources=[concat.name])

    nodes = [make("Slice", [x, const("start", [start]), const("end", [start + n * length]), const("axis0", [0])],
                  "rows")]
    if opset >= 15:
        nodes.append(make("Shape", [x], "trailing", {"start": 1}))
    else:
        nodes += [make("Shape", [x], "shape"),
                  make("Slice", [f"{base}/shape", const("one", [1]), const("last", [2**62])], "trailing")]
    nodes += [make("Concat", [const("bags", [n, length]), f"{base}/trailing"], "grouped_shape", {"axis": 0}),
              make("Reshape", [f"{base}/rows", f"{base}/grouped_shape"], "grouped")]
    reduce_axes_as_input = opset >= (13 if op == "ReduceSum" else 18)
    ins = [f"{base}/grouped", const("axis1", [1])] if reduce_axes_as_input else [f"{base}/grouped"]
    attrs = {"keepdims": 0} if reduce_axes_as_input else {"keepdims": 0, "axes": [1]}
    nodes.append(Node(op, ins, list(concat.outputs), attrs, name=base, opset=opset, sources=[concat.name]))
    return nodes
