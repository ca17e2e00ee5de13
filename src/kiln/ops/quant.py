"""Quantization: QuantizeLinear / DequantizeLinear (per-tensor, per-axis, blocked),
DynamicQuantizeLinear and the integer / QLinear products.

Integer products run in float64: exact for 8/16-bit operands (every partial sum
stays below 2**53) and supported by cuBLAS/cuDNN, which have no integer GEMM.
"""

import onnx
import torch

from ..ir import dtypes
from .cast import FLOAT8_FORMATS, MINIFLOAT_FORMATS, cast_to, round_minifloat
from .nn import _check_geometry, conv
from .registry import register

TP = onnx.TensorProto

_INT_RANGES = {
    TP.UINT8: (0, 255), TP.INT8: (-128, 127), TP.UINT16: (0, 65535), TP.INT16: (-32768, 32767),
    TP.UINT4: (0, 15), TP.INT4: (-8, 7), TP.UINT2: (0, 3), TP.INT2: (-2, 1),
}
_QUANT_TYPES = set(_INT_RANGES) | set(FLOAT8_FORMATS) | set(MINIFLOAT_FORMATS)
_FLOAT_OUT = (TP.FLOAT, TP.FLOAT16, TP.BFLOAT16, TP.DOUBLE)


def _layout(v: torch.Tensor, x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """A scale or zero point laid out to broadcast against x: per-tensor (one
    element), per-axis (1-D along `axis`) or blocked (each element covers
    `block_size` consecutive positions along `axis`)."""
    if v.numel() == 1:
        return v.reshape(())
    if block_size:
        return v.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x.shape[axis])
    shape = [1] * x.dim()
    shape[axis] = v.numel()
    return v.reshape(shape)


def _saturate(q: torch.Tensor, zero_point: torch.Tensor | None, to: int, saturate: bool = True) -> torch.Tensor:
    """round(q) + zero_point, saturated to ONNX type `to` (in its carrier dtype)."""
    if to in _INT_RANGES:
        y = torch.round(q).to(torch.float64)  # exact for every integer the targets hold
        if zero_point is not None:
            y = y + zero_point.to(torch.float64)
        lo, hi = _INT_RANGES[to]
        return y.clamp(lo, hi).to(dtypes.onnx_to_torch(to))
    if zero_point is not None:  # float targets: zero point is normally 0, kept for the formula's sake
        q = q + zero_point.to(q.dtype)
    if to in MINIFLOAT_FORMATS:  # saturating whatever `saturate` says: these types have no Inf/NaN
        return round_minifloat(q, to)
    return cast_to(q, to, saturate)


def _check_quantize(node) -> str | None:
    if node.attr("block_size", 0) < 0:
        return f"block_size {node.attr('block_size')} is negative"
    out = node.attr("output_dtype", 0)
    if out and out not in _QUANT_TYPES:
        return f"output_dtype {dtypes.onnx_type_name(out)} is not a quantized type Kiln supports"
    precision = node.attr("precision", 0)
    if precision and precision not in _FLOAT_OUT:
        return f"precision {dtypes.onnx_type_name(precision)} is not a float type"
    return None


@register("QuantizeLinear", keeps_input_types=True, check=_check_quantize, since=10)
def quantize_linear(node, x, scale, zero_point=None):
    axis = node.attr("axis", 1) % max(x.dim(), 1)
    block = node.attr("block_size", 0)
    to = node.attr("output_dtype", 0)
    if not to:  # the zero point's type (dtypes.pin_narrow_types sets output_dtype for narrow ones)
        to = dtypes.torch_to_onnx(zero_point.dtype) if zero_point is not None else TP.UINT8
    # The scale's type (or `precision`) sets the precision of the division.
    precision = node.attr("precision", 0)
    dt = dtypes.onnx_to_torch(precision) if precision else scale.dtype
    if dt not in dtypes.FLOAT_TYPES:  # int32 / float8e8m0 scales
        dt = torch.float32
    q = x.to(dt) / _layout(scale, x, axis, block).to(dt)
    zp = _layout(zero_point, x, axis, block) if zero_point is not None else None
    return _saturate(q, zp, to, bool(node.attr("saturate", 1)))


