"""Warp-specialized 8-bit convolution for Hopper, written in Gluon (Triton's lower-level language).

The implicit GEMM of tma_conv.py with the same TMA boxes: per filter tap and channel block one [1, BH, BW, BK]
box of the NHWC input, shifted by the tap, zeros past the image as the padding (a stride-2 window is a box of
the [N, H/2, 2, W/2, 2C] view). What differs is what Triton's compiler would not do for tma_conv's loops
(bench/sm90_compile.py): here a one-warp loader partition fills a ring of shared-memory stages by TMA and runs
ahead into the next output tile, while a 4-warp partition reads each box as the wgmma's left tile straight from
shared memory (a reshaped view, not through registers), keeps one 8-bit wgmma in flight, and runs the epilogue.
Nsight Compute found tma_conv latency-bound, its Tensor Cores mostly idle (see docs/design/gluon-kernels.md).

The epilogue is gemm.finish's arithmetic for this case (x_scale * w_scale[oc], bias, the ReLU and the next layer's
8-bit quantization, warp_specialized.quantize8), with 1 / y_scale folded into the column vectors: the same codes
as tma_conv's but where a value sits at a rounding tie (then one step away). It runs ResNet-50's 3x3 layers a
quarter to a third faster than tma_conv; at 64 channels only when it keeps its weights in shared memory
(WsConfig.resident_weights).

Takes: a QConv (INT8 or FP8) with an 8-bit output, ReLU or no activation, any bias, no residual and no 8-bit
copy; stride 1 or 2, dilation 1, C a whole number of K tiles, OC of output-channel tiles; a Hopper GPU
(wgmma is sm_90's). Triton's interpreter does not run Gluon: CI compiles these kernels for sm_90
(tests/kernels/test_gluon_compile.py) and the GPU tests (tests/kernels/test_ws_conv.py) compare them with
tma_conv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .gemm import QTYPES, quant_args
from .pdl import launch_options
from .tma_conv import MAX_PAD, PatchConfig, block_k_for, filter_rows, nhwc
from .warp_specialized import (
    LOADER_REGS,
    MAXNREG,
    accumulator_dtype,
    accumulator_layout,
    box_descriptor,
    box_fits,
    let_next_kernel_start,
    load_resident,
    mma_steps,
    quantize8,
    ring_barriers,
    store8,
    wait_for_previous_kernel,
)

_MAX_PAD = gl.constexpr(MAX_PAD)


@dataclass(frozen=True)
class WsConfig:
    """An output tile of block_h x block_w pixels by block_n channels, K walked block_k channels at a time
    (C itself where smaller), a ring of `stages` shared-memory stages, `per_sm` programs an SM. resident_weights:
    every weight tile loaded once a program and kept (layers whose OC is one tile and whose filter fits
    RESIDENT_BYTES: ResNet's 64-channel 3x3s), so the ring carries only input boxes."""

    block_h: int
    block_w: int
    block_n: int
    block_k: int
    stages: int
    per_sm: int
    resident_weights: bool = False

    @property
    def name(self) -> str:
        name = f"{self.block_h}x{self.block_w}x{self.block_n}x{self.block_k}_s{self.stages}_x{self.per_sm}"
        return name + "_rw" * self.resident_weights

    @property
    def patch(self) -> PatchConfig:
        """The same tile as tma_conv states it (its support checks and K-tile rule apply here unchanged)."""
        return PatchConfig(self.block_h, self.block_w, self.block_n, self.block_k, 4, self.stages)

    def smem_bytes(self, channels: int, taps: int) -> int:
        """At a layer of `channels` input channels and `taps` filter taps that `supports` takes: the ring of 8-bit
        input boxes and weight tiles (or the resident weights), the 8-bit output tile and the barriers."""
        block_k = block_k_for(self.patch, channels, True)  # the K tile conv2d walks
        k_tiles = taps * (channels // block_k)
        pixels = self.block_h * self.block_w
        weights = k_tiles * self.block_n * block_k if self.resident_weights else self.stages * self.block_n * block_k
        return self.stages * (pixels * block_k + 16) + weights + 8 + pixels * self.block_n


RESIDENT_BYTES = 64 * 1024  # the most weight bytes a program keeps (a 3x3 64 -> 64 filter is 36 KB)


# (config, lowest optimization level that offers it): each the fastest at one of ResNet-50's 3x3 stages; the
# 64-channel tiles are for 64 -> 64 3x3s (K tiles of 64: C itself), where resident weights win (see
# docs/design/gluon-kernels.md).
CONFIGS: list[tuple[WsConfig, int]] = [
    (WsConfig(8, 8, 128, 128, 4, 2), 3),
    (WsConfig(8, 16, 128, 128, 3, 2), 3),
    (WsConfig(16, 8, 128, 128, 4, 1), 3),
    (WsConfig(8, 16, 64, 128, 4, 2), 3),
    (WsConfig(16, 16, 64, 128, 3, 1), 3),
    (WsConfig(8, 16, 64, 128, 4, 2, True), 3),
    (WsConfig(16, 16, 64, 128, 3, 2, True), 3),
]


@gluon.jit
def _tile(tile, tiles_w, tiles_hw, tiles_n, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr):
    """(image, first output row, first output column, first channel) of output tile `tile`. Channel tiles of one
    patch are neighbours: they share the patch's input boxes in L2 (as in tma_conv)."""
    patch = tile // tiles_n
    return (patch // tiles_hw, (patch % tiles_hw) // tiles_w * BLOCK_H, (patch % tiles_w) * BLOCK_W,
            (tile % tiles_n) * BLOCK_N)


@gluon.jit
def _loader(x_desc, w_desc, a_bufs, b_bufs, ready, empty, w_ready, tiles, tiles_w, tiles_hw, tiles_n, C, KW,
            k_tiles, pad_h, pad_w, programs, STRIDE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
            STAGES: gl.constexpr, W_RESIDENT: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    c_blocks = C // BLOCK_K
    wait_for_previous_kernel()  # x (and, as far as this kernel knows, w) may be its outputs
    if W_RESIDENT:
        load_resident(w_desc, b_bufs, w_ready)
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img, oh0, ow0, off_n = _tile(tile, tiles_w, tiles_hw, tiles_n, BLOCK_H, BLOCK_W, BLOCK_N)
        for kb in range(k_tiles):
            tap = kb // c_blocks
            c0 = (kb % c_blocks) * BLOCK_K
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
            if W_RESIDENT:
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            if STRIDE == 1:  # the box shifted by the tap; rows and columns past the image read zeros
                tma.async_copy_global_to_shared(x_desc, [img, oh0 + tap // KW - pad_h, ow0 + tap % KW - pad_w, c0],
                                                ready.index(s), a_bufs.index(s))
            else:  # the [N, H/S, S, W/S, S*C] view (tma_conv's); offsets made non-negative before // and %
                dh = tap // KW - pad_h + STRIDE * _MAX_PAD
                dw = tap % KW - pad_w + STRIDE * _MAX_PAD
                tma.async_copy_global_to_shared(
                    x_desc, [img, oh0 + dh // STRIDE - _MAX_PAD, dh % STRIDE, ow0 + dw // STRIDE - _MAX_PAD,
                             dw % STRIDE * C + c0], ready.index(s), a_bufs.index(s))
            if not W_RESIDENT:
                tma.async_copy_global_to_shared(w_desc, [off_n, tap * C + c0], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _mma_epilogue(y_desc, a_bufs, b_bufs, ready, empty, w_ready, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles,
                  tiles_w, tiles_hw, tiles_n, k_tiles, stride_ws, programs, QUANT: gl.constexpr,
                  HAS_BIAS: gl.constexpr, RELU: gl.constexpr, STAGES: gl.constexpr, W_RESIDENT: gl.constexpr,
                  num_warps: gl.constexpr):
    BLOCK_H: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_W: gl.constexpr = y_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = BLOCK_H * BLOCK_W
    acc_layout: gl.constexpr = accumulator_layout(BLOCK_N, num_warps)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    wait_for_previous_kernel()  # the scales and bias are read straight from global memory
    inv_ys = 1.0 / gl.load(ys_ptr).to(gl.float32)
    xs_y = gl.load(xs_ptr).to(gl.float32) * inv_ys
    if W_RESIDENT:
        mbarrier.wait(w_ready, 0)
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img, oh0, ow0, off_n = _tile(tile, tiles_w, tiles_hw, tiles_n, BLOCK_H, BLOCK_W, BLOCK_N)
        cols = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
        scale = xs_y * gl.load(ws_ptr + cols * stride_ws).to(gl.float32)  # loaded while the loader fills the ring
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=accumulator_dtype(QUANT), layout=acc_layout)
        acc, it = mma_steps(acc, a_bufs, b_bufs, ready, empty, it, k_tiles, STAGES, B_RESIDENT=W_RESIDENT)
        v = acc.to(gl.float32) * scale[None, :]
        if HAS_BIAS:
            v = v + (gl.load(b_ptr + cols).to(gl.float32) * inv_ys)[None, :]
        out = quantize8(v, QUANT, RELU)
        tma.store_wait(pendings=0)  # the last tile's store has read y_smem
        store8(y_smem.reshape([BLOCK_M, BLOCK_N]), out)
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [img, oh0, ow0, off_n], y_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_conv_kernel(x_desc, w_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, N, OH, OW, OC, C, KW, k_tiles,
                    pad_h, pad_w, stride_ws, programs, STRIDE: gl.constexpr, QUANT: gl.constexpr,
                    HAS_BIAS: gl.constexpr, RELU: gl.constexpr, STAGES: gl.constexpr, W_TILES: gl.constexpr,
                    num_warps: gl.constexpr):
    """W_TILES > 0: the filter's W_TILES K tiles stay in shared memory (WsConfig.resident_weights), 0: they come
    through the ring with the input boxes."""
    let_next_kernel_start()
    BLOCK_H: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_W: gl.constexpr = y_desc.block_type.shape[2]
    tiles_w = gl.cdiv(OW, BLOCK_W)
    tiles_hw = gl.cdiv(OH, BLOCK_H) * tiles_w
    tiles_n = gl.cdiv(OC, y_desc.block_type.shape[3])
    tiles = N * tiles_hw * tiles_n
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    W_RESIDENT: gl.constexpr = W_TILES > 0
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [W_TILES if W_RESIDENT else STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready, empty = ring_barriers(STAGES)
    w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(w_ready, count=1)
    gl.warp_specialize([
        (_mma_epilogue, (y_desc, a_bufs, b_bufs, ready, empty, w_ready, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles,
                         tiles_w, tiles_hw, tiles_n, k_tiles, stride_ws, programs, QUANT, HAS_BIAS, RELU, STAGES,
                         W_RESIDENT, num_warps)),
        (_loader, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, w_ready, tiles, tiles_w, tiles_hw, tiles_n, C, KW,
                   k_tiles, pad_h, pad_w, programs, STRIDE, BLOCK_H, BLOCK_W, STAGES, W_RESIDENT)),
    ], [1], [LOADER_REGS])


def supports(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None,
             y_scale, q_scale, config: WsConfig) -> bool:
    """A QConv tma_conv takes with this tile, with an 8-bit output (y_scale), ReLU or no activation, no residual
    and no 8-bit copy, OC a whole number of output-channel tiles; on a Hopper GPU."""
    if not layer_ok(node, x, w, b, z, y_scale, q_scale, config):
        return False
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9


def layer_ok(node, x, w, b, z, y_scale, q_scale, config: WsConfig) -> bool:
    """`supports` but for the device: what the layer and its tensors must be."""
    from .tma_conv import supports as tma_conv_supports

    qtype = node.attr("qtype", "int8") if node.op_type == "QConv" else ""
    if qtype not in QTYPES or y_scale is None or q_scale is not None or z is not None:
        return False
    if node.attr("activation", "") not in ("", "Relu") or w.dim() != 4 or w.shape[0] % config.block_n:
        return False
    if config.resident_weights and (w.shape[0] != config.block_n or w[0].numel() * config.block_n > RESIDENT_BYTES):
        return False
    bk = block_k_for(config.patch, w.shape[1], True)
    if bk is None or not box_fits(bk) or not box_fits(config.block_n):  # the boxes' rows: bk and block_n bytes
        return False
    return tma_conv_supports(node, x, w, b, None, config.patch, qtype)


def conv2d(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: WsConfig,
           x_scale: torch.Tensor, w_scale: torch.Tensor, y_scale: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """The 8-bit output of a `supports` QConv, as tma_conv.conv2d computes it: channels-last, as an NCHW-shaped
    view. pdl=False launches it without programmatic dependent launch (kernels/pdl.py)."""
    from .conv import geometry
    from .tma_gemm import programs as sm_count

    qtype = node.attr("qtype", "int8")
    strides, _, pads, (OH, OW) = geometry(node, x, w)
    N, C = x.shape[:2]
    OC, KH, KW = w.shape[0], w.shape[2], w.shape[3]
    x, xs, ws, stride_ws = quant_args(x, qtype, x_scale, w_scale)
    bh, bw, bn, bk = config.block_h, config.block_w, config.block_n, block_k_for(config.patch, C, True)
    y = torch.empty((N, OH, OW, OC), dtype=QTYPES[qtype], device=x.device)
    S = strides[0]
    rows = nhwc(x)
    if S > 1:  # [N, H, W, C] as [N, H/S, S, W/S, S*C]: a stride-S window is a box of this view
        rows = rows.reshape(N, rows.shape[1] // S, S, rows.shape[2] // S, S * C)
    x_box = [1, bh, bw, bk] if S == 1 else [1, bh, 1, bw, bk]
    w_rows = filter_rows(w)

    k_tiles = KH * KW * (C // bk)
    tiles = N * triton.cdiv(OH, bh) * triton.cdiv(OW, bw) * (OC // bn)
    n_programs = min(tiles, config.per_sm * sm_count(x.device))
    bias = b.reshape(-1).contiguous() if b is not None else None
    _ws_conv_kernel[(n_programs,)](
        box_descriptor(rows, x_box), box_descriptor(w_rows, [bn, bk]), box_descriptor(y, [1, bh, bw, bn]),
        bias if bias is not None else xs, xs, ws, y_scale, N, OH, OW, OC, C, KW, k_tiles,
        pads[0], pads[1], stride_ws, n_programs, STRIDE=S, QUANT=qtype, HAS_BIAS=bias is not None,
        RELU=node.attr("activation", "") == "Relu", STAGES=config.stages,
        W_TILES=k_tiles if config.resident_weights else 0, num_warps=4, maxnreg=MAXNREG,
        **launch_options(x.device, pdl))
    return y.permute(0, 3, 1, 2)
