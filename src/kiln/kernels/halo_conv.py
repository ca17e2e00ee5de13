"""Row-halo 8-bit 3x3 convolution for Hopper, written in Gluon: the 64 -> 64-channel, stride-1, pad-1 layers of
images at most 64 pixels wide (ResNet's layer1 at 224 x 224: 56 x 56).

ws_conv (kernels/ws_conv.py) loads one input box per filter tap, so a tile's input comes from L2 nine times. Here
a program's tile is two whole output rows, and per filter column dx the loader brings one [1, 4, 64, 64] box: the
two rows and their halo rows above and below, shifted by dx - 1 (TMA fills what lies past the image with zeros:
the padding). The MMA warpgroup multiplies output row r by the box's row r + dy, a 64-row slice of the reshaped
box, for each dy, into one accumulator per output row (a Gluon shared-memory slice must start at a multiple of its
own size, so the two rows at an odd offset cannot be one 128-row left tile). Three 16 KB boxes a tile instead of
nine 8 KB ones for ws_conv's 8x16 tile, which also wastes an eighth of its pixels at W = 56; the filter (36 KB)
stays in shared memory.

It beats ws_conv and tma_conv at ResNet-50's layer1 3x3s (see docs/design/gluon-kernels.md). INT8 outputs equal
tma_conv's; FP8 ones are at most one FP8 step away (the taps are summed in another order, and Hopper's FP8 wgmma
rounds its partial sums).

The epilogue is gemm.finish's arithmetic for this case (x_scale * w_scale[oc], bias, the ReLU and the 8-bit
output, warp_specialized.quantize8), with 1 / y_scale folded into the column vectors as ws_gemm does. Triton's
interpreter does not run Gluon: CI compiles the kernel for sm_90 (tests/kernels/test_gluon_compile.py) and the GPU
tests (tests/kernels/test_halo_conv.py) compare it with tma_conv.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gemm import QTYPES, columns, quant_args
from .pdl import launch_options
from .tma_conv import PatchConfig, filter_rows, nhwc
from .warp_specialized import (
    LOADER_REGS,
    MAXNREG,
    accumulator_dtype,
    accumulator_layout,
    box_descriptor,
    let_next_kernel_start,
    load_resident,
    quantize8,
    ring_barriers,
    store8,
    wait_for_previous_kernel,
)

ROWS, WIDTH, CHANNELS = 2, 64, 64  # output rows a tile, pixels a row (one wgmma's M), channels in and out
STAGES = 3  # ring stages, a box each: one tile's three filter columns
PER_SM = 1  # programs an SM (two ran no faster)


@gluon.jit
def _loader(x_desc, w_desc, a_bufs, w_res, ready, empty, w_ready, tiles, tiles_h, programs):
    """The filter once (tap dy * 3 + dx is K tile dy * 3 + dx), then per tile and filter column dx the box of
    the tile's rows and their halo, shifted by dx - 1."""
    HALO: gl.constexpr = x_desc.block_type.shape[1]
    S: gl.constexpr = a_bufs.type.shape[0]
    wait_for_previous_kernel()  # x (and, as far as this kernel knows, w) may be its outputs
    load_resident(w_desc, w_res, w_ready)
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img = tile // tiles_h
        oh0 = (tile % tiles_h) * (HALO - 2)
        for dx in gl.static_range(3):
            s = it % S
            mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)  # a fresh barrier passes the first round
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [img, oh0 - 1, dx - 1, 0], ready.index(s), a_bufs.index(s))
            it += 1


@gluon.jit
def _requantize(acc, scale, bias, HAS_BIAS: gl.constexpr, QUANT: gl.constexpr, RELU: gl.constexpr):
    """An output row's 8-bit codes (quantize8's pairs): the accumulator scaled (x_scale * w_scale[oc] / y_scale),
    plus the bias / y_scale, the ReLU."""
    v = acc.to(gl.float32) * scale[None, :]
    if HAS_BIAS:
        v = v + bias[None, :]
    return quantize8(v, QUANT, RELU)


