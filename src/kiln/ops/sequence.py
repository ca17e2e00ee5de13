"""Sequence operators: SequenceEmpty, SequenceConstruct, SequenceInsert, SequenceAt, SequenceErase,
SequenceLength, ConcatFromSequence, SplitToSequence, SequenceMap.

A sequence value (ONNX sequence(tensor(T))) is a Python list of tensors at run time; every op returns a
new list, never changing its input's. Positions and split sizes are read on the host. Where the build can
tell a sequence's length (a constant-trip Loop that was unrolled, a chain of inserts), passes/lower_sequences.py
turns these ops into plain tensor ops (Concat, Split, Identity) so the engine runs real kernels and stays one
CUDA graph; what is left runs here, eagerly.
"""

from __future__ import annotations

import torch

from ..errors import KilnError
from ..ir.graph import Graph, Node
from .registry import register


def _elements(node: Node, seq) -> list[torch.Tensor]:
    """The sequence's tensors on the node's device (a sequence built on the host holds host tensors)."""
    if not isinstance(seq, list):
        raise KilnError(f"node '{node.label}' ({node.op_type}) expects a sequence as input 0, "
                        f"got {type(seq).__name__}.")
    return [t.to(node.device) for t in seq]


def _position(node: Node, pos, length: int, inclusive: bool) -> int:
    """ONNX's position: negative counts from the back; valid in [-n, n-1], or [-n, n] where inclusive (insert)."""
    p = int(pos.reshape(-1)[0])
    hi = length if inclusive else length - 1
    if not -length <= p <= hi:
        raise KilnError(f"node '{node.label}' ({node.op_type}): position {p} is outside [{-length}, {hi}] "
                        f"for a sequence of {length} tensor(s).")
    return p + length if p < 0 else p


@register("SequenceEmpty", since=11)
def sequence_empty(node):
    return ([],)


@register("SequenceConstruct", since=11)
def sequence_construct(node, *tensors):
    return ([t.to(node.device) for t in tensors],)


@register("SequenceInsert", since=11, host_inputs=(2,))
def sequence_insert(node, seq, tensor, position=None):
    out = _elements(node, seq)
    at = len(out) if position is None else _position(node, position, len(out), inclusive=True)
    out.insert(at, tensor.to(node.device))
    return (out,)


@register("SequenceAt", since=11, host_inputs=(1,))
def sequence_at(node, seq, position):
    items = _elements(node, seq)
    return items[_position(node, position, len(items), inclusive=False)]


@register("SequenceErase", since=11, host_inputs=(1,))
def sequence_erase(node, seq, position=None):
    out = _elements(node, seq)
    if not out:
        raise KilnError(f"node '{node.label}' (SequenceErase): the sequence is empty; there is nothing to erase.")
    del out[-1 if position is None else _position(node, position, len(out), inclusive=False)]
    return (out,)


@register("SequenceLength", since=11)
def sequence_length(node, seq):
    if not isinstance(seq, list):
        raise KilnError(f"node '{node.label}' (SequenceLength) expects a sequence, got {type(seq).__name__}.")
    return torch.tensor(len(seq), dtype=torch.int64, device=node.device)


@register("ConcatFromSequence", since=11)
def concat_from_sequence(node, seq):
    items = _elements(node, seq)
    if not items:
        raise KilnError(f"node '{node.label}' (ConcatFromSequence): the sequence is empty; "
                        "ONNX defines no result for that.")
    axis = node.attr("axis")
    if node.attr("new_axis", 0):
        return torch.stack(items, axis)  # axis in [-r-1, r], as torch.stack takes it
    return torch.cat(items, axis)


@register("SplitToSequence", since=11, host_inputs=(1,))
def split_to_sequence(node, x, split=None):
    axis = node.attr("axis", 0)
    if split is None:  # pieces of length 1, the split axis dropped unless keepdims
        pieces = list(torch.split(x, 1, axis))
        if not node.attr("keepdims", 1):
            pieces = [p.squeeze(axis) for p in pieces]
        return (pieces,)
    sizes = split.reshape(-1).tolist() if split.dim() else int(split)  # a scalar: equal pieces, the last shorter
    return (list(torch.split(x, sizes, axis)),)


@register("SequenceMap", since=17, uses_scope=True, data_dependent=True)
def sequence_map(node, first, *extra, scope, run_subgraph):
    """The body once per element of the sequence inputs (all of one length); tensor inputs go to every call."""
    body: Graph = node.attr("body")
    inputs = [first, *extra]
    n = len(first)
    if any(isinstance(x, list) and len(x) != n for x in inputs):
        raise KilnError(f"node '{node.label}' (SequenceMap): its sequence inputs differ in length "
                        f"({[len(x) for x in inputs if isinstance(x, list)]}).")
    names = [v.name for v in body.inputs]
    outs: list[list] = [[] for _ in body.outputs]
    for i in range(n):
        feeds = [x[i].to(node.device) if isinstance(x, list) else x for x in inputs]
        for acc, y in zip(outs, run_subgraph(body, dict(zip(names, feeds)), scope)):
            acc.append(y.to(node.device))
    return tuple(outs)
