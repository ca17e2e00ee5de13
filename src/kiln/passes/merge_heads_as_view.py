"""The attention output's head merge in sequence-first models, batch-major: a view instead of a copy.

nn.MultiheadAttention (ViT) turns the attention output [B, H, S, D] back into rows with
Transpose([2, 0, 1, 3]) -> Reshape([-1, E]), projects them (a GEMM), then Reshape([S, -1, E'])
-> Transpose([1, 0, 2]) to return to [B, S, E']. The first Transpose makes the rows (s, b)-major,
which no view of the attention output gives, so it is copied. The GEMM treats rows alike, so
taking them (b, s)-major instead - Transpose([0, 2, 1, 3]), a view of what SDPA writes - and
reshaping the product to [-1, S, E'] gives the same tensor with no Transpose at the end.
Valid when H * D == E and the sequence length is S: both are read from the constant shapes
split_heads_as_view gave the attention's inputs.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph
from .rewrite import View


def _heads(view: View, value: str) -> tuple[int, int, int] | None:
    """(S, H, D) when value = Transpose(Reshape(x, [S, -1, H, D]), [1, 2, 0, 3]), the form of split_heads_as_view."""
    t = view.producer.get(value)
    r = view.producer.get(t.inputs[0]) if t is not None and t.op_type == "Transpose" and not t.domain else None
    if r is None or r.op_type != "Reshape" or r.domain or t.attr("perm") != [1, 2, 0, 3]:
        return None
    shape = view.ints(r.inputs[1])
    return ((shape[0], shape[2], shape[3])
            if shape and len(shape) == 4 and shape[1] == -1 and min(shape[0], *shape[2:]) > 0 else None)


def _next(view: View, node, op_type: str, domain: str = ""):
    n = view.sole_reader(node.outputs[0])
    return (n if n is not None and n.op_type == op_type and n.domain == domain and n.inputs[0] == node.outputs[0]
            else None)


def run(graph: Graph) -> None:
    view = View(graph)
    for attn in [n for n in graph.nodes if n.op_type == "Attention" and n.domain == "kiln"]:
        q, v = _heads(view, attn.inputs[0]), _heads(view, attn.inputs[2])
        t1 = _next(view, attn, "Transpose")
        r1 = _next(view, t1, "Reshape") if t1 is not None and t1.attr("perm") == [2, 0, 1, 3] else None
        gemm = _next(view, r1, "FusedGemm", "kiln") if r1 is not None else None
        r2 = _next(view, gemm, "Reshape") if gemm is not None else None
        t2 = _next(view, r2, "Transpose") if r2 is not None else None
        if q is None or v is None or t2 is None or t2.attr("perm") != [1, 0, 2]:
            continue
        rows, out = view.ints(r1.inputs[1]), view.ints(r2.inputs[1])
        seq, heads, dim = q[0], v[1], v[2]
        if rows != [-1, heads * dim] or not out or len(out) != 3 or out[0] != seq or out[1] != -1 or out[2] <= 0:
            continue
        t1.attrs["perm"] = [0, 2, 1, 3]
        shape = f"{r2.name}.batch_major"
        graph.initializers[shape] = torch.tensor([-1, seq, out[2]], dtype=torch.int64)
        r2.inputs = [r2.inputs[0], shape]
        r2.outputs = list(t2.outputs)
        r2.sources = (r2.sources or [r2.name]) + (t2.sources or [t2.name])
        graph.nodes.remove(t2)
        view.refresh()
