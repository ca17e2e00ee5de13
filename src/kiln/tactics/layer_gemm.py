"""A GEMM-like layer's operands, and the GEMM it is: shared by the tactics that run FusedGemm/FusedConv and
QGemm/QConv layers as matrix products (triton_gemm.py's tiles, triton_tma.py's TMA GEMM, library.py's cuBLASLt FP8
GEMM)."""

from __future__ import annotations

import torch


def qtype(node) -> str:
    """A quantized layer's 8-bit type ("int8", "fp8"), "" for a float one."""
    return node.attr("qtype", "int8") if node.op_type in ("QGemm", "QConv") else ""


def operands(node, args):
    """(x, w, b, z, y_scale, q_scale, z_scale) of a FusedGemm/FusedConv (x, w, b, z) or QGemm/QConv
    (x, w_q, x_scale, w_scale, b, z | y_scale, ...)."""
    if not qtype(node):
        rest = list(args[2:]) + [None, None]
        return args[0], args[1], rest[0], rest[1], None, None, None
    rest = list(args[4:]) + [None] * 5
    if node.op_type == "QGemm":  # (x, w_q, x_scale, w_scale, b, y_scale)
        return args[0], args[1], rest[0], None, rest[1], None, None
    return args[0], args[1], *rest[:5]  # QConv: (.., b, z, y_scale, q_scale, z_scale)


def as_gemm(node, x: torch.Tensor, w: torch.Tensor):
    """(x rows, w [K, N]) of the GEMM the layer is: a FusedGemm/QGemm's own, a 1x1 convolution's over
    channels-last pixels (kernels/conv.py is_pointwise); None if neither."""
    from ..kernels import conv

    if node.op_type in ("FusedGemm", "QGemm"):
        return x, w
    if not conv.is_pointwise(node, x, w, None):
        return None
    return conv.pixel_rows(x), w.reshape(w.shape[0], w.shape[1]).t()
