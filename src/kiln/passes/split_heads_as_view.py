"""Sequence-first head split as a view.

Reshape([S, -1, D]) -> Transpose([1, 0, 2]) -> Reshape([-1, H, S, D]) becomes
Reshape([S, -1, H, D]) -> Transpose([1, 2, 0, 3]).

nn.MultiheadAttention (ViT) splits heads of a sequence-first [S, B, E] tensor by merging
batch and heads into one axis and splitting them again. When the input is a strided view
(q, k, v sliced out of one QKV GEMM) the merge cannot be a view, so each of q, k, v is
copied. Both forms read the same elements: the middle axes are flattened row-major and
cut into (index // H, index % H) either way, S and D untouched. The new form splits the
embedding axis instead of merging, which a view can always do.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from .rewrite import View


def run(graph: Graph) -> None:
    view = View(graph)
    for r2 in [n for n in graph.nodes if n.op_type == "Reshape" and not n.domain]:
        t = view.producer.get(r2.inputs[0])
        r1 = view.producer.get(t.inputs[0]) if t is not None and t.op_type == "Transpose" and not t.domain else None
        if r1 is None or r1.op_type != "Reshape" or r1.domain or t.attr("perm") != [1, 0, 2]:
            continue
        first, second = view.ints(r1.inputs[1]), view.ints(r2.inputs[1])
        if first is None or second is None or len(first) != 3 or len(second) != 4:
            continue
        s, d, h = first[0], first[2], second[1]
        if min(s, d, h) <= 0 or second[2:] != [s, d] or second[0] == 0 or first[1] == 0:
            continue
        if view.readers(r1.outputs[0]) != 1 or view.readers(t.outputs[0]) != 1:
            continue
        shape = f"{r2.name}.split_heads"
        graph.initializers[shape] = torch.tensor([s, -1, h, d], dtype=torch.int64)
        split = Node("Reshape", [r1.inputs[0], shape], [f"{r2.outputs[0]}.split"], {}, name=f"{r2.name}.split")
        heads = Node("Transpose", [split.outputs[0]], [r2.outputs[0]], {"perm": [1, 2, 0, 3]}, name=f"{r2.name}.heads")
        for m in (split, heads):
            m.opset, m.sources = r2.opset, [src for n in (r1, t, r2) for src in (n.sources or [n.name])]
        at = graph.nodes.index(r2)
        graph.nodes[at:at + 1] = [split, heads]
        graph.nodes.remove(t)
        graph.nodes.remove(r1)
        view.refresh()
