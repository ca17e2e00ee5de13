"""Layout choice: convolutions on a GPU run channels-last (NHWC).

Tensor Core convolution kernels want NHWC; storing the weights channels-last
makes cuDNN pick NHWC kernels and their outputs stay NHWC down the network, so
no transposes are added. The logical shapes (and the ONNX graph) do not change.
"""

from __future__ import annotations

from ..ir.graph import Graph


def channels_last_weights(graph: Graph, target_kind: str, precision: str) -> list[str]:
    # FP32 convolutions have no Tensor Core path (without TF32): NCHW kernels are as good there.
    if target_kind != "cuda" or precision == "float32":
        return []
    names = []
    for n in graph.nodes:
        if n.op_type in ("Conv", "FusedConv", "QConv") and n.placement == "device" and len(n.inputs) > 1:
            w = graph.initializers.get(n.inputs[1])
            if w is not None and w.dim() == 4:
                names.append(n.inputs[1])
    return sorted(set(names))
