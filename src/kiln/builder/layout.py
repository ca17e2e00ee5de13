"""Layout choice for weights on a GPU: channels-last convolutions, K-major 8-bit GEMM weights.

Tensor Core convolution kernels want NHWC; storing the weights channels-last
makes cuDNN pick NHWC kernels and their outputs stay NHWC down the network, so
no transposes are added. An RGB stem convolution of 32 filters or more reading a model
input also gets a fourth, zero input channel: cuDNN's 4-channel kernels are faster (docs/design/stem.md), and
the input's cast into channels-last writes the zero channel in the same copy
(kernels/pad_channels.py). The weights get channels-last strides on every axis, size-1 ones included
(engine.weights_on_target): `.to(memory_format=torch.channels_last)` leaves a depthwise [C, 1, KH, KW] or a 1x1
[K, C, 1, 1] weight as it was, since it counts as contiguous in both layouts, and torch then takes it for NCHW
(its memory-format suggestion for cuDNN): a 1x1 convolution of a pooled [N, C, 1, 1] map (a squeeze-excite
block's), which reads as NCHW too, would be run as an NCHW convolution. Hopper's 8-bit Tensor Core instruction (wgmma) and
cuBLASLt's FP8 GEMM take both operands K-major, so INT8/FP8 GEMM weights [K, N]
are stored column-major. The logical shapes (and the ONNX graph) do not change.
"""

from __future__ import annotations

from ..ir.graph import Graph


def _weights(graph: Graph, op_types: tuple[str, ...], dim: int) -> list[str]:
    """Names of the dim-D weights (input 1) of device layers of these types."""
    names = set()
    for n in graph.nodes:
        if n.op_type in op_types and n.placement == "device" and len(n.inputs) > 1:
            w = graph.initializers.get(n.inputs[1])
            if w is not None and w.dim() == dim:
                names.add(n.inputs[1])
    return sorted(names)


def channels_last_weights(graph: Graph, target_kind: str, precision: str) -> list[str]:
    # FP32 convolutions have no Tensor Core path (without TF32): NCHW kernels are as good there.
    if target_kind != "cuda" or precision == "float32":
        return []
    return _weights(graph, ("Conv", "FusedConv", "QConv"), 4)


# The fewest filters a padded stem has: cuDNN's heuristic runs a 16-filter 3x3 stride-2 stem over four channels
# on a grouped direct kernel far slower than its 3-channel kernel (docs/design/se-cnn.md); 32
# and 64 filters over four channels run well.
MIN_PADDED_FILTERS = 32


def padded_channel_weights(graph: Graph, channels_last: list[str]) -> list[str]:
    """Channels-last weights [K, 3, R, S] (K >= MIN_PADDED_FILTERS) read only by convolutions of a model input:
    stored as [K, 4, R, S], the fourth channel zero (the engine's input cast pads the image to match;
    interpreter.cast_for)."""
    inputs = {v.name for v in graph.inputs}
    readers = graph.consumers()

    def stem(n) -> bool:
        w = graph.initializers[n.inputs[1]]
        return (n.op_type in ("Conv", "FusedConv") and n.inputs[0] in inputs and n.attr("group", 1) == 1
                and w.shape[1] == 3 and w.shape[0] >= MIN_PADDED_FILTERS)

    return sorted(w for w in channels_last if all(stem(n) and n.inputs[1] == w for n in readers.get(w, [])))


def column_major_weights(graph: Graph, target_kind: str) -> list[str]:
    """Quantized GEMM weights [K, N] to store K-contiguous (a [K, N] view of [N, K] memory)."""
    return _weights(graph, ("QGemm",), 2) if target_kind == "cuda" else []
