"""2-D max pooling and global average pooling over channels-last tensors, one read of the input.

torch's channels-last max-pool kernel runs ResNet-50's stem pool (3x3, stride 2, on
[32, 64, 112, 112] FP16) at about 0.6 TB/s, 10% of the engine's time at batch 32. Here each
program owns a block of output pixels and a block of channels; a channels-last input makes
each pixel's channel slice one contiguous load. Padding reads as -inf; NaN propagates
(as torch's does). Any input strides; the output is [N, OH, OW, C] in memory, returned as an
NCHW-shaped view like the convolution kernels' output. With a scale and a qtype it writes the maxima as
int8 / FP8 values, the input of the quantized convolutions after it (ResNet's stem pool feeds two), which then
need no quantize pass. The result is theirs: the max of rounded values is the rounded max. For the same reason it
also reads 8-bit values at that scale (ResNet's 8-bit stem writes them) and writes their max as it is.

spatial_mean (below) is the global average pool of a squeeze-excite block, channels-last too.

Reference: kiln.ops.nn.max_pool; kiln.ops.nn.global_average_pool for spatial_mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemm import QTYPES, quantize
from .pdl import launch_options, start_after_previous


@triton.jit
def _max_pool_kernel(x_ptr, y_ptr, ys_ptr, C, H, W, OH, OW, P, sxn, sxc, sxh, sxw,
                     KH: tl.constexpr, KW: tl.constexpr, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                     QUANT: tl.constexpr, INT8_IN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                     PDL: tl.constexpr):
    start_after_previous(PDL)
    rp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixel (n, oh, ow) flattened
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok, c_ok = rp < P, rc < C
    ow = rp % OW
    oh = (rp // OW) % OH
    n = rp // (OW * OH)
    base = x_ptr + n * sxn
    if INT8_IN:  # int8 maxima as integers: converting each value to float is slower (docs/design/small-kernels.md)
        acc = tl.full((BLOCK_P, BLOCK_C), -128, tl.int32)
    else:
        acc = tl.full((BLOCK_P, BLOCK_C), float("-inf"), tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * stride_h - pad_h + kh * dil_h
        for kw in tl.static_range(KW):
            iw = ow * stride_w - pad_w + kw * dil_w
            ok = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            m = ok[:, None] & c_ok[None, :]
            src = (base + ih * sxh + iw * sxw)[:, None] + rc[None, :] * sxc
            # The window's padding chosen after the load: with an int8 load's `other` instead, some maxima at the
            # image's top row were wrong under Triton 3.6 (see docs/design/small-kernels.md)
            v = tl.load(src, mask=m)
            if INT8_IN:
                acc = tl.maximum(acc, tl.where(m, v.to(tl.int32), -128))
            else:
                acc = tl.maximum(acc, tl.where(m, v.to(tl.float32), float("-inf")), propagate_nan=tl.PropagateNan.ALL)
    if QUANT != "":  # from the input type's value, as the reference quantizes the pool's output
        acc = quantize(acc.to(x_ptr.dtype.element_ty), ys_ptr, QUANT)
    tl.store(y_ptr + rp[:, None] * C + rc[None, :], acc.to(y_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


def supports(node, x: torch.Tensor) -> bool:
    """2-D pooling of a float tensor, or of the 8-bit values of its qtype (attribute x_quantized), values only (no
    Indices output)."""
    dtypes = (QTYPES[node.attr("qtype", "int8")],) if node.attr("x_quantized", 0) else (
        torch.float16, torch.bfloat16, torch.float32)
    return (x.dim() == 4 and x.dtype in dtypes and x.numel() > 0
            and len(node.attr("kernel_shape") or []) == 2 and not (len(node.outputs) > 1 and node.outputs[1])
            and x.numel() < 2**31)


def max_pool2d(node, x: torch.Tensor, y_scale: torch.Tensor | None = None, qtype: str = "", block_p: int = 32,
               block_c: int = 64) -> torch.Tensor:
    """y_scale and qtype ("int8" / "fp8"): the output quantized with that per-tensor scale, unless x holds such
    values already (attribute x_quantized; the output is then their max, in their type)."""
    from ..ops.nn import _pool_geometry

    kernel, strides, dilations, pads, (OH, OW) = _pool_geometry(node, x)
    N, C, H, W = x.shape
    quant = qtype if y_scale is not None and not node.attr("x_quantized", 0) else ""
    y = torch.empty((N, OH, OW, C), dtype=QTYPES[quant] if quant else x.dtype, device=x.device)
    P = N * OH * OW
    block_c = min(block_c, triton.next_power_of_2(C))
    grid = (triton.cdiv(P, block_p), triton.cdiv(C, block_c))
    pdl = launch_options(x.device)
    _max_pool_kernel[grid](x, y, y_scale if quant else x, C, H, W, OH, OW, P, *x.stride(), KH=kernel[0],
                           KW=kernel[1], stride_h=strides[0], stride_w=strides[1], pad_h=pads[0], pad_w=pads[1],
                           dil_h=dilations[0], dil_w=dilations[1], QUANT=quant, INT8_IN=x.dtype == torch.int8,
                           BLOCK_P=block_p, BLOCK_C=block_c, PDL=bool(pdl), **pdl)
    return y.permute(0, 3, 1, 2)



# --- global average pooling ---------------------------------------------------------------------------------------
# A squeeze-excite block averages a whole feature map per channel (ReduceMean over H, W, or GlobalAveragePool).
# torch's reduction over the two inner axes of a channels-last tensor strides across the channels; here each
# program sums a block of channels of one image, reading a [pixels, channels] tile at a time (contiguous along
# the channels when x is channels-last), in FP32, and writes their mean once. A large map of few channels (an
# early 112x112 map of 32) gives a batch too few such programs to keep the GPU's memory busy: a split config
# then shares each image's pixels out over several programs, which write FP32 partial sums that a second, small
# kernel adds up.
@dataclass(frozen=True)
class MeanConfig:
    """block_c channels of one image per program, block_hw pixels a step; split: the pixels shared out over
    enough programs to give each SM two."""

    block_hw: int
    block_c: int
    num_warps: int
    split: bool = False

    @property
    def name(self) -> str:
        return f"hw{self.block_hw}_c{self.block_c}_w{self.num_warps}" + ("_split" if self.split else "")


# Narrow channel blocks give a 32-image batch of 16-96 channel early maps enough programs; wide ones suit the
# small late maps of many channels.
MEAN_CONFIGS = [MeanConfig(64, 64, 4), MeanConfig(128, 32, 4), MeanConfig(256, 16, 8), MeanConfig(64, 64, 4, True),
                MeanConfig(128, 32, 4, True)]


@triton.jit
def _spatial_mean_kernel(x_ptr, y_ptr, C, N, W, HW, chunk, sxn, sxc, sxh, sxw, inv_hw,
                         PARTIAL: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    n = tl.program_id(0)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    part = tl.program_id(2)
    c_ok = rc < C
    base = x_ptr + n * sxn + rc * sxc
    first = part * chunk
    end = tl.minimum(first + chunk, HW)
    acc = tl.zeros((BLOCK_HW, BLOCK_C), dtype=tl.float32)
    for start in range(first, end, BLOCK_HW):
        hw = start + tl.arange(0, BLOCK_HW)
        v = tl.load(base[None, :] + ((hw // W) * sxh + (hw % W) * sxw)[:, None],
                    mask=(hw < end)[:, None] & c_ok[None, :], other=0.0)
        acc += v.to(tl.float32)
    total = tl.sum(acc, axis=0)
    if PARTIAL:  # FP32 sums of this share of the pixels: [part, n, c]
        tl.store(y_ptr + (part * N + n) * C + rc, total, mask=c_ok)
    else:
        tl.store(y_ptr + n * C + rc, (total * inv_hw).to(y_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _sum_parts_kernel(p_ptr, y_ptr, NC, PARTS, inv_hw, BLOCK: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < NC
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for part in range(PARTS):
        acc += tl.load(p_ptr + part * NC + r, mask=ok, other=0.0)
    tl.store(y_ptr + r, (acc * inv_hw).to(y_ptr.dtype.element_ty), mask=ok)


def spatial_mean_supports(x: torch.Tensor) -> bool:
    """A non-empty 4-D float tensor of fewer than 2**31 elements."""
    return (x.dim() == 4 and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel() > 0
            and x.numel() < 2**31)


def _parts(config: MeanConfig, programs: int, hw: int, device: torch.device) -> int:
    """How many programs share one image's pixels: enough for two programs an SM, each at least a step's pixels."""
    if not config.split:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(hw, config.block_hw), triton.cdiv(2 * sms, programs)))


def spatial_mean(x: torch.Tensor, keepdim: bool = True, config: MeanConfig = MEAN_CONFIGS[0]) -> torch.Tensor:
    """x [N, C, H, W] averaged over H and W: [N, C, 1, 1] (keepdim) or [N, C], x's dtype."""
    N, C, H, W = x.shape
    y = torch.empty((N, C), dtype=x.dtype, device=x.device)
    block_c = min(config.block_c, max(16, triton.next_power_of_2(C)))
    grid = (N, triton.cdiv(C, block_c))
    parts = _parts(config, grid[0] * grid[1], H * W, x.device)
    chunk = triton.cdiv(triton.cdiv(H * W, parts), config.block_hw) * config.block_hw  # whole steps a program
    parts = triton.cdiv(H * W, chunk)
    out = torch.empty((parts, N, C), dtype=torch.float32, device=x.device) if parts > 1 else y
    pdl = launch_options(x.device)
    _spatial_mean_kernel[(*grid, parts)](
        x, out, C, N, W, H * W, chunk, *x.stride(), 1.0 / (H * W), PARTIAL=parts > 1, BLOCK_HW=config.block_hw,
        BLOCK_C=block_c, PDL=bool(pdl), num_warps=config.num_warps, **pdl)
    if parts > 1:
        _sum_parts_kernel[(triton.cdiv(N * C, 1024),)](out, y, N * C, parts, 1.0 / (H * W), BLOCK=1024,
                                                      PDL=bool(pdl), num_warps=4, **pdl)
    return y.view(N, C, 1, 1) if keepdim else y
