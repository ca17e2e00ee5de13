"""A wide GEMM whose output width is not a multiple of 8 (GPT-2's 50257-word LM head) -> the same GEMM on
weights padded with zero columns to a multiple of 8, then a Slice back to the true width (a view).

cuBLAS and TMA kernels need 16-byte aligned rows: an FP16 output or weight row of 50257 elements is not, and
cuBLAS falls back to kernels several times slower. The padded columns are zeros, so the kept columns are the
same numbers; the Slice is a view, so nothing is copied unless a reader needs a contiguous input.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from .rewrite import View

ALIGN = 8  # elements: 16 bytes at FP16/BF16
MIN_COLUMNS = 256  # narrower outputs are cheap however they are aligned


def _padded(view: View, node: Node):
    """(weight, bias input index or None) of a float GEMM with constant [K, N] weights worth padding."""
    if node.op_type == "MatMul" and not node.domain:
        bias_at = None
    elif node.op_type == "FusedGemm" and node.domain == "kiln":
        bias_at = 2
    else:
        return None
    w = view.const(node.inputs[1])
    if w is None or w.dim() != 2 or not w.dtype.is_floating_point:
        return None
    n = w.shape[1]
    if n % ALIGN == 0 or n < MIN_COLUMNS:
        return None
    return w, bias_at


def run(graph: Graph) -> None:
    view = View(graph)
    for node in list(graph.nodes):
        found = _padded(view, node)
        if found is None:
            continue
        w, bias_at = found
        n = w.shape[1]
        pad = -n % ALIGN
        w_name = f"{node.name}.weight_padded"
        graph.initializers[w_name] = torch.nn.functional.pad(w, (0, pad))
        inputs = list(node.inputs)
        inputs[1] = w_name
        if bias_at is not None and len(inputs) > bias_at and inputs[bias_at]:
            b = view.const(inputs[bias_at])
            if b is None:
                continue
            b_name = f"{node.name}.bias_padded"
            graph.initializers[b_name] = torch.nn.functional.pad(b.reshape(-1), (0, pad))
            inputs[bias_at] = b_name
        out = node.outputs[0]
        wide = f"{out}.padded"
        node.inputs, node.outputs = inputs, [wide]
        bounds = {f"{node.name}.slice_{k}": torch.tensor([v], dtype=torch.int64)
                  for k, v in (("starts", 0), ("ends", n), ("axes", -1))}
        graph.initializers.update(bounds)
        narrow = Node("Slice", [wide, *bounds], [out], {}, name=f"narrow({node.name})")
        narrow.opset = max(13, node.opset)
        narrow.sources = list(node.sources or [node.name])
        graph.nodes.insert(graph.nodes.index(node) + 1, narrow)
    view.refresh()
