"""Experiment: ResNet-50's 8-bit 1x1 convolutions (GEMMs with an 8-bit residual and output) written in Gluon,
warp-specialized, against Kiln's Triton TMA GEMM (kernels/tma_gemm.py).

The companion of kernels/ws_conv.py (which says why Gluon): a loader warp brings each output tile's residual
and its K tiles of x and w by TMA into rings of shared-memory buffers, running ahead into the next tiles while the
4-warp partition does the MMAs (one INT8 wgmma in flight) and the epilogue: tma_gemm's arithmetic (gemm.finish:
x_scale * w_scale[n], bias, the residual times its scale, the ReLU in the clamp, the next layer's INT8 codes), so
the outputs must be equal. Nsight Compute found tma_gemm at layer1's 64 -> 256 (K = 64, one K tile) issue-heavy and
latency-bound at two programs an SM (bench/results/H200-ncu-layer1-conv3-1108.log). Compiled for sm_90 with Triton
3.6 and 3.8 (tests/kernels/test_gluon_compile.py). Its first GPU run (bench/results/H200-gluon-gemm-1214.log): equal to
tma_gemm everywhere, 4-15% faster at the best tile and programs an SM.

    python bench/gluon_gemm.py                     (GPU: each variant against tma_gemm's output, and timed)
    python bench/gluon_gemm.py --compile-only      (any machine: compiles the variants for sm_90)
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench.gluon_conv import check_and_time, compile_and_report  # noqa: E402
from kiln.kernels.ws_conv import LOADER_REGS, MAXNREG, box_layout, mma_steps, quantize8  # noqa: E402

# (name, M, K, N, 8-bit residual, the tile the INT8 engine's tma_gemm took: (block_m, block_n, block_k, warps, stages))
LAYERS = [("layer1 conv3 64->256 +res", 100352, 64, 256, True, (128, 128, 64, 4, 3)),
          ("layer1 conv1 256->64", 100352, 256, 64, False, (128, 64, 128, 4, 4)),
          ("layer2 conv3 128->512 +res", 25088, 128, 512, True, (64, 128, 128, 4, 2)),
          ("layer3 conv3 256->1024 +res", 6272, 256, 1024, True, (64, 128, 128, 4, 2))]
# the GPU run's variants: (block_m, block_n), ring stages, programs an SM; block_k is min(K, 128)
TILES, STAGE_COUNTS, PER_SM = [(128, 128), (128, 64), (64, 128)], [2, 3, 4], [1, 2]


@gluon.jit
def _loader(x_desc, w_desc, z_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, tiles, tiles_n, K,
            programs, STAGES: gl.constexpr, HAS_Z: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    it = 0
    t = 0
    for tile in range(gl.program_id(0), tiles, programs):
        off_m = (tile // tiles_n) * BLOCK_M  # the column tiles of a row block are neighbours: x read once from L2
        off_n = (tile % tiles_n) * BLOCK_N
        if HAS_Z:
            zb = t % 2
            mbarrier.wait(z_empty.index(zb), ((t // 2) & 1) ^ 1)
            mbarrier.expect(z_ready.index(zb), z_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(z_desc, [off_m, off_n], z_ready.index(zb), z_bufs.index(zb))
        for kb in range(gl.cdiv(K, BLOCK_K)):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, kb * BLOCK_K], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [off_n, kb * BLOCK_K], ready.index(s), b_bufs.index(s))
            it += 1
        t += 1


@gluon.jit
def _mma_epilogue(y_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, y_smem, b_ptr, xs_ptr, ws_ptr,
                  ys_ptr, zs_ptr, tiles, tiles_n, K, programs, STAGES: gl.constexpr,
                  HAS_Z: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    inv_ys = 1.0 / gl.load(ys_ptr).to(gl.float32)
    xs = gl.load(xs_ptr).to(gl.float32)
    zs = gl.load(zs_ptr).to(gl.float32)
    it = 0
    t = 0
    for tile in range(gl.program_id(0), tiles, programs):
        off_m = (tile // tiles_n) * BLOCK_M
        off_n = (tile % tiles_n) * BLOCK_N
        cols = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
        scale = xs * gl.load(ws_ptr + cols).to(gl.float32)
        bias = gl.load(b_ptr + cols).to(gl.float32)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.int32, layout=acc_layout)
        acc, it = mma_steps(acc, a_bufs, b_bufs, ready, empty, it, gl.cdiv(K, BLOCK_K), STAGES)
        v = acc.to(gl.float32) * scale[None, :] + bias[None, :]
        if HAS_Z:  # gemm.finish adds the residual after the bias
            zb = t % 2
            mbarrier.wait(z_ready.index(zb), (t // 2) & 1)
            z = z_bufs.index(zb).load(acc_layout)
            fence_async_shared()  # the load above before the loader's next TMA write into this buffer
            mbarrier.arrive(z_empty.index(zb))
            v = v + z.to(gl.float32) * zs
        out = quantize8(v, inv_ys, "int8", True)
        tma.store_wait(pendings=0)
        y_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [off_m, off_n], y_smem)
        t += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_gemm_kernel(x_desc, w_desc, z_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, zs_ptr, M, N, K,
                    programs, STAGES: gl.constexpr, HAS_Z: gl.constexpr, num_warps: gl.constexpr):
    tiles_n = gl.cdiv(N, y_desc.block_type.shape[1])
    tiles = gl.cdiv(M, y_desc.block_type.shape[0]) * tiles_n
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    z_bufs = gl.allocate_shared_memory(z_desc.dtype, [2 if HAS_Z else 1] + z_desc.block_type.shape, z_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    z_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    z_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(z_ready.index(i), count=1)
        mbarrier.init(z_empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_epilogue, (y_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, y_smem, b_ptr, xs_ptr,
                         ws_ptr, ys_ptr, zs_ptr, tiles, tiles_n, K, programs, STAGES, HAS_Z, num_warps)),
        (_loader, (x_desc, w_desc, z_desc, a_bufs, b_bufs, z_bufs, ready, empty, z_ready, z_empty, tiles, tiles_n, K,
                   programs, STAGES, HAS_Z)),
    ], [1], [LOADER_REGS])


def gemm(x8, w8, b, x_scale, w_scale, y_scale, z=None, z_scale=None, tile=(128, 128), stages: int = 3,
         programs_per_sm: int = 2):
    """relu(x8 @ w8.T * x_scale * w_scale + b [+ z * z_scale]) quantized with y_scale, as tma_gemm.gemm computes
    it: int8 x [M, K], int8 w [N, K] (K-major), an int8 residual z [M, N]; the int8 output [M, N]."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    M, K = x8.shape
    N = w8.shape[0]
    bm, bn = tile
    bk = min(K, 128)
    y = torch.empty((M, N), dtype=torch.int8, device=x8.device)

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, box_layout(block[-1], 2))

    y_desc = desc(y, [bm, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    programs = min(tiles, programs_per_sm * torch.cuda.get_device_properties(x8.device).multi_processor_count)
    _ws_gemm_kernel[(programs,)](
        desc(x8, [bm, bk]), desc(w8, [bn, bk]), desc(z, [bm, bn]) if z is not None else y_desc, y_desc, b, x_scale,
        w_scale.float().contiguous(), y_scale, z_scale if z_scale is not None else y_scale, M, N, K,
        programs, STAGES=stages, HAS_Z=z is not None, num_warps=4, maxnreg=MAXNREG)
    return y


def compile_only() -> int:
    """Each variant the GPU run times, at K = 64 and 256, with a residual, compiled for sm_90; 1 if one failed."""
    failed = 0
    for (bm, bn), stages, bk in [(t, s, k) for t in TILES for s in STAGE_COUNTS for k in (64, 128)]:
        sig = {"x_desc": f"tensordesc<i8[{bm},{bk}],{box_layout(bk, 2)!r}>",
               "w_desc": f"tensordesc<i8[{bn},{bk}],{box_layout(bk, 2)!r}>",
               "z_desc": f"tensordesc<i8[{bm},{bn}],{box_layout(bn, 2)!r}>",
               "y_desc": f"tensordesc<i8[{bm},{bn}],{box_layout(bn, 2)!r}>",
               "b_ptr": "*fp16", **{p: "*fp32" for p in ("xs_ptr", "ws_ptr", "ys_ptr", "zs_ptr")},
               **{p: "i32" for p in ("M", "N", "K", "programs")},
               **{p: "constexpr" for p in ("STAGES", "HAS_Z", "num_warps")}}
        src = GluonASTSource(_ws_gemm_kernel, sig, constexprs={"STAGES": stages, "HAS_Z": True, "num_warps": 4})
        failed |= compile_and_report(src, f"GEMM {bm}x{bn}x{bk} s{stages}")
    return failed


def main() -> int:
    if "--compile-only" in sys.argv:
        return compile_only()
    import torch

    from bench.tma_sweep import engine_operands
    from kiln.kernels import tma_gemm
    from kiln.kernels.gemm import TileConfig
    from kiln.tactics.timer import median_ms

    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__)
    for name, M, K, N, with_z, engine_tile in LAYERS:
        x8, w8, b, kw, moved = engine_operands(M, K, N, with_z, "int8", False)  # w8: [K, N], K-major
        tile = TileConfig(*engine_tile)

        def theirs():
            return tma_gemm.gemm(x8, w8, b, "Relu", config=tile, **kw)

        want = theirs()
        print(f"\n## {name}: M {M}, K {K}, N {N}, {moved / 1e6:.1f} MB", flush=True)
        print(f"tma_gemm {tile.name}: {1000 * median_ms(theirs, runs=20):.1f} us", flush=True)
        args = (x8, w8.t(), b, kw["x_scale"], kw["w_scale"], kw["y_scale"], kw["z"], kw["z_scale"])
        for ours in TILES:
            for stages in STAGE_COUNTS:
                for per_sm in PER_SM:
                    run = dict(tile=ours, stages=stages, programs_per_sm=per_sm)
                    check_and_time(f"gluon {ours[0]}x{ours[1]}x{min(K, 128)} s{stages} x{per_sm}/SM",
                                   lambda run=run: gemm(*args, **run), want, "tma_gemm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
