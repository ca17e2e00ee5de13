"""Split-K implicit-GEMM convolution: y = act(sum_s p[s] + b + z), p[s] the convolution over slice s of K.

ResNet-50's late 3x3 convolutions at batch 1 have few output pixels (M = N*OH*OW = 49 or 196) and
deep reductions (K = KH*KW*C = 4608 or 2304): 64x64 output tiles give conv.py's kernel 8-16 programs
on a GPU of 132 SMs, each streaming all of K. Here every (pixel tile, channel tile, slice) program
walks 1/S of K's iterations (conv.py's two walks: by (kh, kw, channel block), or flat for small C)
and adds its FP32 partial product into a zeroed FP32 sum [M, OC] with atomics. The last of a tile's S
programs to arrive (a per-tile counter) applies bias, residual z (broadcastable to the output, read
through its strides) and the activation to the sum before the single store, so the layer is one
kernel: at batch 1 a second reduction kernel costs about as much as the split saves, and a last
program summing S stored partials itself is slower still (see docs/design/tactic-levels.md). That
program also zeroes the tile's sum and counter for
the next call. The atomics make the FP32 summation order vary from run to run (results differ in the
last bits, as with any atomic split-K). S is the configuration's slice count, lowered so that no
slice is empty.

Float convolutions only (FP16/BF16 on Tensor Cores; FP32 exact or TF32 as the layer's precision says),
groups == 1; the output is channels-last ([N, OH, OW, OC] in memory, an NCHW-shaped view), as conv2d's.
Reference: conv.reference (kiln.ops.fused.fused_conv in FP32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import conv
from .gemm import dot_precision, epilogue
from .splitk_gemm import SplitKConfig
from .workspace import add_part, zeroed_workspace

_INT32_MAX = 2**31 - 1


@triton.jit
def _splitk_conv_kernel(x_ptr, w_ptr, b_ptr, z_ptr, y_ptr, sum_ptr, count_ptr, C, H, W, OC, OH, OW, M, KW, KTOT,
                        iters, per_slice, S, sxn, sxc, sxh, sxw, swo, swc, swh, sww, szn, szc, szh, szw,
                        stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, p0, p1,
                        HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
                        FLAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm, rn, oc, n, oh, ow, ih0, iw0 = conv.conv_tile(pid_m, pid_n, M, OC, OH, OW, stride_h, stride_w, pad_h, pad_w,
                                                     BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_base = x_ptr + n * sxn
    w_base = w_ptr + oc * swo
    c_blocks = tl.cdiv(C, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * per_slice
    for it in range(first, tl.minimum(first + per_slice, iters)):  # this slice's K iterations
        a, b = conv.k_tiles(x_base, w_base, it, ih0, iw0, rk, C, H, W, KW, KTOT, c_blocks, sxc, sxh, sxw, swc, swh,
                            sww, dil_h, dil_w, FLAT)
        acc = tl.dot(a, b, acc, input_precision=PREC)

    offs = rm[:, None] * OC + rn[None, :]  # the sum's and y's (channels-last) offset of each tile element
    inside = (rm[:, None] < M) & (rn[None, :] < OC)
    acc, last = add_part(acc, sum_ptr + offs, inside, count_ptr + pid_m * tl.num_programs(1) + pid_n, S)
    if last:  # the last slice in: the sum is complete
        if HAS_BIAS:
            acc += tl.load(b_ptr + oc).to(tl.float32)[None, :]
        if HAS_Z:
            acc += tl.load(z_ptr + (n * szn + oh * szh + ow * szw)[:, None] + (oc * szc)[None, :]).to(tl.float32)
        acc = epilogue(acc, ACT, p0, p1)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=inside)


# ResNet-50 at batch 1, 64x64 tiles: layer4's 3x3 (M = 49, OC = 512, 72 K iterations of 64 channels) has
# 8 output tiles, layer3's (M = 196, OC = 256, 36 iterations) 16; 4-16 slices make 32-224 programs. Only
# configurations the builder chooses are offered: each is a Triton compile in a cold build (see
# docs/design/tactic-levels.md).
CONFIGS = (SplitKConfig(4, 64, 64, 64), SplitKConfig(8, 64, 64, 64), SplitKConfig(16, 64, 64, 64))


def supports(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None,
             config: SplitKConfig) -> bool:
    """conv.supports' float convolutions (no quantized weights) whose partials [slices, M, OC] int32 offsets reach."""
    if not conv.supports(node, x, w, b, z):
        return False
    oh, ow = conv.geometry(node, x, w)[3]
    return config.slices * x.shape[0] * oh * ow * w.shape[0] <= _INT32_MAX


def k_iterations(config: SplitKConfig, w: torch.Tensor) -> int:
    """The K walk's iteration count for weights [OC, C, KH, KW]: (kh, kw, channel block)s, or flat K blocks."""
    _, c, kh, kw = w.shape
    block_k, flat = conv.block_k_for(config, c)
    return triton.cdiv(kh * kw * c, block_k) if flat else kh * kw * triton.cdiv(c, block_k)


def slicing(iters: int, slices: int) -> tuple[int, int]:
    """(iterations per slice, slice count): cdiv(iters, slices) iterations each, and only as many slices as
    that takes, so none is empty (10 iterations over 8 slices: 5 slices of 2)."""
    per_slice = triton.cdiv(iters, slices)
    return per_slice, triton.cdiv(iters, per_slice)


def conv2d_splitk(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                  z: torch.Tensor | None = None, config: SplitKConfig = CONFIGS[0]):
    """act(conv2d(x, w) + b + z) with the node's ONNX attributes, K split over config.slices programs per
    output tile; channels-last output of x's dtype, as conv.conv2d returns it."""
    strides, dilations, pads, (OH, OW) = conv.geometry(node, x, w)
    N, C, H, W = x.shape
    OC, _, KH, KW = w.shape
    M = N * OH * OW
    block_k, flat = conv.block_k_for(config, C)
    iters = k_iterations(config, w)
    per_slice, slices = slicing(iters, config.slices)
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(OC, config.block_n), slices)
    y = torch.empty((N, OH, OW, OC), dtype=x.dtype, device=x.device)
    total, counters = zeroed_workspace(x.device, M * OC, grid[0] * grid[1])
    act, p0, p1, b, z, zs = conv.epilogue_operands(node, b, z, (N, OC, OH, OW))
    _splitk_conv_kernel[grid](
        x, w, b if b is not None else total, z if z is not None else total, y, total, counters,
        C, H, W, OC, OH, OW, M, KW, KH * KW * C, iters, per_slice, slices,
        *x.stride(), *w.stride(), *zs, strides[0], strides[1], pads[0], pads[1], dilations[0], dilations[1], p0, p1,
        HAS_BIAS=b is not None, HAS_Z=z is not None, ACT=act, PREC=dot_precision(x.dtype, node.precision), FLAT=flat,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y.permute(0, 3, 1, 2)
