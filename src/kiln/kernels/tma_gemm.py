"""Persistent GEMM on Hopper's tensor-memory accelerator (TMA): y = act(x @ w + b), fused epilogue.

kernels/gemm.py gathers its tiles with per-thread pointer loads. Here every tile moves by TMA
descriptor (one bulk copy per tile; rows and columns past the edge read as zeros and are not
written, so no masks and no wrapped indices) and a fixed grid of one program per SM walks the
output tiles. It wins most 8-bit GEMMs and memory-bound 1x1 convolutions and loses to cuBLAS on
large FP16 GEMMs and GELU epilogues, so the builder times it against both, per layer (see
docs/design/tma-gemm.md).

Where K fits one tile (ResNet-50's 1x1 convolutions over 64 and 128 channels) the kernel runs one loop over the
output tiles instead of a loop over tiles and K, so that Triton's pipeliner issues every tile's loads, the
residual's too, tiles ahead; in the nested loop the residual is loaded after the K loop and waited for at once
(bench/sm90_compile.py shows both; see docs/design/tma-gemm.md).

x [M, K], y [M, N] and a residual z [M, N] row-major; w either [K, N] row-major or, for 8-bit weights, K-major
([N, K] row-major, passed as its [K, N] transpose view): Hopper's 8-bit Tensor Core instruction
reads its right operand K-major only. TMA wants 16-byte-aligned base addresses and row strides
(`supports`). The epilogue is gemm.py's: dequantization (quantized layers: x_scale * w_scale[n]),
bias, activation, one store.

Reference: gemm.reference; kiln.ops.fused.qgemm for the quantized form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .gemm import (
    ACTIVATIONS,
    QTYPES,
    TileConfig,
    _params,
    columns,
    copy,
    finish,
    quant_args,
    relu_in_quantize,
    residual_ok,
)
from .pdl import launch_options, start_after_previous

_ALIGN = 16  # bytes: TMA's alignment for base addresses and row strides
_SM_SMEM = 224 * 1024  # Hopper's 228 KB of shared memory per SM, less the 1 KB each resident program reserves


@triton.jit
def _tile_offsets(tile, grid_m, grid_n, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first row, first column) of output tile `tile`, in GROUP_M swizzle as in gemm.py: neighbouring tiles
    share columns of w in L2."""
    width = GROUP_M * grid_n
    first_m = (tile // width) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    return (first_m + (tile % width) % group_m) * BLOCK_M, ((tile % width) // group_m) * BLOCK_N


@triton.jit
def _w_tile(w_desc, off_n, off_k, W_KMAJOR: tl.constexpr):
    # one return: Triton types every return of a function, so two would have to agree in shape, [BK, BN]
    if W_KMAJOR:
        w = w_desc.load([off_n, off_k]).T
    else:
        w = w_desc.load([off_k, off_n])
    return w


@triton.jit
def _store_tile(acc, z, off_m, off_n, y_desc, q_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, qs_ptr, zs_ptr, N, stride_ws,
                p0, p1, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
                Y_QUANTIZED: tl.constexpr, COPY: tl.constexpr, Z_SCALED: tl.constexpr, RELU: tl.constexpr,
                BLOCK_N: tl.constexpr, scale=None, bias=None):
    """gemm.finish's epilogue, one TMA store (and gemm.copy's); scale and bias as finish takes them."""
    cols = (off_n + tl.arange(0, BLOCK_N)) % N  # columns past N compute garbage the store drops
    out, acc = finish(acc, z, cols, b_ptr, xs_ptr, ws_ptr, ys_ptr, zs_ptr, stride_ws, p0, p1, y_desc.dtype, HAS_BIAS,
                      HAS_Z, ACT, QUANT, Y_QUANTIZED, Z_SCALED, RELU, scale, bias)
    y_desc.store([off_m, off_n], out)
    if COPY:
        q_desc.store([off_m, off_n], copy(acc, out, qs_ptr, q_desc.dtype, QUANT, Y_QUANTIZED, RELU))


@triton.jit
def _tma_gemm_kernel(x_desc, w_desc, y_desc, z_desc, q_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, qs_ptr, zs_ptr, M, N, K,
                     stride_ws, p0, p1, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, ACT: tl.constexpr,
                     QUANT: tl.constexpr, Y_QUANTIZED: tl.constexpr, COPY: tl.constexpr, Z_SCALED: tl.constexpr,
                     RELU: tl.constexpr, W_KMAJOR: tl.constexpr, ONE_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    acc_dtype = tl.int32 if QUANT == "int8" else tl.float32
    # The epilogue's column vectors loaded before the K loop, where the tile's registers leave room for them
    # (wider tiles spill; see docs/design/tma-gemm.md). The single loop (ONE_K) prefetches them tiles ahead anyway.
    EARLY_COLUMNS: tl.constexpr = BLOCK_N <= 64
    if ONE_K:
        # the pipeliner issues loads that feed no dot (the residual, the scales) tiles ahead only when the loop
        # names its stage count. The residual is read after the dot: read before, its registers lived across
        # it and 128x128 INT8 tiles spilled (ptxas -v: 184 bytes, none after).
        for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, num_stages=NUM_STAGES):
            off_m, off_n = _tile_offsets(tile, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
            acc = tl.dot(x_desc.load([off_m, 0]), _w_tile(w_desc, off_n, 0, W_KMAJOR), out_dtype=acc_dtype)
            z = z_desc.load([off_m, off_n]) if HAS_Z else None
            _store_tile(acc, z, off_m, off_n, y_desc, q_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, qs_ptr, zs_ptr, N,
                        stride_ws, p0, p1, HAS_BIAS, HAS_Z, ACT, QUANT, Y_QUANTIZED, COPY, Z_SCALED, RELU, BLOCK_N)
    else:
        for tile in tl.range(tl.program_id(0), grid_m * grid_n, PROGRAMS, flatten=True):
            off_m, off_n = _tile_offsets(tile, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
            scale, bias = None, None
            if EARLY_COLUMNS:
                cols = (off_n + tl.arange(0, BLOCK_N)) % N
                scale, bias = columns(cols, b_ptr, xs_ptr, ws_ptr, stride_ws, HAS_BIAS, QUANT)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
            for kb in range(tl.cdiv(K, BLOCK_K)):
                acc = tl.dot(x_desc.load([off_m, kb * BLOCK_K]), _w_tile(w_desc, off_n, kb * BLOCK_K, W_KMAJOR),
                             acc, out_dtype=acc_dtype)
            z = z_desc.load([off_m, off_n]) if HAS_Z else None
            _store_tile(acc, z, off_m, off_n, y_desc, q_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, qs_ptr, zs_ptr, N,
                        stride_ws, p0, p1, HAS_BIAS, HAS_Z, ACT, QUANT, Y_QUANTIZED, COPY, Z_SCALED, RELU, BLOCK_N,
                        scale, bias)


def smem_bytes(config: TileConfig, itemsize: int, epilogue_tiles: int = 1) -> int:
    """Shared memory a configuration holds: its operand pipeline plus the 16-bit output (and residual) tiles
    TMA moves in the epilogue."""
    return (config.num_stages * (config.block_m + config.block_n) * config.block_k * itemsize
            + epilogue_tiles * config.block_m * config.block_n * 2)


def one_loop(config: TileConfig, K: int, itemsize: int, z_itemsize: int = 0) -> bool:
    """Whether a GEMM can run the kernel's single loop over tiles: K fits one tile and, with a residual of
    z_itemsize bytes a value, the num_stages - 1 residual tiles that loop prefetches fit in shared memory beside
    the rest."""
    if K > config.block_k:
        return False
    return smem_bytes(config, itemsize) + residual_bytes(config, z_itemsize, True) <= _SM_SMEM


def residual_bytes(config: TileConfig, z_itemsize: int, single_loop: bool) -> int:
    """Shared memory the residual takes: one tile, or in the single loop (`one_loop`) num_stages - 1."""
    return (config.num_stages - 1 if single_loop else 1) * config.block_m * config.block_n * z_itemsize


# (config, lowest optimization level that tries it). K tiles of 128 bytes, the widest TMA swizzle: 64
# 16-bit values, 128 8-bit ones. Each level-3 tile is the fastest at one of BERT's and ResNet-50's shapes
# (see docs/design/tma-gemm.md).
CONFIGS: list[tuple[TileConfig, int]] = [
    (TileConfig(128, 256, 64, 8, 3), 3),
    (TileConfig(128, 128, 64, 4, 4), 3),
    (TileConfig(128, 64, 64, 4, 4), 3),
    (TileConfig(64, 128, 64, 4, 4), 4),
]
QUANT_CONFIGS: list[tuple[TileConfig, int]] = [
    (TileConfig(128, 256, 128, 8, 3), 3),
    (TileConfig(128, 128, 64, 4, 4), 3),  # two per SM: ResNet-50's memory-bound 1x1 convolutions (K = 64, 128)
    (TileConfig(128, 128, 128, 4, 4), 3),
    (TileConfig(128, 64, 128, 4, 4), 3),
    (TileConfig(64, 128, 128, 4, 4), 3),
    (TileConfig(256, 128, 128, 8, 3), 4),
    # 64-row tiles at three or four programs per SM, for memory-bound 8-bit 1x1 layers; the builder times them
    # with weights out of L2, as an engine reads them (tactics/timer.py).
    (TileConfig(64, 128, 64, 4, 2), 3),
    (TileConfig(64, 128, 128, 4, 2), 3),
    (TileConfig(64, 64, 128, 4, 2), 3),
    # three stages: the single loop over tiles (K in one tile) at K = 64, where four stages' prefetched residual
    # tiles leave room for only one program per SM
    (TileConfig(128, 128, 64, 4, 3), 3),
    (TileConfig(64, 128, 128, 4, 3), 3),
    # 64-wide K and N tiles: K = 64 layers, where a 128-wide K tile would be half zeros
    (TileConfig(128, 64, 64, 4, 3), 3),
]


def aligned(t: torch.Tensor) -> bool:
    """A 2-D matrix TMA can address: unit last stride, 16-byte-aligned base and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % _ALIGN == 0
            and (t.stride(0) * t.element_size()) % _ALIGN == 0)


def weight_matrix(w: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(the row-major matrix a descriptor covers, K-major?) for w [K, N], or None if TMA cannot read it."""
    if aligned(w):
        return w, False
    if aligned(w.t()):
        return w.t(), True
    return None


def rows(t: torch.Tensor, cols: int) -> torch.Tensor | None:
    """t as the [rows, cols] matrix TMA reads (a view), or None."""
    try:
        m = t.view(-1, cols)
    except RuntimeError:
        return None
    return m if aligned(m) else None


def supports(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str, qtype: str = "",
             z: torch.Tensor | None = None) -> bool:
    """x [.., K] and z [.., N] whose rows TMA reads in place, w [K, N] (K-major for 8-bit weights), 16-bit floats
    or the qtype's 8-bit weights; K and N multiples of 16, so every row of every operand is 16-byte aligned."""
    if x.dim() < 2 or w.dim() != 2 or x.shape[-1] != w.shape[0] or act not in ACTIVATIONS or x.numel() == 0:
        return False
    K, N = w.shape
    if qtype:
        if w.dtype != QTYPES.get(qtype) or x.dtype not in (torch.float16, torch.bfloat16, w.dtype):
            return False
    elif x.dtype not in (torch.float16, torch.bfloat16) or w.dtype != x.dtype:
        return False
    mat = weight_matrix(w)
    if mat is None or (qtype and not mat[1]) or K % 16 or N % 16 or rows(x, K) is None:
        return False
    if z is not None and (z.numel() != x.numel() // K * N or not residual_ok(z, qtype) or rows(z, N) is None):
        return False
    return b is None or (b.numel() == N and b.dtype.is_floating_point)


def resident_programs(num_warps: int, pipeline_bytes: int, tile_elems: int, qtype: str) -> int:
    """Persistent programs per SM for an 8-bit 4-warp tile: as many as its shared memory (operand pipeline plus a
    16-bit allowance for the epilogue's tiles) and registers allow, at most four; one for 16-bit and 8-warp tiles.
    Several programs hide one another's latencies: a program's epilogue (residual load, 8-bit stores) and, in
    INT8, its unpipelined Tensor Core steps overlap the others' loads. A 128x128 tile's int32 accumulator takes
    128 registers a thread, so it gets two; 8-warp tiles gain nothing from a second (see docs/design/tma-gemm.md)."""
    if not qtype or num_warps != 4:
        return 1
    by_registers = 2 if tile_elems // (32 * num_warps) >= 128 else 4
    by_smem = _SM_SMEM // (pipeline_bytes + 2 * tile_elems)
    return max(1, min(by_registers, by_smem))


def programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, act: str = "", params=(),
         config: TileConfig = CONFIGS[0][0], qtype: str = "", x_scale: torch.Tensor | None = None,
         w_scale: torch.Tensor | None = None, y_scale: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, z: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
         z_scale: torch.Tensor | None = None, programs_per_sm: int | None = None, single_loop: bool = True,
         relu_in_quantization: bool = True, pdl: bool = True):
    """act(x @ w + b [+ z]) for x [.., K], w [K, N], z [M, N] rows (8-bit with z_scale); [.., N] in x's dtype, as
    gemm.gemm computes it: a quantized layer's result is act(x_scale * w_scale * (q(x) @ w) + b) in out_dtype, or
    quantized with y_scale; with q_scale also its 8-bit copy (y, q). programs_per_sm: persistent programs per
    SM (default `resident_programs`). single_loop=False keeps the nested loop where `one_loop` allows the single
    one, and relu_in_quantization=False applies a ReLU before an 8-bit output on its own rather than as the
    quantization's clamp: both only to compare (bench/tma_sweep.py --one-k, tests), the results are the same.
    pdl=False launches it without programmatic dependent launch (kernels/pdl.py)."""
    lead, (K, N) = x.shape[:-1], w.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=QTYPES[qtype] if y_scale is not None else out_dtype or x.dtype, device=x.device)
    q = torch.empty((M, N), dtype=QTYPES[qtype], device=x.device) if q_scale is not None else y
    x2, xs, ws, stride_ws = quant_args(x2, qtype, x_scale, w_scale)
    w_mat, k_major = weight_matrix(w)
    bm, bn, bk = config.block_m, config.block_n, config.block_k

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    z_desc = desc(rows(z, N), [bm, bn]) if z is not None else None
    p0, p1 = _params(act, params)
    bias = b.reshape(-1).contiguous() if b is not None else None
    z_itemsize = z.element_size() if z is not None else 0
    one_k = single_loop and one_loop(config, K, x2.element_size(), z_itemsize)
    pipeline = config.smem_bytes(x2.element_size()) + (residual_bytes(config, z_itemsize, True) if one_k else 0)
    per_sm = programs_per_sm or resident_programs(config.num_warps, pipeline, bm * bn, qtype)
    n_programs = min(per_sm * programs(x.device), triton.cdiv(M, bm) * triton.cdiv(N, bn))
    pdl = launch_options(x.device, pdl)
    _tma_gemm_kernel[(n_programs,)](
        desc(x2, [bm, bk]), desc(w_mat, [bn, bk] if k_major else [bk, bn]), desc(y, [bm, bn]),
        z_desc if z_desc is not None else desc(y, [bm, bn]), desc(q, [bm, bn]),
        bias if bias is not None else xs, xs, ws, y_scale if y_scale is not None else xs,
        q_scale if q_scale is not None else xs, z_scale if z_scale is not None else xs, M, N, K, stride_ws, p0, p1,
        HAS_BIAS=bias is not None, HAS_Z=z is not None, ACT=act, QUANT=qtype, Y_QUANTIZED=y_scale is not None,
        COPY=q_scale is not None, Z_SCALED=z_scale is not None,
        RELU=relu_in_quantization and relu_in_quantize(act, y_scale is not None),
        W_KMAJOR=k_major, ONE_K=one_k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, PROGRAMS=n_programs,
        NUM_STAGES=config.num_stages, PDL=bool(pdl), num_warps=config.num_warps, num_stages=config.num_stages, **pdl)
    return y.view(*lead, N) if q_scale is None else (y.view(*lead, N), q.view(*lead, N))