def _check_dequantize(node) -> str | None:
    if node.attr("block_size", 0) < 0:
        return f"block_size {node.attr('block_size')} is negative"
    out = node.attr("output_dtype", 0)
    if out and out not in _FLOAT_OUT:
        return f"output_dtype {dtypes.onnx_type_name(out)} is not float, float16 or bfloat16"
    return None


@register("DequantizeLinear", keeps_input_types=True, check=_check_dequantize, since=10)
def dequantize_linear(node, x, scale, zero_point=None):
    axis = node.attr("axis", 1) % max(x.dim(), 1)
    block = node.attr("block_size", 0)
    out = node.attr("output_dtype", 0)
    out = dtypes.onnx_to_torch(out) if out else scale.dtype
    # Computed at least in float32 and rounded once to the output type.
    work = torch.promote_types(out, torch.float32)
    dx = x.to(torch.float64 if x.dtype in (torch.int32, torch.uint32) else work)  # int32 exceeds float32's 24 bits
    if zero_point is not None:
        dx = dx - _layout(zero_point, x, axis, block).to(dx.dtype)
    return (dx.to(work) * _layout(scale, x, axis, block).to(work)).to(out)


@register("DynamicQuantizeLinear", keeps_input_types=True, since=11)
def dynamic_quantize_linear(node, x):
    xf = x.float()
    hi = xf.max().clamp(min=0)
    lo = xf.min().clamp(max=0)
    # The range always includes 0; a constant-zero input gets scale 1/255.
    scale = torch.where(hi == lo, 1.0, hi - lo) / 255
    zp = torch.round((-lo / scale).clamp(0, 255))
    y = (torch.round(xf / scale) + zp).clamp(0, 255)
    return y.to(torch.uint8), scale.to(x.dtype), zp.to(torch.uint8)


def _centered(x: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """x - zero_point in float64 (exact for every quantized type)."""
    x = x.to(torch.float64)
    return x if zero_point is None else x - zero_point.to(torch.float64)


def _along(v: torch.Tensor | None, trailing: int) -> torch.Tensor | None:
    """A 1-D (per-row / per-channel) scale or zero point shaped [n, 1, ...] with
    `trailing` ones, to broadcast along its axis; single values pass through."""
    if v is None or v.numel() == 1:
        return v
    return v.reshape([-1] + [1] * trailing)


@register("MatMulInteger", since=10)
def matmul_integer(node, a, b, a_zero_point=None, b_zero_point=None):
    # a's zero point may be per row, b's per column (which broadcasts as it is).
    y = torch.matmul(_centered(a, _along(a_zero_point, 1)), _centered(b, b_zero_point))
    return y.to(torch.int32)


@register("ConvInteger", check=_check_geometry, since=10)
def conv_integer(node, x, w, x_zero_point=None, w_zero_point=None):
    # Padding adds zeros to x - x_zero_point, i.e. pads x with its zero point.
    y = conv(node, _centered(x, x_zero_point), _centered(w, _along(w_zero_point, w.dim() - 1)))
    return y.to(torch.int32)


@register("QLinearMatMul", keeps_input_types=True, since=10)
def qlinear_matmul(node, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    # a's scale and zero point may be per row, b's per column, y's per row.
    acc = torch.matmul(_centered(a, _along(a_zero_point, 1)), _centered(b, b_zero_point))
    m = _along(a_scale, 1) * b_scale / _along(y_scale, 1)  # in the scales' type, as ONNX computes it
    to = dtypes.torch_to_onnx((y_zero_point if y_zero_point is not None else a).dtype)
    return _saturate(acc * m.to(torch.float64), _along(y_zero_point, 1), to)


@register("QLinearConv", keeps_input_types=True, check=_check_geometry, since=10)
def qlinear_conv(node, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, bias=None):
    xc = _centered(x, x_zero_point)
    wc = _centered(w, _along(w_zero_point, w.dim() - 1))
    acc = conv(node, xc, wc, bias.to(torch.float64) if bias is not None else None)
    # w's scale may be per output channel: axis 1 of the result.
    m = x_scale * _along(w_scale, x.dim() - 2) / y_scale  # in the scales' type, as ONNX computes it
    to = dtypes.torch_to_onnx((y_zero_point if y_zero_point is not None else x).dtype)
    return _saturate(acc * m.to(torch.float64), y_zero_point, to)
