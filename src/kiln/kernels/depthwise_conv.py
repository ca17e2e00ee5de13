"""Depthwise 2-D convolution written channels-last, with the layer's epilogue: y = act(dwconv(x, w) + b + z).

A depthwise layer (group == C == OC: MobileNet's and EfficientNet's 3x3 / 5x5 per-channel filters) has no
reduction over channels, so it is no GEMM: each output element is a sum over the KH x KW taps of one input
channel. It is memory-bound. Each program owns a block of output pixels (n, oh, ow flattened) by a block of
channels; for each tap it loads a [pixels, channels] tile of x, contiguous along the channels when x is
channels-last (any strides are read), and multiplies it by that tap's weight per channel. The sum stays in
FP32; bias, residual and activation are applied before the single store, so the activation costs no pass
of its own (torch's cuDNN depthwise kernels leave SiLU / HardSwish to a separate kernel). The output is
[N, OH, OW, C] in memory, returned as an NCHW-shaped view like the other convolution kernels'.

Reference: kiln.ops.fused.fused_conv (kiln.ops.nn.conv for an ONNX Conv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemm import ACTIVATIONS, _params, epilogue
from .pdl import launch_options, start_after_previous

_INT32_MAX = 2**31 - 1
MAX_TAPS = 49  # 7x7 filters at most: the tap loop is unrolled


@dataclass(frozen=True)
class DepthwiseConfig:
    """block_p output pixels by block_c channels per program."""

    block_p: int
    block_c: int
    num_warps: int

    @property
    def name(self) -> str:
        return f"p{self.block_p}_c{self.block_c}_w{self.num_warps}"


# Wide channel blocks for the wide late layers, narrow ones (more pixels a program) for the 16-32 channel early
# ones; the builder times each against cuDNN's kernels. The 1024-element tiles are for the small late layers (7x7
# and 14x14 maps of 5x5 filters), whose time is the latency of their taps' loads more than bandwidth: smaller
# programs, more of them to interleave on each SM.
CONFIGS = [
    DepthwiseConfig(32, 64, 4),
    DepthwiseConfig(16, 128, 4),
    DepthwiseConfig(64, 32, 4),
    DepthwiseConfig(128, 16, 4),
    DepthwiseConfig(16, 64, 4),
    DepthwiseConfig(8, 128, 4),
]


@triton.jit
def _depthwise_kernel(x_ptr, w_ptr, b_ptr, z_ptr, y_ptr, C, H, W, OH, OW, P,
                      sxn, sxc, sxh, sxw, swc, swh, sww, szn, szc, szh, szw,
                      stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, p0, p1,
                      KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr,
                      ACT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    rp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixel (n, oh, ow) flattened
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok, c_ok = rp < P, rc < C
    ow = rp % OW
    oh = (rp // OW) % OH
    n = rp // (OW * OH)
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    x_base = x_ptr + n * sxn
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for kh in tl.static_range(KH):
        ih = ih0 + kh * dil_h
        row_ok = p_ok & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = iw0 + kw * dil_w
            ok = row_ok & (iw >= 0) & (iw < W)
            v = tl.load((x_base + ih * sxh + iw * sxw)[:, None] + rc[None, :] * sxc,
                        mask=ok[:, None] & c_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + rc * swc + kh * swh + kw * sww, mask=c_ok, other=0.0)
            acc += v.to(tl.float32) * wt.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rc, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    mask = p_ok[:, None] & c_ok[None, :]
    if HAS_Z:
        z = tl.load(z_ptr + (n * szn + oh * szh + ow * szw)[:, None] + rc[None, :] * szc, mask=mask, other=0.0)
        acc += z.to(tl.float32)
    acc = epilogue(acc, ACT, p0, p1)
    tl.store(y_ptr + rp[:, None] * C + rc[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def is_depthwise(node, x: torch.Tensor, w: torch.Tensor) -> bool:
    """A 2-D convolution with one filter per input channel (group == C == OC, w [C, 1, KH, KW])."""
    return (x.dim() == 4 and w.dim() == 4 and node.attr("group", 1) == x.shape[1] == w.shape[0] > 1
            and w.shape[1] == 1)


def supports(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None) -> bool:
    """A depthwise 2-D convolution (is_depthwise) of same-dtype 16-bit or FP32 x and w, filters of at most
    MAX_TAPS taps, an activation the epilogue computes, a residual broadcastable to the output."""
    from .conv import epilogue_out_shape

    if not is_depthwise(node, x, w) or node.attr("activation", "") not in ACTIVATIONS:
        return False
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or w.dtype != x.dtype:
        return False
    if x.device != w.device or x.numel() == 0 or w.shape[2] * w.shape[3] > MAX_TAPS:
        return False
    if z is not None and not z.dtype.is_floating_point:
        return False
    out_shape = epilogue_out_shape(node, x, w, b, z)
    if out_shape is None:
        return False
    return max(x.numel(), out_shape[0] * out_shape[1] * out_shape[2] * out_shape[3]) <= _INT32_MAX


def conv2d(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, z: torch.Tensor | None = None,
           config: DepthwiseConfig = CONFIGS[0]) -> torch.Tensor:
    """act(depthwise conv2d(x, w) + b + z) with the node's ONNX attributes, for a `supports` layer; a
    channels-last output of x's dtype."""
    from .conv import geometry

    strides, dilations, pads, (OH, OW) = geometry(node, x, w)
    N, C, H, W = x.shape
    KH, KW = w.shape[2], w.shape[3]
    act = node.attr("activation", "")
    p0, p1 = _params(act, node.attr("activation_params", []))
    if b is not None:
        b = b.reshape(-1)
        if b.stride(0) != 1 or b.dtype != x.dtype:
            b = b.to(x.dtype).contiguous()
    if z is not None:
        z = z.expand(N, C, OH, OW)
    y = torch.empty((N, OH, OW, C), dtype=x.dtype, device=x.device)
    P = N * OH * OW
    block_c = min(config.block_c, max(16, triton.next_power_of_2(C)))
    grid = (triton.cdiv(P, config.block_p), triton.cdiv(C, block_c))
    pdl = launch_options(x.device)
    _depthwise_kernel[grid](
        x, w, b if b is not None else w, z if z is not None else w, y, C, H, W, OH, OW, P,
        *x.stride(), w.stride(0), w.stride(2), w.stride(3), *(z.stride() if z is not None else (0, 0, 0, 0)),
        strides[0], strides[1], pads[0], pads[1], dilations[0], dilations[1], p0, p1,
        KH=KH, KW=KW, HAS_BIAS=b is not None, HAS_Z=z is not None, ACT=act,
        BLOCK_P=config.block_p, BLOCK_C=block_c, PDL=bool(pdl), num_warps=config.num_warps, **pdl)
    return y.permute(0, 3, 1, 2)
