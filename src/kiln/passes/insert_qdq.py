"""Post-training quantization: put calibrated Q/DQ pairs around GEMMs and convolutions.

Runs only in an INT8 or FP8 build (graph.quant_amax holds the calibrated
activation ranges). Each MatMul/Gemm/Conv with constant float weights whose
input has a calibrated range gets QuantizeLinear/DequantizeLinear on that input
(per-tensor scale amax/127, or amax/448 for FP8 E4M3) and quantized weights
(int8 per output channel; FP8 per tensor, one shared by GEMMs reading one input). The graph is
then an explicitly quantized ONNX graph (exportable, onnxruntime runs it), and
fuse_qdq turns each pattern into an INT8 layer.

A convolution over fewer than MIN_CHANNELS input channels per group (a network's RGB stem) stays in
float: an 8-bit Tensor Core step sums 32 channels, so 3 channels waste most of it, and no 8-bit kernel
here takes it: quantized, it would add per-call kernels that quantize the image, dequantize the weights and
pad channels before the same float convolution (see docs/design/stem.md). A stride-2 stem over an image does not
reach this pass as such: stem_patches ran
first and made it a convolution over 64 channels.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from .rewrite import View, miss, pinned


def quantize_weight(w: torch.Tensor, channel_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (w_q, scale) with scale = max|w| / 127 per channel."""
    dims = [d for d in range(w.dim()) if d != channel_axis]
    amax = w.abs().amax(dim=dims) if dims else w.abs()
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).float()
    shape = [1] * w.dim()
    shape[channel_axis] = -1
    w_q = torch.clamp(torch.round(w.float() / scale.reshape(shape)), -127, 127).to(torch.int8)
    return w_q, scale


def quantize_weight_fp8(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weights with one scale (amax / 448, amax max|w| unless given), as cuBLASLt's FP8 GEMM takes them."""
    amax = w.abs().max() if amax is None else amax
    scale = (amax / FP8_MAX if amax > 0 else torch.tensor(1.0)).float().reshape(1)
    return torch.clamp(w.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


FP8_MAX = 448.0  # largest finite float8 e4m3fn
SHARED_FP8_RANGE = 16.0  # sibling GEMMs share an FP8 weight scale when their max|w| are within this factor
MIN_CHANNELS = 4  # input channels per group below which a convolution is not quantized (RGB, grey)
KEPT_IN_FLOAT = "kept in float"  # how the note of a layer this pass leaves unquantized begins


def _fp8_gemm_amax(graph: Graph, view: View) -> dict[str, torch.Tensor]:
    """{GEMM name: the max|w| its FP8 weights are scaled by}: its own, or for GEMMs that read one input (Q, K and
    V) the largest of theirs, so merge_parallel_gemms keeps one weight scale, the only kind cuBLASLt's FP8 GEMM
    takes on Hopper (it offers no per-channel FP8 scales there; see docs/design/cublaslt.md). FP8 is a float: a larger
    scale moves a weight down its binades at the same relative precision, losing bits only below 2^-6 of
    the scale, so sharing costs nothing measurable while the max|w| are within SHARED_FP8_RANGE."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for n in graph.nodes:
        w = view.const(n.inputs[1]) if n.op_type in ("MatMul", "Gemm") and not n.domain else None
        if w is not None and w.dtype.is_floating_point and w.dim() == 2:
            groups.setdefault(n.inputs[0], []).append((n.name, w.abs().max()))
    amax = {}
    for members in groups.values():
        top = max(a for _, a in members)
        share = len(members) > 1 and all(a * SHARED_FP8_RANGE >= top for _, a in members)
        amax.update({name: top if share else a for name, a in members})
    return amax


def run(graph: Graph) -> None:
    amax = graph.quant_amax
    if amax is None:
        return
    fp8 = graph.quant_type == "fp8"
    view = View(graph)
    zero = "kiln.fp8_zero_point" if fp8 else "kiln.int8_zero_point"
    graph.initializers[zero] = torch.zeros((), dtype=torch.float8_e4m3fn if fp8 else torch.int8)
    fp8_amax = _fp8_gemm_amax(graph, view) if fp8 else {}
    for n in [n for n in graph.nodes if n.op_type in ("MatMul", "Gemm", "Conv") and not n.domain]:
        w = view.const(n.inputs[1])
        if w is None or not w.dtype.is_floating_point or (n.op_type != "Conv" and w.dim() != 2):
            continue
        if (n.op_type == "Gemm" and n.attr("transA", 0)) or pinned(n):
            continue  # pinned layers keep the float precision they were given
        if n.op_type == "Conv" and w.dim() > 1 and w.shape[1] < MIN_CHANNELS:
            c = w.shape[1]
            n.note = n.note or f"{KEPT_IN_FLOAT}: {c} input channel{'s' * (c > 1)}, too few for 8-bit Tensor Cores"
            continue
        x = n.inputs[0]
        if x not in amax or not amax[x] > 0:
            miss(graph, "INT8 layer", [n], f"no calibrated range for its input '{x}'")
            continue
        axis = 0 if n.op_type == "Conv" or (n.op_type == "Gemm" and n.attr("transB", 0)) else 1
        w_q, w_scale = quantize_weight_fp8(w, fp8_amax.get(n.name)) if fp8 else quantize_weight(w, axis)
        tag = n.name
        graph.initializers.update({
            f"{tag}.input_scale": torch.tensor(amax[x] / (FP8_MAX if fp8 else 127.0), dtype=torch.float32),
            f"{tag}.weight_q": w_q, f"{tag}.weight_scale": w_scale,
            # Per-axis zero points have one entry per channel (onnxruntime insists).
            f"{tag}.weight_zero_point": torch.zeros(w_scale.shape, dtype=w_q.dtype),
        })
        q = Node("QuantizeLinear", [x, f"{tag}.input_scale", zero], [f"{tag}.input_q"], name=f"{tag}.quantize_input")
        dq = Node("DequantizeLinear", [f"{tag}.input_q", f"{tag}.input_scale", zero], [f"{tag}.input_dq"],
                  name=f"{tag}.dequantize_input")
        dqw = Node("DequantizeLinear", [f"{tag}.weight_q", f"{tag}.weight_scale", f"{tag}.weight_zero_point"],
                   [f"{tag}.weight_dq"],
                   {"axis": axis}, name=f"{tag}.dequantize_weight")
        for extra in (q, dq, dqw):
            extra.opset = max(13, n.opset)  # per-axis DequantizeLinear needs opset 13
        n.inputs = [f"{tag}.input_dq", f"{tag}.weight_dq", *n.inputs[2:]]
        at = graph.nodes.index(n)
        graph.nodes[at:at] = [q, dq, dqw]
    view.refresh()
