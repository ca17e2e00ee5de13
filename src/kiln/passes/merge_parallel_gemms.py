"""Parallel GEMMs reading one input (attention's Q, K, V) -> one wider GEMM + Split.

One launch that reads the activation once instead of three.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name


def run(graph: Graph) -> None:
    view = View(graph)
    groups: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        if n.op_type == "FusedGemm" and n.domain == "kiln":
            w = view.const(n.inputs[1])
            key = (n.inputs[0], n.attr("activation", ""), tuple(n.attr("activation_params", [])),
                   bool(n.inputs[2]), w.shape[0], w.dtype)
            groups.setdefault(key, []).append(n)
    for (x, act, params, has_bias, _, _), gemms in groups.items():
        if len(gemms) < 2:
            continue
        ws = [view.const(g.inputs[1]) for g in gemms]
        name = fused_name(gemms)
        w_name = f"merged_weight:{gemms[0].name}"
        graph.initializers[w_name] = torch.cat(ws, dim=1)
        inputs = [x, w_name, ""]
        if has_bias:
            b_name = f"merged_bias:{gemms[0].name}"
            graph.initializers[b_name] = torch.cat([view.const(g.inputs[2]).reshape(-1) for g in gemms])
            inputs[2] = b_name
        wide = f"{gemms[0].outputs[0]}.merged"
        merged = Node("FusedGemm", inputs, [wide], {"activation": act, "activation_params": list(params)},
                      name=name, domain="kiln")
        split_sizes = f"split_sizes:{gemms[0].name}"
        graph.initializers[split_sizes] = torch.tensor([w.shape[1] for w in ws], dtype=torch.int64)
        split = Node("Split", [wide, split_sizes], [g.outputs[0] for g in gemms], {"axis": -1},
                     name=f"split({name})")
        # At the first GEMM's place: later layers may read the first GEMM's output before the last GEMM ran.
        at = min(graph.nodes.index(g) for g in gemms)
        merged.sources = [s for g in gemms for s in (g.sources or [g.name])]
        merged.opset = gemms[0].opset
        split.opset = max(13, merged.opset)
        split.sources = [name]
        ids = {id(g) for g in gemms}
        graph.nodes = [n for n in graph.nodes[:at] if id(n) not in ids] + [merged, split] + \
            [n for n in graph.nodes[at:] if id(n) not in ids]
        view.refresh()
