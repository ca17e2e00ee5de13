"""BatchNormalization folded into the Conv (or Gemm) before it: one layer, same numbers."""

from __future__ import annotations

import torch

from ..ir.graph import Graph
from .rewrite import View, miss


def _bn_affine(view: View, bn):
    """Inference BatchNorm as y = x * scale + shift (per channel), or None if not constant."""
    params = [view.const(i) for i in bn.inputs[1:5]]
    if any(p is None for p in params) or len([o for o in bn.outputs if o]) != 1 or bn.attr("training_mode", 0):
        return None
    gamma, beta, mean, var = (p.double() for p in params)
    scale = gamma / torch.sqrt(var + bn.attr("epsilon", 1e-5))
    return scale, beta - mean * scale


def run(graph: Graph) -> None:
    view = View(graph)
    for bn in [n for n in graph.nodes if n.op_type == "BatchNormalization" and n.domain == ""]:
        prod = view.producer.get(bn.inputs[0])
        if prod is None or prod.op_type not in ("Conv", "Gemm") or prod.domain:
            continue
        if view.sole_reader(prod.outputs[0]) is not bn:
            miss(graph, "BatchNorm folding", [prod, bn],
                 f"{prod.op_type} output has {view.readers(prod.outputs[0])} readers")
            continue
        affine = _bn_affine(view, bn)
        w = view.const(prod.inputs[1])
        plain_gemm = prod.attr("transA", 0) == 0 and prod.attr("alpha", 1.0) == prod.attr("beta", 1.0) == 1.0
        if affine is None or w is None or (prod.op_type == "Gemm" and (not plain_gemm or w.dim() != 2)):
            miss(graph, "BatchNorm folding", [prod, bn], "weights or BatchNorm statistics are not constants")
            continue
        scale, shift = affine
        if prod.op_type == "Conv":
            new_w = w.double() * scale.reshape(-1, *([1] * (w.dim() - 1)))
        else:  # Gemm: output channels are w's columns (or rows with transB)
            new_w = w.double() * (scale.reshape(-1, 1) if prod.attr("transB", 0) else scale.reshape(1, -1))
        b_name = prod.inputs[2] if len(prod.inputs) > 2 and prod.inputs[2] else None
        b = view.const(b_name) if b_name else torch.zeros(len(scale), dtype=torch.float64)
        if b is None or (prod.op_type == "Gemm" and b.numel() != len(scale)):
            miss(graph, "BatchNorm folding", [prod, bn], "bias is not a per-channel constant")
            continue
        new_b = b.double().reshape(-1) * scale + shift
        # Fresh weight names: the originals may be shared with other layers.
        wn, bname = f"{prod.name}.folded_weight", f"{prod.name}.folded_bias"
        graph.initializers[wn] = new_w.to(w.dtype)
        graph.initializers[bname] = new_b.to(w.dtype)
        prod.inputs = [prod.inputs[0], wn, bname]
        prod.outputs = [bn.outputs[0]]
        prod.sources = (prod.sources or [prod.name]) + [bn.name]
        graph.nodes.remove(bn)
        view.refresh()
