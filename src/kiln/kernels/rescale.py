"""One pass over a GEMM's output or input: scale, bias, activation, and (de)quantization together.

y[m, n] = act(a[m, n] * x_scale * w_scale[n] + b[n]), written as out_dtype or quantized with y_scale
(int8 / FP8 E4M3), each step optional. It is the epilogue of library 8-bit GEMMs whose own epilogue
cannot do it all (cuBLASLt's int8 GEMM returns raw int32 sums; its FP8 GEMM fuses the scales and
bias but neither GELU nor re-quantization), and with only y_scale it quantizes an activation for
them: one kernel where torch needs a cast, a divide, a clamp and another cast, each a pass over
memory. Rounding as the fused kernels do it (gemm.quantize).

`quantize_linear` / `dequantize_linear` are ONNX's QuantizeLinear / DequantizeLinear between int8 and FP32
with a per-tensor scale and zero point, in one pass each: the Q/DQ pairs a Q/DQ model keeps around its
INT8 layers (passes/fuse_qdq.py), where torch takes three to five.

Reference: kiln.ops.fused.quantize / qgemm's epilogue; `reference` below; kiln.ops.quant.quantize_linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import ACTIVATIONS, QTYPES, _params, epilogue, quantize

BLOCK = 1024


@triton.jit
def _rescale_kernel(a_ptr, xs_ptr, ws_ptr, b_ptr, ys_ptr, y_ptr, numel, N, stride_ws, p0, p1,
                    SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    v = tl.load(a_ptr + offs, mask=ok, other=0).to(tl.float32)
    # The column (an int64 modulo per element) only where per-column values are read: quantizing an
    # activation (the commonest use) needs none.
    if SCALED:
        ws = tl.load(ws_ptr + (offs % N) * stride_ws, mask=ok, other=0.0).to(tl.float32)
        v = v * (tl.load(xs_ptr).to(tl.float32) * ws)
    if HAS_BIAS:
        v += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    v = epilogue(v, ACT, p0, p1)
    tl.store(y_ptr + offs, quantize(v, ys_ptr, QUANT).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _quantize_linear_kernel(x_ptr, s_ptr, zp_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    zp = tl.load(zp_ptr).to(tl.float32)
    # x / s correctly rounded, as ONNX (and torch) divide; saturated before rounding, to the integers whose
    # code fits (round(clamp(v)) == clamp(round(v)) for integer bounds)
    v = tl.math.div_rn(tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32), tl.load(s_ptr).to(tl.float32))
    v = tl.minimum(tl.maximum(v, -128.0 - zp), 127.0 - zp)
    q = (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000  # round half to even (gemm.quantize's trick)
    tl.store(y_ptr + offs, (q + zp.to(tl.int32)).to(tl.int8), mask=ok)


def quantize_linear(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """clamp(round(x / scale) + zero_point, -128, 127) as int8, x's shape and strides; one scale and one int8
    zero point."""
    return _one_pass(_quantize_linear_kernel, x, torch.int8, scale, zero_point)


@triton.jit
def _dequantize_linear_kernel(q_ptr, s_ptr, zp_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    v = tl.load(q_ptr + offs, mask=ok, other=0).to(tl.float32) - tl.load(zp_ptr).to(tl.float32)  # exact
    tl.store(y_ptr + offs, v * tl.load(s_ptr).to(tl.float32), mask=ok)


def dequantize_linear(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """(q - zero_point) * scale in FP32, q's shape and strides; int8 q, one FP32 scale and one int8 zero point."""
    return _one_pass(_dequantize_linear_kernel, q, torch.float32, scale, zero_point)


def _one_pass(kernel, x: torch.Tensor, dtype: torch.dtype, *args) -> torch.Tensor:
    """An elementwise kernel(x, *args, y, numel) over x into a new `dtype` tensor with x's strides (x dense in
    some axis order, else made contiguous)."""
    y = torch.empty_like(x, dtype=dtype) if _dense(x) else torch.empty(x.shape, dtype=dtype, device=x.device)
    x = x if _dense(x) else x.contiguous()
    if x.numel():
        kernel[(triton.cdiv(x.numel(), BLOCK),)](x, *args, y, x.numel(), BLOCK=BLOCK)
    return y


def rescale(a: torch.Tensor, x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
            bias: torch.Tensor | None = None, act: str = "", params=(), y_scale: torch.Tensor | None = None,
            qtype: str = "", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """act(a * x_scale * w_scale[n] + bias[n]) over a's last axis n, as out_dtype, or as qtype's 8-bit values
    when y_scale is given. Scales go together (both or neither); w_scale has one or N values."""
    if (act not in ACTIVATIONS or (x_scale is None) != (w_scale is None)
            or (y_scale is not None and qtype not in QTYPES)):
        raise ValueError(f"rescale: unsupported activation {act!r} or scale combination (qtype {qtype!r})")
    dtype = QTYPES[qtype] if y_scale is not None else out_dtype or a.dtype
    if x_scale is None and bias is None and _dense(a):  # elementwise: walk memory in a's own order, keep its strides
        y = torch.empty_like(a, dtype=dtype)
    else:  # per-column scales or bias: row-major, n the last axis
        a = a.contiguous()
        y = torch.empty(a.shape, dtype=dtype, device=a.device)
    n = a.shape[-1]
    if a.numel() == 0:
        return y
    ws = w_scale.reshape(-1) if w_scale is not None else a
    p0, p1 = _params(act, params)
    _rescale_kernel[(triton.cdiv(a.numel(), BLOCK),)](
        a, x_scale if x_scale is not None else a, ws, bias.reshape(-1) if bias is not None else a,
        y_scale if y_scale is not None else a, y, a.numel(), n, 1 if ws.numel() == n and w_scale is not None else 0,
        p0, p1, SCALED=x_scale is not None, HAS_BIAS=bias is not None, ACT=act,
        QUANT=qtype if y_scale is not None else "", BLOCK=BLOCK)
    return y


def to_8bit(x: torch.Tensor, scale: torch.Tensor, qtype: str) -> torch.Tensor:
    """x as qtype's 8-bit values: as it is if it already is (quantized by the layer before), else quantized
    with `scale` in one pass."""
    return x if x.dtype == QTYPES[qtype] else rescale(x, y_scale=scale, qtype=qtype)


def _dense(a: torch.Tensor) -> bool:
    """Contiguous in some axis order that empty_like reproduces (row-major or channels-last)."""
    return a.is_contiguous() or (a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last))


def reference(a, x_scale=None, w_scale=None, bias=None, act="", params=(), y_scale=None, qtype="", out_dtype=None):
    from ..ops.fused import activation, quantize_as

    v = a.float()
    if x_scale is not None:
        v = v * (x_scale.float() * w_scale.float().reshape(-1))
    if bias is not None:
        v = v + bias.float().reshape(-1)
    v = activation(act, v, list(params))
    if y_scale is not None:
        return quantize_as(qtype, v, y_scale)
    return v.to(out_dtype or a.dtype)
