"""FusedGemm (no activation) + SkipLayerNorm -> kiln::GemmSkipLayerNorm: a GEMM that only feeds a
residual LayerNorm joins it, so one of the layer's tactics can split the GEMM's K across thread blocks
and let the norm kernel sum the partial products. At BERT's batch 1 (M = 128) cuBLAS splits K too, but
its reduction is a kernel of its own (2.3 us, twelve times per model)."""

from __future__ import annotations

from ..ir.graph import Graph, Node
from .rewrite import View, fused_name, replace


def run(graph: Graph) -> None:
    view = View(graph)
    for ln in [n for n in graph.nodes if n.op_type == "SkipLayerNorm" and n.domain == "kiln"]:
        if any(ln.inputs[4:]):
            continue  # writes 8-bit rows for quantized readers, or adds a third input
        for pos in (0, 1):
            gemm = view.producer.get(ln.inputs[pos])
            if (gemm is not None and gemm.op_type == "FusedGemm" and gemm.domain == "kiln"
                    and not gemm.attr("activation", "") and view.sole_reader(gemm.outputs[0]) is ln):
                break
        else:
            continue
        x, w = gemm.inputs[0], gemm.inputs[1]
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else ""
        beta = ln.inputs[3] if len(ln.inputs) > 3 else ""
        fused = Node("GemmSkipLayerNorm", [x, w, bias, ln.inputs[1 - pos], ln.inputs[2], beta], list(ln.outputs),
                     dict(ln.attrs), name=fused_name([gemm, ln]), domain="kiln")
        replace(graph, [gemm, ln], fused)
        view.refresh()
