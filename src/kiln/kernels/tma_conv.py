"""Implicit-GEMM convolution on Hopper's tensor-memory accelerator (TMA): stride 1 or 2, channels-last.

kernels/conv.py gathers each output pixel's input patch with per-thread pointer loads and masks the
image's border. Here an output tile is a BLOCK_H x BLOCK_W patch of one image's output pixels, and for
each filter tap (r, s) and channel block the input it needs is itself a BLOCK_H x BLOCK_W patch, shifted
by (r - pad_top, s - pad_left): one 4-D TMA box [1, BLOCK_H, BLOCK_W, BLOCK_K] of the NHWC input.
Boxes reaching past the image read zeros (TMA fills out-of-bounds elements with zero, negative
coordinates included), which is exactly the convolution's zero padding, so there are no masks, no index
arithmetic per element and no padded copy of the input. The box, reshaped to [BLOCK_H * BLOCK_W,
BLOCK_K], is the GEMM's left tile; the weights [OC, KH, KW, C] (channels-last, so K-major: what Hopper's
8-bit Tensor Core instruction reads) are its right tile by 2-D TMA. A fixed grid of one program per SM
walks the output tiles, like kernels/tma_gemm.py, and the epilogue is the GEMM's: dequantization
(x_scale * w_scale[oc]), bias, residual (a 4-D box of z), activation, 8-bit output or copy, one TMA store.

A stride-2 window is not a box of x, but it is one of x viewed as [N, H/2, 2, W/2, 2C]: input row
2 * oh + d (d = r - pad_top) is row oh + floor(d / 2) of phase d mod 2 of that view, and likewise for
columns, whose phase picks a C-wide half of the last axis. Rows and columns past the image are still out of
bounds of the view (H and W even), so still read as zeros. Dilation 1 only; C a multiple of BLOCK_K, so a K
tile never straddles two taps. ResNet-50 has 13 stride-1 3x3 convolutions and 6 stride-2 ones (three 3x3,
three 1x1).

Reference: kiln.ops.fused.fused_conv / qconv; kernels/conv.py runs every convolution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm import QTYPES, copy, finish, quant_args, relu_in_quantize, residual_ok
from .tma_gemm import programs, resident_programs

_ALIGN = 16  # bytes: TMA's alignment for base addresses and strides
MAX_PAD = 8  # the largest top/left padding of a strided layer here
_MAX_PAD = tl.constexpr(MAX_PAD)
STRIDES = (1, 2)


@dataclass(frozen=True)
class PatchConfig:
    """An output tile of block_h x block_w pixels by block_n channels, K walked block_k channels at a time."""

    block_h: int
    block_w: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"{self.block_h}x{self.block_w}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}"

    def pipeline_bytes(self, itemsize: int) -> int:
        """Shared memory of the operand pipeline."""
        return self.num_stages * (self.block_h * self.block_w + self.block_n) * self.block_k * itemsize

    def smem_bytes(self, itemsize: int) -> int:
        """The operand pipeline plus the 16-bit output and residual tiles the epilogue moves."""
        return self.pipeline_bytes(itemsize) + 2 * self.block_h * self.block_w * self.block_n * 2


@triton.jit
def _tma_conv_kernel(x_desc, w_desc, y_desc, z_desc, q_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, qs_ptr, zs_ptr,
                     N, OH, OW, OC, C, pad_h, pad_w, stride_ws, p0, p1,
                     KH: tl.constexpr, KW: tl.constexpr, STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_Z: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr, Y_QUANTIZED: tl.constexpr,
                     COPY: tl.constexpr, Z_SCALED: tl.constexpr, RELU: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PROGRAMS: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_H * BLOCK_W
    tiles_w = tl.cdiv(OW, BLOCK_W)
    tiles_hw = tl.cdiv(OH, BLOCK_H) * tiles_w
    tiles_n = tl.cdiv(OC, BLOCK_N)
    c_blocks = C // BLOCK_K
    k_tiles = KH * KW * c_blocks
    for tile in tl.range(tl.program_id(0), N * tiles_hw * tiles_n, PROGRAMS, flatten=True):
        # Channel tiles of one patch are neighbours: they share the patch's input boxes in L2.
        patch = tile // tiles_n
        off_n = (tile % tiles_n) * BLOCK_N
        img = patch // tiles_hw
        oh0 = (patch % tiles_hw) // tiles_w * BLOCK_H
        ow0 = (patch % tiles_w) * BLOCK_W
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if QUANT == "int8" else tl.float32)
        for kb in range(k_tiles):
            tap = kb // c_blocks
            c0 = (kb % c_blocks) * BLOCK_K
            if STRIDE == 1:
                a = x_desc.load([img, oh0 + tap // KW - pad_h, ow0 + tap % KW - pad_w, c0])
            else:  # the [N, H/S, S, W/S, S*C] view; offsets made non-negative before // and %
                dh = tap // KW - pad_h + STRIDE * _MAX_PAD
                dw = tap % KW - pad_w + STRIDE * _MAX_PAD
                a = x_desc.load([img, oh0 + dh // STRIDE - _MAX_PAD, dh % STRIDE,
                                 ow0 + dw // STRIDE - _MAX_PAD, dw % STRIDE * C + c0])
            a = a.reshape(BLOCK_M, BLOCK_K)
            b = w_desc.load([off_n, tap * C + c0]).T
            acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
        cols = (off_n + tl.arange(0, BLOCK_N)) % OC  # channels past OC compute garbage the store drops
        # a residual of the output's shape, channels-last
        z = z_desc.load([img, oh0, ow0, off_n]).reshape(BLOCK_M, BLOCK_N) if HAS_Z else None
        out, acc = finish(acc, z, cols, b_ptr, xs_ptr, ws_ptr, ys_ptr, zs_ptr, stride_ws, p0, p1, y_desc.dtype,
                          HAS_BIAS, HAS_Z, ACT, QUANT, Y_QUANTIZED, Z_SCALED, RELU)
        y_desc.store([img, oh0, ow0, off_n], out.reshape(1, BLOCK_H, BLOCK_W, BLOCK_N))
        if COPY:
            q = copy(acc, out, qs_ptr, q_desc.dtype, QUANT, Y_QUANTIZED, RELU)
            q_desc.store([img, oh0, ow0, off_n], q.reshape(1, BLOCK_H, BLOCK_W, BLOCK_N))


# (config, lowest optimization level that offers it). 8-bit K tiles of 128 bytes (TMA's widest swizzle).
# Each level-3 8-bit tile is the fastest at one of ResNet-50's 3x3 stages; the 16-bit ones only match cuDNN, so
# they start at level 4 (see docs/design/tma-conv.md).
CONFIGS: list[tuple[PatchConfig, int]] = [
    (PatchConfig(8, 16, 64, 64, 4, 4), 4),
    (PatchConfig(16, 8, 128, 64, 8, 4), 4),
    (PatchConfig(8, 8, 128, 64, 4, 4), 4),
]
QUANT_CONFIGS: list[tuple[PatchConfig, int]] = [
    (PatchConfig(8, 16, 64, 128, 4, 4), 3),
    (PatchConfig(16, 16, 128, 128, 8, 3), 3),
    (PatchConfig(16, 8, 128, 128, 8, 3), 3),
    (PatchConfig(8, 8, 128, 128, 4, 4), 3),
    (PatchConfig(8, 16, 128, 128, 4, 4), 4),
    (PatchConfig(8, 16, 128, 128, 8, 3), 4),
    # 256-pixel patches of 64 channels, two per SM: the 64 -> 64 3x3s of 56x56 images
    (PatchConfig(8, 32, 64, 128, 4, 3), 3),
    # 16x16 patches walking K 64 channels at a time: the 8-bit stem's 4x1 convolution over 64 channels of stem
    # patches (passes/stem_patches.py; K = 4 taps x 64; see docs/design/stem.md)
    (PatchConfig(16, 16, 64, 64, 4, 3), 3),
]
# One-row patches (a [1, 1, BLOCK_W, BLOCK_K] box, no reshape through registers: bench/sm90_compile.py) are
# several times slower at every ResNet-50 3x3 layer, so none is offered; the kernel still takes them.


def nhwc(t: torch.Tensor) -> torch.Tensor | None:
    """A channels-last [N, C, H, W] tensor as its [N, H, W, C] view TMA can address, else None."""
    v = t.permute(0, 2, 3, 1)
    if not v.is_contiguous() or v.data_ptr() % _ALIGN or (v.stride(2) * v.element_size()) % _ALIGN:
        return None
    return v


def filter_rows(w: torch.Tensor) -> torch.Tensor | None:
    """Channels-last weights [OC, C, KH, KW] as their [OC, KH*KW*C] K-major matrix (a view), else None."""
    v = w.permute(0, 2, 3, 1)
    if not v.is_contiguous() or v.data_ptr() % _ALIGN or (v.stride(0) * v.element_size()) % _ALIGN:
        return None
    return v.reshape(w.shape[0], -1)


def block_k_for(config: PatchConfig, channels: int, quantized: bool = False) -> int | None:
    """The K tile for C input channels: the configuration's, or C itself when smaller; None if C is not a
    whole number of tiles (a tile would straddle two taps) or below the Tensor Cores' step (16 values, 32 for
    8-bit ones)."""
    bk = min(config.block_k, channels)
    return bk if channels % bk == 0 and bk >= (32 if quantized else 16) else None


def supports(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None,
             config: PatchConfig, qtype: str = "") -> bool:
    """A stride-1 or stride-2 (then even H and W), dilation-1, ungrouped 2-D convolution of channels-last 16-bit
    (or, quantized, any float or the qtype's 8-bit) x with channels-last weights, OC a multiple of 16, a
    channels-last residual of the output's shape; C a whole number of K tiles."""
    from .conv import geometry

    if x.dim() != 4 or w.dim() != 4 or node.attr("group", 1) != 1 or x.shape[1] != w.shape[1] or x.numel() == 0:
        return False
    if qtype:
        if w.dtype != QTYPES.get(qtype) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32, w.dtype):
            return False
    elif x.dtype not in (torch.float16, torch.bfloat16) or w.dtype != x.dtype:
        return False
    geo = geometry(node, x, w)
    if geo is None or geo[1] != [1, 1] or geo[0][0] != geo[0][1] or geo[0][0] not in STRIDES:
        return False
    stride = geo[0][0]
    if stride > 1 and (x.shape[2] % stride or x.shape[3] % stride or max(geo[2][:2]) > MAX_PAD):
        return False
    if w.shape[0] % 16 or block_k_for(config, x.shape[1], bool(qtype)) is None:
        return False
    if nhwc(x) is None or filter_rows(w) is None:
        return False
    if z is not None and (tuple(z.shape) != (x.shape[0], w.shape[0], *geo[3]) or not residual_ok(z, qtype)
                          or nhwc(z) is None):
        return False
    return b is None or (b.numel() == w.shape[0] and b.dtype.is_floating_point)


