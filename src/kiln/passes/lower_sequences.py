"""Sequences whose elements the build knows, as plain tensors: ConcatFromSequence -> Concat (Unsqueeze first
for new_axis), SequenceAt -> Identity of the element, SequenceLength -> a weight.

A sequence's elements are known where it is built from SequenceEmpty / SequenceConstruct / SequenceInsert /
SequenceErase at constant positions (an unrolled Loop's appends, passes/inline_control_flow.py) or by a
SplitToSequence with constant split sizes (which becomes a Split). The sequence ops themselves are left for
dead_code: those still read elsewhere (a graph output, a Loop that stayed) keep running in the interpreter
(ops/sequence.py). With no sequence left, the engine is tensors only: real kernels, one CUDA graph.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node

_BUILDERS = ("SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase", "SplitToSequence")


def run(graph: Graph) -> None:
    if not any(n.op_type in _BUILDERS and not n.domain for n in graph.nodes):
        return
    consts = graph.initializers
    known: dict[str, list[str]] = {}  # sequence value -> the names of its elements, in order
    out: list[Node] = []
    for node in graph.nodes:
        if node.domain:
            out.append(node)
            continue
        lowered = _lowered(node, known, consts)
        if lowered is None:
            out.append(node)
        else:
            out += lowered
    graph.nodes = out


def _position(consts: dict, name: str, length: int, inclusive: bool) -> int | None:
    """A constant position in range (negative from the back), or None: not constant, or out of range (the op
    itself then runs and says so)."""
    t = consts.get(name)
    if t is None or t.numel() != 1:
        return None
    p = int(t.reshape(-1)[0])
    if not -length <= p <= (length if inclusive else length - 1):
        return None
    return p + length if p < 0 else p


def _lowered(node: Node, known: dict, consts: dict) -> list[Node] | None:
    """The nodes replacing `node` (an empty list: it became a weight), or None to keep it. Records in `known`
    the elements of the sequences it builds."""
    op, ins = node.op_type, node.inputs
    seq = known.get(ins[0]) if ins else None
    if op == "SequenceEmpty":
        known[node.outputs[0]] = []
    elif op == "SequenceConstruct":
        known[node.outputs[0]] = list(ins)
    elif op == "Identity" and seq is not None:
        known[node.outputs[0]] = seq
    elif op == "SequenceInsert" and seq is not None:
        at = len(seq) if len(ins) < 3 or not ins[2] else _position(consts, ins[2], len(seq), inclusive=True)
        if at is not None:
            known[node.outputs[0]] = seq[:at] + [ins[1]] + seq[at:]
    elif op == "SequenceErase" and seq:
        at = len(seq) - 1 if len(ins) < 2 or not ins[1] else _position(consts, ins[1], len(seq), inclusive=False)
        if at is not None:
            known[node.outputs[0]] = seq[:at] + seq[at + 1:]
    elif op == "SplitToSequence":
        return _split(node, known, consts)
    elif op == "SequenceAt" and seq is not None:
        at = _position(consts, ins[1], len(seq), inclusive=False)
        if at is not None:
            return [Node("Identity", [seq[at]], list(node.outputs), name=node.name, opset=node.opset,
                         sources=[node.name])]
    elif op == "SequenceLength" and seq is not None:
        consts[node.outputs[0]] = torch.tensor(len(seq), dtype=torch.int64)
        return []
    elif op == "ConcatFromSequence" and seq:
        return _concat(node, seq, consts)
    return None


def _concat(node: Node, seq: list[str], consts: dict) -> list[Node]:
    axis = node.attr("axis")
    parts, nodes = list(seq), []
    if node.attr("new_axis", 0):  # stacked: each element gets the new axis (Unsqueeze counts axis as stack does)
        axes = f"{node.name}/axes"
        consts[axes] = torch.tensor([axis], dtype=torch.int64)
        parts = [f"{node.name}/{k}" for k in range(len(seq))]
        for src, dst in zip(seq, parts):
            ins, attrs = ([src, axes], {}) if node.opset >= 13 else ([src], {"axes": [axis]})
            nodes.append(Node("Unsqueeze", ins, [dst], attrs, name=dst, opset=node.opset, sources=[node.name]))
    nodes.append(Node("Concat", parts, list(node.outputs), {"axis": axis}, name=node.name, opset=node.opset,
                      sources=[node.name]))
    return nodes


def _split(node: Node, known: dict, consts: dict) -> list[Node] | None:
    """SplitToSequence with constant 1-D split sizes: a Split beside it, whose outputs are the elements (the
    count of pieces for a scalar or absent split depends on the input's shape, unknown here)."""
    split = consts.get(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    if split is None or split.dim() != 1:
        return None
    names = [f"{node.outputs[0]}/{k}" for k in range(split.numel())]
    axis = node.attr("axis", 0)
    if node.opset >= 13:
        split_node = Node("Split", [node.inputs[0], node.inputs[1]], names, {"axis": axis}, name=f"{node.name}/split",
                          opset=node.opset, sources=[node.name])
    else:
        split_node = Node("Split", [node.inputs[0]], names, {"axis": axis, "split": split.tolist()},
                          name=f"{node.name}/split", opset=node.opset, sources=[node.name])
    known[node.outputs[0]] = names
    return [node, split_node]  # the sequence stays for any reader that is not lowered; dead_code drops it otherwise