@gluon.jit
def _mma_epilogue(y_desc, a_bufs, w_res, ready, empty, w_ready, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles,
                  tiles_h, stride_ws, programs, QUANT: gl.constexpr, HAS_BIAS: gl.constexpr, RELU: gl.constexpr,
                  num_warps: gl.constexpr):
    W: gl.constexpr = y_desc.block_type.shape[2]
    N: gl.constexpr = y_desc.block_type.shape[3]
    S: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = accumulator_layout(N, num_warps)
    wait_for_previous_kernel()  # the scales and bias are read straight from global memory
    scale, bias = columns(gl.arange(0, N, layout=gl.SliceLayout(0, acc_layout)), b_ptr, xs_ptr, ws_ptr, stride_ws,
                          HAS_BIAS, QUANT)
    inv_ys = 1.0 / gl.load(ys_ptr).to(gl.float32)
    scale = scale * inv_ys
    bias = bias * inv_ys
    ACC: gl.constexpr = accumulator_dtype(QUANT)
    mbarrier.wait(w_ready, 0)
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img = tile // tiles_h
        oh0 = (tile % tiles_h) * 2
        acc0 = gl.zeros((W, N), dtype=ACC, layout=acc_layout)  # output row oh0
        acc1 = gl.zeros((W, N), dtype=ACC, layout=acc_layout)  # output row oh0 + 1
        for dx in gl.static_range(3):
            s = it % S
            mbarrier.wait(ready.index(s), (it // S) & 1)
            # [4 * W, C]: input rows oh0 - 1 .. oh0 + 2 shifted by dx - 1, a row's W pixels a W-row slice
            box = a_bufs.index(s).reshape([4 * W, a_bufs.type.shape[4]])
            for dy in gl.static_range(3):
                w = w_res.index(dy * 3 + dx).permute((1, 0))
                acc0 = warpgroup_mma(box.slice(dy * W, W), w, acc0, is_async=True)
                acc1 = warpgroup_mma(box.slice((dy + 1) * W, W), w, acc1, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index(s))
            it += 1
        out0 = _requantize(acc0, scale, bias, HAS_BIAS, QUANT, RELU)
        out1 = _requantize(acc1, scale, bias, HAS_BIAS, QUANT, RELU)
        tma.store_wait(pendings=0)  # the last tile's store has read y_smem
        rows = y_smem.reshape([2 * W, N])
        store8(rows, out0)
        store8(rows, out1, W)
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [img, oh0, 0, 0], y_smem)  # the store clips rows and columns past y
    tma.store_wait(pendings=0)


@gluon.jit
def _halo_conv_kernel(x_desc, w_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, N, OH, stride_ws, programs,
                      QUANT: gl.constexpr, HAS_BIAS: gl.constexpr, RELU: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    let_next_kernel_start()
    tiles_h = gl.cdiv(OH, 2)
    tiles = N * tiles_h
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_res = gl.allocate_shared_memory(w_desc.dtype, [9] + w_desc.block_type.shape, w_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready, empty = ring_barriers(STAGES)
    w_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(w_ready, count=1)
    gl.warp_specialize([
        (_mma_epilogue, (y_desc, a_bufs, w_res, ready, empty, w_ready, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles,
                         tiles_h, stride_ws, programs, QUANT, HAS_BIAS, RELU, num_warps)),
        (_loader, (x_desc, w_desc, a_bufs, w_res, ready, empty, w_ready, tiles, tiles_h, programs)),
    ], [1], [LOADER_REGS])


def smem_bytes() -> int:
    """The ring of input boxes, the resident filter, the output tile and the barriers."""
    return STAGES * ((ROWS + 2) * WIDTH * CHANNELS + 16) + 9 * CHANNELS * CHANNELS + ROWS * WIDTH * CHANNELS + 8


def supports(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None,
             y_scale, q_scale) -> bool:
    """A QConv this kernel takes (layer_ok), on a Hopper GPU."""
    if not layer_ok(node, x, w, b, z, y_scale, q_scale):
        return False
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9


def layer_ok(node, x, w, b, z, y_scale, q_scale) -> bool:
    """`supports` but for the device: an INT8 or FP8 QConv with an 8-bit output, ReLU or no activation, any bias,
    no residual and no 8-bit copy; 3x3, stride 1, pad 1, 64 -> 64 channels, at most 64 pixels wide; channels-last
    operands TMA can address (tma_conv's checks)."""
    from .conv import geometry
    from .tma_conv import supports as tma_conv_supports

    qtype = node.attr("qtype", "int8") if node.op_type == "QConv" else ""
    if qtype not in QTYPES or y_scale is None or q_scale is not None or z is not None:
        return False
    if node.attr("activation", "") not in ("", "Relu") or w.dim() != 4 or x.dim() != 4:
        return False
    if tuple(w.shape) != (CHANNELS, CHANNELS, 3, 3) or x.shape[3] > WIDTH:
        return False
    geo = geometry(node, x, w)
    if geo is None or geo[0] != [1, 1] or list(geo[2]) != [1, 1, 1, 1]:
        return False
    return tma_conv_supports(node, x, w, b, None, PatchConfig(ROWS, WIDTH, CHANNELS, CHANNELS, 4, STAGES), qtype)


def conv2d(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, x_scale: torch.Tensor,
           w_scale: torch.Tensor, y_scale: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """The 8-bit output of a `supports` QConv: channels-last, as an NCHW-shaped view. pdl=False launches it
    without programmatic dependent launch (kernels/pdl.py)."""
    from .tma_gemm import programs as sm_count

    qtype = node.attr("qtype", "int8")
    N, _, H, W = x.shape
    x, xs, ws, stride_ws = quant_args(x, qtype, x_scale, w_scale)
    y = torch.empty((N, H, W, CHANNELS), dtype=QTYPES[qtype], device=x.device)
    n_programs = min(N * triton.cdiv(H, ROWS), PER_SM * sm_count(x.device))
    bias = b.reshape(-1).contiguous() if b is not None else None
    _halo_conv_kernel[(n_programs,)](
        box_descriptor(nhwc(x), [1, ROWS + 2, WIDTH, CHANNELS]), box_descriptor(filter_rows(w), [CHANNELS, CHANNELS]),
        box_descriptor(y, [1, ROWS, WIDTH, CHANNELS]), bias if bias is not None else xs, xs, ws, y_scale, N, H,
        stride_ws, n_programs, QUANT=qtype, HAS_BIAS=bias is not None, RELU=node.attr("activation", "") == "Relu",
        STAGES=STAGES, num_warps=4, maxnreg=MAXNREG, **launch_options(x.device, pdl))
    return y.permute(0, 3, 1, 2)