def conv2d(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, z: torch.Tensor | None = None,
           config: PatchConfig = CONFIGS[0][0], x_scale: torch.Tensor | None = None,
           w_scale: torch.Tensor | None = None, y_scale: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, q_scale: torch.Tensor | None = None,
           z_scale: torch.Tensor | None = None, programs_per_sm: int | None = None):
    """act(conv2d(x, w) + b + z) for a `supports` layer, as kernels/conv.conv2d computes it (quantized layers
    too, z 8-bit with z_scale): channels-last output returned as an NCHW-shaped view; with q_scale also its
    8-bit copy. programs_per_sm: persistent programs per SM (default tma_gemm.resident_programs)."""
    from .conv import epilogue_operands, geometry

    strides, _, pads, (OH, OW) = geometry(node, x, w)
    N, C = x.shape[:2]
    OC, KH, KW = w.shape[0], w.shape[2], w.shape[3]
    qtype = node.attr("qtype", "int8") if node.op_type == "QConv" else ""
    y = torch.empty((N, OH, OW, OC), dtype=QTYPES[qtype] if y_scale is not None else out_dtype or x.dtype,
                    device=x.device)
    q = torch.empty((N, OH, OW, OC), dtype=QTYPES[qtype], device=x.device) if q_scale is not None else y
    act, p0, p1, bias, _, _ = epilogue_operands(node, b, None, (N, OC, OH, OW))
    x, xs, ws, stride_ws = quant_args(x, qtype, x_scale, w_scale)
    bh, bw, bn, bk = config.block_h, config.block_w, config.block_n, block_k_for(config, C, bool(qtype))

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    S = strides[0]
    rows = nhwc(x)
    if S > 1:  # [N, H, W, C] as [N, H/S, S, W/S, S*C]: a stride-S window is a box of this view
        rows = rows.reshape(N, rows.shape[1] // S, S, rows.shape[2] // S, S * C)
    x_box = [1, bh, bw, bk] if S == 1 else [1, bh, 1, bw, bk]
    out_box = [1, bh, bw, bn]
    y_desc = desc(y, out_box)
    tiles = N * triton.cdiv(OH, bh) * triton.cdiv(OW, bw) * triton.cdiv(OC, bn)
    # At most two: three ran no faster where the smaller K tile (64 channels) leaves room for them (see
    # docs/design/tma-conv.md).
    pipeline = replace(config, block_k=bk).pipeline_bytes(x.element_size())
    per_sm = programs_per_sm or min(2, resident_programs(config.num_warps, pipeline, bh * bw * bn, qtype))
    n_programs = min(per_sm * programs(x.device), tiles)
    _tma_conv_kernel[(n_programs,)](
        desc(rows, x_box), desc(filter_rows(w), [bn, bk]), y_desc,
        desc(nhwc(z), out_box) if z is not None else y_desc, desc(q, out_box),
        bias if bias is not None else xs, xs, ws, y_scale if y_scale is not None else xs,
        q_scale if q_scale is not None else xs, z_scale if z_scale is not None else xs,
        N, OH, OW, OC, C, pads[0], pads[1], stride_ws, p0, p1,
        KH=KH, KW=KW, STRIDE=S, HAS_BIAS=bias is not None, HAS_Z=z is not None, ACT=act, QUANT=qtype,
        Y_QUANTIZED=y_scale is not None, COPY=q_scale is not None, Z_SCALED=z_scale is not None,
        RELU=relu_in_quantize(act, y_scale is not None),
        BLOCK_H=bh, BLOCK_W=bw, BLOCK_N=bn, BLOCK_K=bk,
        PROGRAMS=n_programs, num_warps=config.num_warps, num_stages=config.num_stages)
    y = y.permute(0, 3, 1, 2)
    return y if q_scale is None else (y, q.permute(0, 3, 1, 2))
