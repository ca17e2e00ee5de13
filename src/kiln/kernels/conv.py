"""Implicit-GEMM 2-D convolution with a fused epilogue: y = act(conv(x, w) + b + z).

The convolution is a GEMM of [output pixels, KH*KW*C] x [KH*KW*C, OC] whose left
operand is never materialized: each program owns a tile of output pixels (n, oh, ow)
and a tile of output channels, and gathers the input patch for its K slice straight
from x. Two ways to walk K:
- by channel blocks (C >= 32): for each (kh, kw), BLOCK_K input channels at a time;
  with NHWC activations (channels-last) each pixel's channel slice is contiguous.
- flat (small C, e.g. a stem conv on RGB): K = (kh, kw, c) flattened and gathered
  element-wise, so a 7x7 conv on 3 channels does not pad every tap to a full block.
x, w and z are read through their strides (any memory format); the output is
channels-last ([N, OH, OW, OC] in memory, returned as an NCHW-shaped view). Bias,
residual z (broadcastable to the output) and the activation are applied before the
single store. groups == 1 only.

Quantized convolutions (kiln::QConv, QUANT "int8" / "fp8") run the same loop: w is the int8 /
FP8 E4M3 weight [OC, C, KH, KW] read through its strides like a float one, x is read as 8-bit values
(quantized first in one pass when it arrives as floats: gemm.py says why), and the epilogue applies
x_scale * w_scale[oc] before bias, residual and activation (gemm.finish).

Reference: kiln.ops.fused.fused_conv; `reference` below; kiln.ops.fused.qconv when quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm
from .gemm import (
    ACTIVATIONS,
    QTYPES,
    TileConfig,
    _params,
    copy,
    dot_precision,
    finish,
    operand_dtypes_ok,
    quant_args,
    residual_ok,
)

_INT32_MAX = 2**31 - 1
FLAT_BELOW_C = 32  # input channels below which K is walked flat


@triton.jit
def conv_tile(pid_m, pid_n, M, OC, OH, OW, stride_h, stride_w, pad_h, pad_w, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Output tile (pid_m, pid_n): its pixels rm (n, oh, ow flattened) and channels rn, the channels oc and each
    pixel's image n, position (oh, ow) and window corner (ih0, iw0) in the input. Rows and columns past the
    edge wrap to valid ones (computed, then dropped by the masked store)."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    pix = rm % M
    oc = rn % OC
    ow = pix % OW
    oh = (pix // OW) % OH
    n = pix // (OW * OH)
    return rm, rn, oc, n, oh, ow, oh * stride_h - pad_h, ow * stride_w - pad_w


@triton.jit
def k_tiles(x_base, w_base, it, ih0, iw0, rk, C, H, W, KW, KTOT, c_blocks, sxc, sxh, sxw, swc, swh, sww,
            dil_h, dil_w, FLAT: tl.constexpr):
    """Iteration `it` of the K walk: the input patch tile [pixels, BLOCK_K] and the weight tile [BLOCK_K, channels].
    FLAT: K = (kh, kw, c) flattened, c fastest, BLOCK_K at a time; else (kh, kw, channel block), block fastest.
    x_base / w_base point at each row's image and each column's filter; rk = arange(BLOCK_K)."""
    if FLAT:
        kk = it * rk.shape[0] + rk
        c = kk % C
        tap = kk // C
        kh = tap // KW
        kw = tap % KW
        ih = ih0[:, None] + kh[None, :] * dil_h
        iw = iw0[:, None] + kw[None, :] * dil_w
        ok = (kk[None, :] < KTOT) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a = tl.load(x_base[:, None] + c[None, :] * sxc + ih * sxh + iw * sxw, mask=ok, other=0.0)
        b = tl.load(w_base[None, :] + (c * swc + kh * swh + kw * sww)[:, None], mask=(kk < KTOT)[:, None], other=0.0)
    else:
        tap = it // c_blocks
        c = (it % c_blocks) * rk.shape[0] + rk
        kh = tap // KW
        kw = tap % KW
        ih = ih0 + kh * dil_h
        iw = iw0 + kw * dil_w
        pix_ok = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        c_ok = c < C
        a = tl.load((x_base + ih * sxh + iw * sxw)[:, None] + c[None, :] * sxc,
                    mask=pix_ok[:, None] & c_ok[None, :], other=0.0)
        b = tl.load(w_base[None, :] + (c * swc)[:, None] + (kh * swh + kw * sww), mask=c_ok[:, None], other=0.0)
    return a, b


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, z_ptr, y_ptr, xs_ptr, ws_ptr, ys_ptr, qs_ptr, q_ptr, zs_ptr,
                 C, H, W, OC, OH, OW, M, KW, KTOT,
                 sxn, sxc, sxh, sxw, swo, swc, swh, sww, szn, szc, szh, szw, stride_ws,
                 stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, p0, p1,
                 HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
                 QUANT: tl.constexpr, Y_QUANTIZED: tl.constexpr, COPY: tl.constexpr, Z_SCALED: tl.constexpr,
                 FLAT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(OC, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m

    rm, rn, oc, n, oh, ow, ih0, iw0 = conv_tile(pid_m, pid_n, M, OC, OH, OW, stride_h, stride_w, pad_h, pad_w,
                                                BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_base = x_ptr + n * sxn
    w_base = w_ptr + oc * swo

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if QUANT == "int8" else tl.float32)
    c_blocks = tl.cdiv(C, BLOCK_K)
    if FLAT:
        iters = tl.cdiv(KTOT, BLOCK_K)
    else:
        iters = KTOT // C * c_blocks
    for it in range(0, iters):
        a, b = k_tiles(x_base, w_base, it, ih0, iw0, rk, C, H, W, KW, KTOT, c_blocks, sxc, sxh, sxw, swc, swh, sww,
                       dil_h, dil_w, FLAT)
        acc = tl.dot(a, b, acc, input_precision=PREC, out_dtype=acc.dtype)

    z = tl.load(z_ptr + (n * szn + oh * szh + ow * szw)[:, None] + (oc * szc)[None, :]) if HAS_Z else None
    out, acc = finish(acc, z, oc, b_ptr, xs_ptr, ws_ptr, ys_ptr, zs_ptr, stride_ws, p0, p1, y_ptr.dtype.element_ty,
                      HAS_BIAS, HAS_Z, ACT, QUANT, Y_QUANTIZED, Z_SCALED, False)
    # channels-last output (and copy): [N, OH, OW, OC] row-major, i.e. pixel-major with OC contiguous
    offs = rm[:, None] * OC + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < OC)
    tl.store(y_ptr + offs, out, mask=inside)
    if COPY:
        tl.store(q_ptr + offs, copy(acc, out, qs_ptr, q_ptr.dtype.element_ty, QUANT, Y_QUANTIZED, False), mask=inside)


CONFIGS: list[tuple[TileConfig, int]] = [
    (TileConfig(128, 128, 64, 8, 3), 3),
    (TileConfig(64, 64, 64, 4, 4), 3),
    (TileConfig(128, 64, 64, 4, 3), 4),
    (TileConfig(64, 128, 64, 4, 3), 4),
    (TileConfig(128, 128, 32, 4, 4), 5),
    (TileConfig(256, 64, 32, 8, 3), 5),
]

# Tiles for few input channels (K walked flat) and few output channels: an RGB stem of 16-32 filters
# (tactics/triton_conv.py offers them at the default level for such layers only). K is 27-49 taps x channels.
NARROW_CONFIGS: list[TileConfig] = [
    TileConfig(128, 16, 16, 4, 2),
    TileConfig(256, 16, 32, 8, 2),
    TileConfig(128, 32, 32, 4, 2),
    TileConfig(64, 64, 32, 4, 2),
]

# Tiles for 1x1 convolutions of few pixel rows, run as GEMMs (pointwise_as_gemm): a squeeze-excite block's two
# fully connected layers over a pooled [N, C, 1, 1] map (M = the batch, K and N 4-1152 channels, often not a
# multiple of 8), with their SiLU / Sigmoid in the epilogue (tactics/triton_conv.py offers them for M <= 256).
FEW_ROWS_POINTWISE_CONFIGS: list[TileConfig] = [
    TileConfig(16, 64, 64, 4, 2),
    TileConfig(32, 32, 64, 4, 2),
    TileConfig(32, 64, 128, 4, 2),
]


# Quantized (QConv) configurations, offered at their own level (triton_gemm registers them unshifted:
# without them an INT8/FP8 convolution only has the float fallback). Level 3 has tiles for the
# large early layers, for ResNet's 14x14 / 7x7 stages (fewer pixels: more programs) and a deep-K one
# for the wide late layers; all compile for sm_90 without register spills. BLOCK_K >= 32: 8-bit Tensor Core dots.
QUANT_CONFIGS: list[tuple[TileConfig, int]] = [
    (TileConfig(128, 128, 64, 8, 3), 3),
    (TileConfig(64, 128, 64, 8, 3), 3),
    (TileConfig(128, 64, 64, 4, 4), 4),
    (TileConfig(128, 128, 128, 8, 3), 3),
    (TileConfig(64, 128, 128, 8, 3), 4),
    (TileConfig(128, 256, 64, 8, 3), 5),
    (TileConfig(256, 128, 64, 8, 3), 5),
    (TileConfig(64, 64, 128, 4, 4), 5),
]


def geometry(node, x: torch.Tensor, w: torch.Tensor):
    """(strides, dilations, pads [top, left, bottom, right], (OH, OW)) for a 2-D ONNX Conv node, or None."""
    from ..ops.nn import _conv_pads

    if x.dim() != 4 or w.dim() != 4:
        return None
    strides = list(node.attr("strides") or [1, 1])
    dilations = list(node.attr("dilations") or [1, 1])
    if len(strides) != 2 or len(dilations) != 2 or min(strides) < 1 or min(dilations) < 1:
        return None
    kernel = list(w.shape[2:])
    pads = list(_conv_pads(node, list(x.shape[2:]), kernel, strides, dilations))
    if len(pads) != 4 or min(pads) < 0:
        return None
    out = [(x.shape[2 + i] + pads[i] + pads[2 + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
           for i in range(2)]
    if min(out) < 1:
        return None
    return strides, dilations, pads, tuple(out)


def supports(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None,
             qtype: str = "") -> bool:
    """2-D, groups == 1, same-dtype FP16/BF16/FP32 x and w (or int8 / FP8 w of a quantized layer's qtype),
    a residual broadcastable to the output."""
    if node.attr("group", 1) != 1 or node.attr("activation", "") not in ACTIVATIONS:
        return False
    if x.dim() != 4 or w.dim() != 4 or not operand_dtypes_ok(x, w, qtype) or w.shape[1] != x.shape[1]:
        return False
    if x.device != w.device or x.numel() == 0 or w.numel() == 0:
        return False
    if z is not None and not residual_ok(z, qtype):
        return False
    out_shape = epilogue_out_shape(node, x, w, b, z)
    if out_shape is None:
        return False
    n_out = out_shape[0] * out_shape[1] * out_shape[2] * out_shape[3]
    return max(x.numel(), w.numel(), n_out, z.numel() if z is not None else 0) <= _INT32_MAX


def epilogue_out_shape(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       z: torch.Tensor | None) -> tuple[int, ...] | None:
    """The convolution's output shape where its bias (one value a filter) and residual (broadcastable to the
    output) fit it, on x's device; else None."""
    if b is not None and (b.numel() != w.shape[0] or not b.dtype.is_floating_point or b.device != x.device):
        return None
    geo = geometry(node, x, w)
    if geo is None:
        return None
    out_shape = (x.shape[0], w.shape[0], *geo[3])
    if z is not None:
        if z.device != x.device:
            return None
        try:
            if torch.broadcast_shapes(z.shape, out_shape) != torch.Size(out_shape):
                return None
        except RuntimeError:
            return None
    return out_shape


