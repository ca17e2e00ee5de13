"""INT4 weight-only layers: MatMul(x, DequantizeLinear(int4 weights, group scales)) -> kiln::Int4Gemm.

The weights stay packed two per byte in the engine (a quarter of FP16's bytes,
which is what memory-bound GEMMs at small batch pay for) and are dequantized
inside the GEMM (kernels/int4_gemm.py); activations stay in float.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from ..ops.int4 import pack as pack_int4
from .rewrite import View, fused_name, replace


def _int4_weight(view: View, value: str):
    """DQ(int4 constant [K, N], scales [K/g, N] blocked along K, zero point 0 or absent)."""
    dq = view.producer.get(value)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain or view.readers(value) != 1:
        return None
    w, s = view.const(dq.inputs[0]), view.const(dq.inputs[1])
    block = dq.attr("block_size", 0)
    if w is None or s is None or w.dim() != 2 or w.dtype not in (torch.int8, torch.int16) or not block:
        return None
    if block % 2 or dq.attr("axis", 1) % 2 != 0 or int(w.min()) < -8 or int(w.max()) > 7:
        return None
    zp = view.const(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] else None
    if (len(dq.inputs) > 2 and dq.inputs[2] and zp is None) or (zp is not None and zp.any()):
        return None
    if tuple(s.shape) != (-(-w.shape[0] // block), w.shape[1]):
        return None
    return dq, w, s, block


def run(graph: Graph) -> None:
    view = View(graph)
    for mm in [n for n in graph.nodes if n.op_type == "MatMul" and not n.domain]:
        found = _int4_weight(view, mm.inputs[1])
        if found is None:
            continue
        dq, w, scales, block = found
        group, out, bias = [dq, mm], mm.outputs[0], ""
        add = view.sole_reader(out)
        other = view.other_input(add, out) if add is not None and add.op_type == "Add" else None
        b = view.const(other) if other else None
        if b is not None and b.numel() == w.shape[1]:
            bias, out = other, add.outputs[0]
            group.append(add)
        name = fused_name([mm])
        graph.initializers[f"{name}.weight_int4"] = pack_int4((w.to(torch.int16) + 8))  # signed -> codes 0..15
        graph.initializers[f"{name}.weight_scales"] = scales.float()
        fused = Node("Int4Gemm", [mm.inputs[0], f"{name}.weight_int4", f"{name}.weight_scales", bias], [out],
                     {"group_size": block}, name=fused_name(group), domain="kiln")
        replace(graph, group, fused)
        view.refresh()
