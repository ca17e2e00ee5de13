"""Layout choice: convolutions on a GPU run channels-last (NHWC).

Tensor Core convolution kernels want NHWC; storing the weights channels-last
makes cuDNN pick NHWC kernels and their outputs stay NHWC down the network, so
no transposes are added. The logical shapes (and the ONNX graph) do not change.
"""

from __future__ import annotations

from ..ir.graph import Graph


def channels_last_weights(graph: Graph, target_kind: str) -> list[str]:
    if target_kind != "cuda":
        return []
    names = []
    for n in graph.nodes:
        if n.op_type in ("Conv", "FusedConv") and n.placement == "device" and len(n.inputs) > 1:
            w = graph.initializers.get(n.inputs[1])
            if w is not None and w.dim() == 4:
                names.append(n.inputs[1])
    return sorted(set(names))
