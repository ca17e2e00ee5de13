"""The attention output's head merge in sequence-first models, batch-major: a view instead of a copy.

nn.MultiheadAttention (ViT) turns the attention output [B, H, S, D] back into rows with
Transpose([2, 0, 1, 3]) -> Reshape([-1, E]), projects them (a GEMM), then Reshape([S, -1, E'])
-> Transpose([1, 0, 2]) to return to [B, S, E']. The first Transpose makes the rows (s, b)-major,
which no view of the attention output gives, so it is copied. The GEMM treats rows alike, so
taking them (b, s)-major instead - Transpose([0, 2, 1, 3]), a view of what SDPA writes - and
reshaping the product to [-1, S, E'] gives the same tensor with no Transpose at the end.
Valid when H * D == E and the sequence length is S: both are read from the constant shapes
split_heads_as_view gave the attention's inputs.

Batch-first models (GPT-2) need no rewrite of the output: the flash kernel writes its output laid out like q,
heads interleaved when q is a view of one QKV projection, so Transpose + Reshape after it is a view already. Their
keys are the copy: the exporter transposes k as Reshape([-1, S, D]) -> Transpose([0, 2, 1]) -> Reshape([B, H, D,
S]), and merging batch and heads of a strided view of the projection copies it once per layer. That chain is
Transpose([0, 1, 3, 2]) of k, a view, when k's shape is known to be [B, H, S, D]: k = Transpose(Reshape(x, [B, S,
H, D]), [0, 2, 1, 3]) with B, S, D constants (H is then fixed by the element count).
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
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


def _keys_chain(view: View, value: str):
    """(r1, t, r2, k) when value = Reshape(Transpose(Reshape(k, [-1, S, D]), [0, 2, 1]), [B, H, D, S]) and
    k = Transpose(Reshape(x, [B, S, H|-1, D]), [0, 2, 1, 3]), so the chain is k transposed, else None."""
    def made_by(v, op_type):
        n = view.producer.get(v)
        return n if n is not None and n.op_type == op_type and not n.domain else None

    r2 = made_by(value, "Reshape")
    t = made_by(r2.inputs[0], "Transpose") if r2 is not None else None
    r1 = made_by(t.inputs[0], "Reshape") if t is not None and t.attr("perm") == [0, 2, 1] else None
    p = made_by(r1.inputs[0], "Transpose") if r1 is not None else None
    r0 = made_by(p.inputs[0], "Reshape") if p is not None and p.attr("perm") == [0, 2, 1, 3] else None
    if r0 is None or view.readers(r1.outputs[0]) != 1 or view.readers(t.outputs[0]) != 1:
        return None
    split, first, final = view.ints(r0.inputs[1]), view.ints(r1.inputs[1]), view.ints(r2.inputs[1])
    if not (split and first and final and len(split) == 4 and len(first) == 3 and len(final) == 4):
        return None
    b, s, h, d = split
    if min(b, s, d, *final) <= 0 or h not in (-1, final[1]) or final != [b, final[1], d, s]:
        return None
    if first[1:] != [s, d] or first[0] not in (-1, b * final[1]):
        return None
    return r1, t, r2, r1.inputs[0]


def _transpose_keys_in_place(graph: Graph, view: View) -> None:
    for attn in [n for n in graph.nodes if n.op_type == "Attention" and n.domain == "kiln"]:
        chain = _keys_chain(view, attn.inputs[1]) if attn.attr("k_transposed", 0) else None
        if chain is None:
            continue
        r1, t, r2, k = chain
        keys = Node("Transpose", [k], list(r2.outputs), {"perm": [0, 1, 3, 2]}, name=f"{r2.name}.keys_transposed")
        keys.opset, keys.sources = r2.opset, [src for n in (r1, t, r2) for src in (n.sources or [n.name])]
        graph.nodes[graph.nodes.index(r2)] = keys
        graph.nodes.remove(t)
        graph.nodes.remove(r1)
        view.refresh()


def run(graph: Graph) -> None:
    view = View(graph)
    _transpose_keys_in_place(graph, view)
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
