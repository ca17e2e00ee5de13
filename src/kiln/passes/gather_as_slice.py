"""Gather of one constant index -> Slice (+ Squeeze): a view of the input instead of a copy.

torch's exporter writes `x[:, 0]` and `qkv[0]` (ViT's class token, nn.MultiheadAttention's
q/k/v) as Gather with a scalar constant index. Gather runs as index_select, which copies;
Slice and Squeeze are views, so the next layer reads the rows where they already are.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node

_END = 2**63 - 1


def run(graph: Graph) -> None:
    for n in [n for n in graph.nodes if n.op_type == "Gather" and not n.domain and n.opset >= 13]:
        idx = graph.initializers.get(n.inputs[1])
        if idx is None or idx.numel() != 1 or idx.dim() > 1 or idx.dtype.is_floating_point:
            continue
        i, axis = int(idx.reshape(())), n.attr("axis", 0)
        consts = {"starts": [i], "ends": [i + 1 if i != -1 else _END], "axes": [axis]}
        names = {k: f"{n.name}.{k}" for k in consts}
        for k, v in consts.items():
            graph.initializers[names[k]] = torch.tensor(v, dtype=torch.int64)
        sliced = n.outputs[0] if idx.dim() == 1 else f"{n.outputs[0]}.sliced"
        new = [Node("Slice", [n.inputs[0], names["starts"], names["ends"], names["axes"]], [sliced], {},
                    name=f"{n.name}.slice")]
        if idx.dim() == 0:  # a scalar index drops the axis
            new.append(Node("Squeeze", [sliced, names["axes"]], [n.outputs[0]], {}, name=f"{n.name}.squeeze"))
        at = graph.nodes.index(n)
        for m in new:
            m.opset, m.sources = n.opset, n.sources or [n.name]
        graph.nodes[at:at + 1] = new