def block_k_for(config: TileConfig, channels: int) -> tuple[int, bool]:
    """(BLOCK_K, flat): walk K flat for few channels, else by channel blocks no wider than C needs."""
    if channels < FLAT_BELOW_C:
        return config.block_k, True
    return min(config.block_k, triton.next_power_of_2(channels)), False


def epilogue_operands(node, b, z, out_shape):
    """The epilogue's kernel arguments: (activation, its two parameters, the bias as a unit-stride vector or
    None, the residual broadcast to the NCHW output shape (broadcast axes get stride 0) or None, its strides)."""
    act = node.attr("activation", "")
    p0, p1 = _params(act, node.attr("activation_params", []))
    if b is not None:
        b = b.reshape(-1)
        if b.stride(0) != 1:
            b = b.contiguous()
    if z is not None:
        z = z.expand(*out_shape)
    return act, p0, p1, b, z, z.stride() if z is not None else (0, 0, 0, 0)


def conv2d(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, z: torch.Tensor | None = None,
           config: TileConfig = CONFIGS[0][0], out: torch.Tensor | None = None,
           x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
           y_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           q_scale: torch.Tensor | None = None, z_scale: torch.Tensor | None = None):
    """act(conv2d(x, w) + b + z) with the node's ONNX attributes; channels-last output of x's dtype.

    A QConv node (attribute qtype): act(x_scale * w_scale * conv2d(q(x), w) + b + z), w its quantized weights,
    z float or 8-bit (z_scale * z);
    x may arrive quantized already (int8 / FP8), the output is out_dtype (a float type), or quantized
    with y_scale; with q_scale, (y, y quantized with q_scale) are returned.
    `out`, if given, is the [N, OH, OW, OC] contiguous buffer to write into.
    """
    strides, dilations, pads, (OH, OW) = geometry(node, x, w)
    N, C, H, W = x.shape
    OC, _, KH, KW = w.shape
    M = N * OH * OW
    qtype = node.attr("qtype", "int8") if node.op_type == "QConv" else ""
    y_dtype = QTYPES[qtype] if y_scale is not None else out_dtype or x.dtype
    y = out if out is not None else torch.empty((N, OH, OW, OC), dtype=y_dtype, device=x.device)
    q = torch.empty((N, OH, OW, OC), dtype=QTYPES[qtype], device=x.device) if q_scale is not None else y
    act, p0, p1, b, z, zs = epilogue_operands(node, b, z, (N, OC, OH, OW))
    x, xs, ws, stride_ws = quant_args(x, qtype, x_scale, w_scale)
    block_k, flat = block_k_for(config, C)
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(OC, config.block_n),)
    _conv_kernel[grid](
        x, w, b if b is not None else w, z if z is not None else w, y, xs, ws, y_scale if y_scale is not None else xs,
        q_scale if q_scale is not None else xs, q, z_scale if z_scale is not None else xs,
        C, H, W, OC, OH, OW, M, KW, KH * KW * C,
        *x.stride(), *w.stride(), *zs, stride_ws,
        strides[0], strides[1], pads[0], pads[1], dilations[0], dilations[1], p0, p1,
        HAS_BIAS=b is not None, HAS_Z=z is not None, ACT=act, PREC=dot_precision(x.dtype, node.precision, qtype),
        QUANT=qtype, Y_QUANTIZED=y_scale is not None, COPY=q_scale is not None, Z_SCALED=z_scale is not None,
        FLAT=flat,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y.permute(0, 3, 1, 2) if q_scale is None else (y.permute(0, 3, 1, 2), q.permute(0, 3, 1, 2))


# --- 1x1 convolutions as GEMMs ---------------------------------------------------------------
# A 1x1, stride-1, unpadded convolution over channels-last x is a GEMM of [N*H*W, C] x [C, OC] on
# the same memory (w [OC, C, 1, 1] is C-contiguous: K-major), so the GEMM kernel runs it with whole
# contiguous tiles instead of per-pixel gathers. 36 of ResNet-50's 53 convolutions are such layers.
def pixel_rows(t: torch.Tensor) -> torch.Tensor | None:
    """A channels-last [N, C, H, W] tensor as its [N*H*W, C] matrix (a view), else None."""
    nhwc = t.permute(0, 2, 3, 1)
    return nhwc.reshape(-1, t.shape[1]) if nhwc.is_contiguous() else None


def is_pointwise(node, x: torch.Tensor, w: torch.Tensor, z: torch.Tensor | None) -> bool:
    """A 1x1 / stride-1 / unpadded / ungrouped convolution of channels-last x (and residual z of the output's
    shape, channels-last)."""
    if x.dim() != 4 or w.dim() != 4 or tuple(w.shape[2:]) != (1, 1) or node.attr("group", 1) != 1:
        return False
    geo = geometry(node, x, w)
    if geo is None or geo[0] != [1, 1] or any(geo[2]) or pixel_rows(x) is None:
        return False
    return z is None or (tuple(z.shape) == (x.shape[0], w.shape[0], *x.shape[2:]) and pixel_rows(z) is not None)


def pixels_as_nchw(ys, x: torch.Tensor):
    """A pointwise layer's GEMM result over x's pixel rows ([N*H*W, OC], or a tuple: the result and its 8-bit
    copy) as NCHW-shaped channels-last views, like conv2d's output."""
    n, _, h, w = x.shape
    if isinstance(ys, tuple):
        return tuple(t.view(n, h, w, -1).permute(0, 3, 1, 2) for t in ys)
    return ys.view(n, h, w, -1).permute(0, 3, 1, 2)


def pointwise_as_gemm(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                      z: torch.Tensor | None = None, config: TileConfig = CONFIGS[0][0],
                      x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                      y_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      q_scale: torch.Tensor | None = None, z_scale: torch.Tensor | None = None):
    """conv2d's result for an is_pointwise layer, computed by gemm.gemm; channels-last like conv2d's."""
    qtype = node.attr("qtype", "int8") if node.op_type == "QConv" else ""
    ys = gemm.gemm(pixel_rows(x), w.reshape(w.shape[0], w.shape[1]).t(), b, node.attr("activation", ""),
                   node.attr("activation_params", []), config=config, precision=node.precision, qtype=qtype,
                   x_scale=x_scale, w_scale=w_scale, y_scale=y_scale, out_dtype=out_dtype,
                   z=pixel_rows(z) if z is not None else None, q_scale=q_scale, z_scale=z_scale)
    return pixels_as_nchw(ys, x)


def reference(node, x, w, b=None, z=None):
    """kiln's FusedConv reference computed in exact FP32 (torch lets cuDNN use TF32 for FP32 convolutions by
    default, which on a GPU is off by ~1e-3 relative), returned in x's dtype."""
    from ..ops.fused import fused_conv

    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        return fused_conv(node, x.float(), w.float(), b.float() if b is not None else None,
                          z.float() if z is not None else None).to(x.dtype)
