"""Warp-specialized 8-bit GEMM for Hopper, written in Gluon: ws_conv.py's design (it says why) for 1x1 convolutions
(a GEMM over pixel rows, tma_gemm.py's ResNet-shaped layers) and QGemm layers (BERT's).

A one-warp loader partition brings each output tile's 8-bit residual and its K tiles of x and w by TMA into rings of
shared-memory buffers, running ahead into the next tiles while a 4-warp partition runs the MMAs (one 8-bit wgmma in
flight) and the epilogue: gemm.finish's arithmetic for this case (x_scale * w_scale[n], bias, the residual times its
scale, the ReLU and the next layer's 8-bit quantization, warp_specialized.quantize8), with 1 / y_scale folded into
the column vectors and the residual's scale: one multiply a value less, and the same codes as tma_gemm's but where a
value sits at a rounding tie (then one step away). A GELU (erf or tanh form) is computed in the tanh form by the
SFU's tanh (gelu_tanh), about 1e-3 from the erf form where an 8-bit output's step is 1/16 of the value or more:
with two programs an SM, one's epilogue runs while the other's MMAs do, which lets a GELU epilogue keep pace with
the MMAs. It beats tma_gemm at most of ResNet-50's 8-bit 1x1 layers but not all, so the builder times both (see
docs/design/gluon-kernels.md).

Takes: a 1x1 stride-1 QConv over channels-last pixels or a QGemm (row-major x, K-major weights), INT8 or FP8, with
an 8-bit output, ReLU, GELU or no activation, any bias, an 8-bit residual at its own scale or none (none with a
GELU), no 8-bit copy; K 32, 64 or a multiple of 128; N a whole number of tiles; a Hopper GPU. Triton's interpreter
does not run Gluon: CI compiles these kernels for sm_90 (tests/kernels/test_gluon_compile.py) and the GPU tests
compare them with tma_gemm.
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
from .warp_specialized import (
    LOADER_REGS,
    MAXNREG,
    accumulator_dtype,
    accumulator_layout,
    box_descriptor,
    let_next_kernel_start,
    load_k_tiles,
    mma_steps,
    quantize8,
    ring_barriers,
    store8,
    wait_for_previous_kernel,
)


@dataclass(frozen=True)
class WsGemmConfig:
    """An output tile of block_m rows by block_n columns, K walked min(K, 128) at a time through a ring of
    `stages` stages, `per_sm` programs an SM."""

    block_m: int
    block_n: int
    stages: int
    per_sm: int

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}_s{self.stages}_x{self.per_sm}"

    def smem_bytes(self, block_k: int, residual: bool) -> int:
        """The ring of 8-bit x and w tiles, the 8-bit output tile, two residual tiles, the barriers."""
        tile = self.block_m * self.block_n
        return self.stages * ((self.block_m + self.block_n) * block_k + 16) + tile * (1 + 2 * residual) + 32


# (config, lowest optimization level that offers it): each the fastest at some of ResNet-50's 1x1 layers or
# BERT-base's GEMMs (three stages at K = 768), two programs an SM (see docs/design/gluon-kernels.md).
CONFIGS: list[tuple[WsGemmConfig, int]] = [
    (WsGemmConfig(128, 128, 2, 2), 3),
    (WsGemmConfig(128, 128, 3, 2), 3),
    (WsGemmConfig(128, 64, 3, 2), 3),
]


def block_k_for(k: int) -> int | None:
    """The K tile for K input channels: K itself up to 128 (32 or 64), else 128 if it divides K."""
    bk = min(k, 128)
    return bk if bk in (32, 64, 128) and k % bk == 0 else None


@gluon.jit
def _loader(x_desc, w_desc, z_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, tiles, tiles_n, K,
            programs, STAGES: gl.constexpr, HAS_Z: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    wait_for_previous_kernel()  # x and the residual may be its outputs
    it = 0
    t = 0
    for tile in range(gl.program_id(0), tiles, programs):
        off_m = (tile // tiles_n) * BLOCK_M  # the column tiles of a row block are neighbours: x read once from L2
        off_n = (tile % tiles_n) * BLOCK_N
        if HAS_Z:  # two residual buffers (a third was slower): the next tile's arrives while the
            zb = t % 2  # MMA partition adds this one's
            mbarrier.wait(z_empty.index(zb), ((t // 2) & 1) ^ 1)
            mbarrier.expect(z_ready.index(zb), z_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(z_desc, [off_m, off_n], z_ready.index(zb), z_bufs.index(zb))
        it = load_k_tiles(x_desc, w_desc, a_bufs, b_bufs, ready, empty, it, off_m, off_n, K, STAGES)
        t += 1


@gluon.jit
def gelu_tanh(v, out_scale):
    """out_scale * GELU(v) in the tanh form, 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))), the tanh by the
    SFU's tanh.approx.f32 (relative error about 2^-11): five FP32 instructions and one SFU one a value, where
    gemm.finish's erf takes a polynomial and a division. It differs from the erf form by at most 5e-4 + 5e-4 |v|,
    well inside an 8-bit output's step (cuBLASLt's GELU epilogue is the tanh form too)."""
    u = v * (0.7978845608028654 + 0.03567740813636141 * (v * v))
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=gl.float32, is_pure=True, pack=1)
    h = v * (0.5 * out_scale)
    return h + h * t


@gluon.jit
def _mma_epilogue(y_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, y_smem, b_ptr, xs_ptr, ws_ptr,
                  ys_ptr, zs_ptr, tiles, tiles_n, K, stride_ws, programs, QUANT: gl.constexpr,
                  HAS_BIAS: gl.constexpr, HAS_Z: gl.constexpr, ACT: gl.constexpr, STAGES: gl.constexpr,
                  num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    acc_layout: gl.constexpr = accumulator_layout(BLOCK_N, num_warps)
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    GELU: gl.constexpr = ACT == "GeluErf" or ACT == "GeluTanh"
    wait_for_previous_kernel()  # the scales and bias are read straight from global memory
    inv_ys = 1.0 / gl.load(ys_ptr).to(gl.float32)
    if GELU:  # 1 / y_scale goes after the GELU, which does not commute with scaling
        col_ys = 1.0
    else:
        col_ys = inv_ys
    xs_y = gl.load(xs_ptr).to(gl.float32) * col_ys
    zs_y = gl.load(zs_ptr).to(gl.float32) * col_ys
    it = 0
    t = 0
    for tile in range(gl.program_id(0), tiles, programs):
        off_m = (tile // tiles_n) * BLOCK_M
        off_n = (tile % tiles_n) * BLOCK_N
        cols = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
        scale = xs_y * gl.load(ws_ptr + cols * stride_ws).to(gl.float32)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=accumulator_dtype(QUANT), layout=acc_layout)
        acc, it = mma_steps(acc, a_bufs, b_bufs, ready, empty, it, gl.cdiv(K, BLOCK_K), STAGES)
        v = acc.to(gl.float32) * scale[None, :]
        if HAS_BIAS:
            v = v + (gl.load(b_ptr + cols).to(gl.float32) * col_ys)[None, :]
        if HAS_Z:  # gemm.finish adds the residual after the bias
            zb = t % 2
            mbarrier.wait(z_ready.index(zb), (t // 2) & 1)
            z = z_bufs.index(zb).load(acc_layout)
            fence_async_shared()  # the load above before the loader's next TMA write into this buffer
            mbarrier.arrive(z_empty.index(zb))
            v = v + z.to(gl.float32) * zs_y
        if GELU:
            v = gelu_tanh(v, inv_ys)
        out = quantize8(v, QUANT, ACT == "Relu")
        tma.store_wait(pendings=0)  # the last tile's store has read y_smem
        store8(y_smem, out)
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [off_m, off_n], y_smem)
        t += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_gemm_kernel(x_desc, w_desc, z_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, zs_ptr, M, N, K, stride_ws,
                    programs, QUANT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_Z: gl.constexpr, ACT: gl.constexpr,
                    STAGES: gl.constexpr, num_warps: gl.constexpr):
    let_next_kernel_start()
    tiles_n = gl.cdiv(N, y_desc.block_type.shape[1])
    tiles = gl.cdiv(M, y_desc.block_type.shape[0]) * tiles_n
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    z_bufs = gl.allocate_shared_memory(z_desc.dtype, [2 if HAS_Z else 1] + z_desc.block_type.shape, z_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready, empty = ring_barriers(STAGES)
    z_ready, z_empty = ring_barriers(2)  # the residual's two buffers
    gl.warp_specialize([
        (_mma_epilogue, (y_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, y_smem, b_ptr, xs_ptr,
                         ws_ptr, ys_ptr, zs_ptr, tiles, tiles_n, K, stride_ws, programs, QUANT, HAS_BIAS, HAS_Z,
                         ACT, STAGES, num_warps)),
        (_loader, (x_desc, w_desc, z_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, tiles, tiles_n, K,
                   programs, STAGES, HAS_Z)),
    ], [1], [LOADER_REGS])


ACTIVATIONS = ("", "Relu", "GeluErf", "GeluTanh")


def supports(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None,
             y_scale, q_scale, z_scale, config: WsGemmConfig) -> bool:
    """A layer this kernel takes (the module's docstring says which) with this tile, on a Hopper GPU."""
    if not layer_ok(node, x, w, b, z, y_scale, q_scale, z_scale, config):
        return False
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9


def matrices(node, x: torch.Tensor, w: torch.Tensor, z: torch.Tensor | None):
    """(x rows [M, K], w rows [N, K], z rows [M, N] or None) of a 1x1 stride-1 QConv over channels-last pixels or
    of a QGemm (x [..., K] and w [K, N] views of row-major x and column-major w); None for any other layer."""
    from .conv import is_pointwise, pixel_rows

    if node.op_type == "QGemm":
        if z is not None or w.dim() != 2 or x.shape[-1] != w.shape[0]:
            return None
        rows = x.view(-1, x.shape[-1]) if x.is_contiguous() else None
        return None if rows is None else (rows, w.t(), None)
    if node.op_type != "QConv" or not is_pointwise(node, x, w, z):
        return None
    return pixel_rows(x), w.reshape(w.shape[0], w.shape[1]), pixel_rows(z) if z is not None else None


def layer_ok(node, x, w, b, z, y_scale, q_scale, z_scale, config: WsGemmConfig) -> bool:
    """`supports` but for the device: what the layer and its tensors must be."""
    from .tma_gemm import aligned

    qtype = node.attr("qtype", "int8") if node.op_type in ("QConv", "QGemm") else ""
    act = node.attr("activation", "")
    if qtype not in QTYPES or y_scale is None or q_scale is not None or act not in ACTIVATIONS:
        return False
    if w.dtype != QTYPES[qtype] or x.dtype not in (torch.float16, torch.bfloat16, torch.float32, w.dtype):
        return False
    mats = matrices(node, x, w, z)
    if mats is None:
        return False
    rows, w_rows, z_rows = mats
    if z is not None and (z.dtype != w.dtype or z_scale is None or not aligned(z_rows) or act.startswith("Gelu")):
        return False
    n, k = w_rows.shape
    if n % config.block_n or block_k_for(k) is None or not aligned(rows) or not aligned(w_rows):
        return False
    return b is None or (b.numel() == n and b.dtype.is_floating_point)


def matmul8(node, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, z: torch.Tensor | None,
            config: WsGemmConfig, x_scale: torch.Tensor, w_scale: torch.Tensor, y_scale: torch.Tensor,
            z_scale: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """The 8-bit output of a `supports` layer, as tma_gemm computes it: a QGemm's [..., N], a QConv's channels-last
    as an NCHW-shaped view. pdl=False launches it without programmatic dependent launch (kernels/pdl.py)."""
    from .conv import pixels_as_nchw
    from .tma_gemm import programs as sm_count

    qtype = node.attr("qtype", "int8")
    x, xs, ws, stride_ws = quant_args(x, qtype, x_scale, w_scale)
    rows, w_rows, z_rows = matrices(node, x, w, z)
    (M, K), N = rows.shape, w_rows.shape[0]
    bm, bn, bk = config.block_m, config.block_n, block_k_for(K)
    y = torch.empty((M, N), dtype=QTYPES[qtype], device=x.device)
    y_desc = box_descriptor(y, [bm, bn])
    tiles = triton.cdiv(M, bm) * (N // bn)
    n_programs = min(tiles, config.per_sm * sm_count(x.device))
    bias = b.reshape(-1).contiguous() if b is not None else None
    _ws_gemm_kernel[(n_programs,)](
        box_descriptor(rows, [bm, bk]), box_descriptor(w_rows, [bn, bk]),
        box_descriptor(z_rows, [bm, bn]) if z is not None else y_desc,
        y_desc, bias if bias is not None else xs, xs, ws, y_scale, z_scale if z_scale is not None else xs, M, N, K,
        stride_ws, n_programs, QUANT=qtype, HAS_BIAS=bias is not None, HAS_Z=z is not None,
        ACT=node.attr("activation", ""), STAGES=config.stages, num_warps=4, maxnreg=MAXNREG,
        **launch_options(x.device, pdl))
    return y.view(*x.shape[:-1], N) if node.op_type == "QGemm" else pixels_as_nchw(y, x)
