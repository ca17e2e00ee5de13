"""Experiment: BERT-base's FP8 GEMMs as a warp-specialized Gluon kernel with two Tensor Core warpgroups, against
cuBLASLt's FP8 GEMM with the same epilogue (what Kiln's FP8 BERT engine runs) and Kiln's Triton TMA GEMM.

BERT-base's FP8 engine runs at 0.73x of FP16 (H200, batch 32; the target is 0.7x). Its four GEMMs a layer are
cuBLASLt's, and FFN1's bias + GELU + FP8-output epilogue costs cuBLASLt about 5 us of its 24 (docs/
performance-notes.md); Kiln's Triton TMA GEMM is slower still (33.9 us). Here a persistent kernel tiles the
output 256 x 128 or 128 x 256: a loader warp fills a ring of x and w stages by TMA, and two 4-warp consumers
each take half the rows of every tile (cooperatively, as cuBLASLt's "coop" kernels do), keep one FP8 wgmma
in flight and finish the tile with `gemm.finish`, the epilogue every Kiln GEMM runs (a @triton.jit function that
Gluon calls as it is): scales, bias, activation, FP8 or FP16 output. Without a register cap the consumers get
what the loader gives up (setmaxnreg), enough for a 128 x 128 (or 64 x 256) FP32 accumulator and the GELU
epilogue.

Compiled for sm_90 on the CPU (tests/kernels/test_gluon_compile.py): with Triton 3.8 no variant spills; with 3.6,
the GPU machine's, the 128 x 256 tile with the GELU and FP8 output spills 684 bytes. Not yet run on a GPU.

    python bench/gluon_fp8_gemm.py                     (GPU: each shape against tma_gemm's output, then times)
    python bench/gluon_fp8_gemm.py --compile-only      (any machine: the variants compiled for sm_90)
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench.gluon_conv import check_and_time  # noqa: E402
from kiln.kernels.gemm import finish  # noqa: E402
from kiln.kernels.warp_specialized import LOADER_REGS, box_layout, load_k_tiles, mma_steps  # noqa: E402

# (name, M, K, N, activation, FP8 output): BERT-base at batch 32 x 128 tokens, as its FP8 engine runs them
SHAPES = [("qkv", 4096, 768, 2304, "", True), ("attn_out", 4096, 768, 768, "", False),
          ("ffn1", 4096, 768, 3072, "GeluErf", True), ("ffn2", 4096, 3072, 768, "", False)]
BK = 128
# (block_m, block_n) tiles, each consumer warpgroup taking half the rows (cuBLASLt's FFN1 kernel tiles 256 x 128),
# and ring stages: the GPU run's variants
TILES, STAGE_COUNTS = [(256, 128), (128, 256)], [2, 3]
CONSUMER_REGS = gl.constexpr(232)  # the second consumer's registers (the default partition gets what is left)


@gluon.jit
def _loader(x_desc, w_desc, a_bufs, b_bufs, ready, empty, tiles, tiles_n, K, STAGES: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    it = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        # a row block's column tiles are neighbours: x read once from L2
        it = load_k_tiles(x_desc, w_desc, a_bufs, b_bufs, ready, empty, it, (tile // tiles_n) * BLOCK_M,
                          (tile % tiles_n) * BLOCK_N, K, STAGES)


@gluon.jit
def _consumer(y_desc, a_bufs, b_bufs, ready, empty, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles, tiles_n, K,
              stride_ws, p0, p1, ROW0: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr,
              Y_QUANTIZED: gl.constexpr, STAGES: gl.constexpr):
    """Rows ROW0 .. ROW0 + ROWS of every tile: the K loop with one wgmma in flight, then gemm.finish and a TMA
    store. Both consumers release a stage (its `empty` barrier counts two) once their MMA on it is done."""
    ROWS: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    it = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        off_m = (tile // tiles_n) * BLOCK_M + ROW0
        off_n = (tile % tiles_n) * BLOCK_N
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc, it = mma_steps(acc, a_bufs, b_bufs, ready, empty, it, gl.cdiv(K, BLOCK_K), STAGES, ROW0)
        cols = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
        out, acc = finish(acc, None, cols, b_ptr, xs_ptr, ws_ptr, ys_ptr, xs_ptr, stride_ws, p0, p1, y_desc.dtype,
                          HAS_BIAS, False, ACT, "fp8", Y_QUANTIZED, False, False)
        tma.store_wait(pendings=0)  # the last tile's store has read y_smem
        y_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [off_m, off_n], y_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _fp8_gemm_kernel(x_desc, w_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, M, N, K, stride_ws, p0, p1,
                     HAS_BIAS: gl.constexpr, ACT: gl.constexpr, Y_QUANTIZED: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = y_desc.block_type.shape[0]
    tiles_n = gl.cdiv(N, w_desc.block_type.shape[0])
    tiles = gl.cdiv(M, x_desc.block_type.shape[0]) * tiles_n
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    y0 = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    y1 = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival from each consumer
    gl.warp_specialize([
        (_consumer, (y_desc, a_bufs, b_bufs, ready, empty, y0, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles, tiles_n, K,
                     stride_ws, p0, p1, 0, HAS_BIAS, ACT, Y_QUANTIZED, STAGES)),
        (_consumer, (y_desc, a_bufs, b_bufs, ready, empty, y1, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles, tiles_n, K,
                     stride_ws, p0, p1, ROWS, HAS_BIAS, ACT, Y_QUANTIZED, STAGES)),
        (_loader, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, tiles, tiles_n, K, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _y_layout(bn: int, dtype_bits: int):
    """The output tile's shared layout: swizzled where its rows are 128 bytes (FP8, 128 columns), else unswizzled
    (TMA's swizzles take rows of at most 128 bytes)."""
    row_bytes = bn * dtype_bits // 8
    return gl.NVMMASharedLayout(swizzle_byte_width=row_bytes if row_bytes <= 128 else 0, element_bitwidth=dtype_bits,
                                rank=2)


def gemm(x8, w8, b, x_scale, w_scale, act: str = "", y_scale=None, tile=TILES[0], stages: int = 3):
    """act(x8 @ w8 * x_scale * w_scale + b), FP8 E4M3 quantized with y_scale or FP16: x8 [M, K] row-major, w8
    [K, N] K-major (the engine's weights), one weight scale or one per column."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    M, K = x8.shape
    N = w8.shape[1]
    w_rows = w8.t()  # [N, K], contiguous
    y = torch.empty((M, N), dtype=torch.float8_e4m3fn if y_scale is not None else torch.float16, device=x8.device)

    def desc(t, box, layout):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)

    ws = w_scale.reshape(-1).float().contiguous()
    BM, BN = tile
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    programs = min(tiles, torch.cuda.get_device_properties(x8.device).multi_processor_count)
    _fp8_gemm_kernel[(programs,)](
        desc(x8, [BM, BK], box_layout(BK, 2)), desc(w_rows, [BN, BK], box_layout(BK, 2)),
        desc(y, [BM // 2, BN], _y_layout(BN, y.element_size() * 8)), b, x_scale, ws,
        y_scale if y_scale is not None else x_scale, M, N, K, 1 if ws.numel() > 1 else 0, 0.0, 0.0,
        HAS_BIAS=True, ACT=act, Y_QUANTIZED=y_scale is not None, STAGES=stages, num_warps=4)
    return y


def compile_only() -> int:
    """The kernel compiled for sm_90 with FP8 and FP16 outputs, GELU and none, two and three stages; 1 if one
    failed. Prints the consumers' register allocation and spills."""
    import re

    from bench.sm90_compile import spilled_bytes

    failed = 0
    for (BM, BN), stages in [(t, s) for t in TILES for s in STAGE_COUNTS]:
        for act, fp8_out in (("GeluErf", True), ("", False)):
            y_type, y_bits = ("fp8e4nv", 8) if fp8_out else ("fp16", 16)
            sig = {"x_desc": f"tensordesc<fp8e4nv[{BM},{BK}],{box_layout(BK, 2)!r}>",
                   "w_desc": f"tensordesc<fp8e4nv[{BN},{BK}],{box_layout(BK, 2)!r}>",
                   "y_desc": f"tensordesc<{y_type}[{BM // 2},{BN}],{_y_layout(BN, y_bits)!r}>",
                   "b_ptr": "*fp16", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "ys_ptr": "*fp32",
                   **{p: "i32" for p in ("M", "N", "K", "stride_ws")}, "p0": "fp32", "p1": "fp32",
                   **{p: "constexpr" for p in ("HAS_BIAS", "ACT", "Y_QUANTIZED", "STAGES")}}
            constexprs = dict(HAS_BIAS=True, ACT=act, Y_QUANTIZED=fp8_out, STAGES=stages)
            name = f"{BM}x{BN}x{BK} s{stages} {act or 'no activation'}, {'FP8' if fp8_out else 'FP16'} output"
            try:
                kernel = triton.compile(GluonASTSource(_fp8_gemm_kernel, sig, constexprs=constexprs),
                                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            except Exception as e:
                print(f"Triton {triton.__version__}: {name} FAILED {type(e).__name__}: {str(e)[-1500:]}")
                failed = 1
                continue
            ir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
            regs = sorted(set(int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
            print(f"Triton {triton.__version__}: {name} compiles for sm_90; warp-specialized: "
                  f"{'ttg.warp_specialize' in ir}; wgmma kept in flight: {'pendings = 1' in ir}; setmaxnreg {regs}; "
                  f"shared memory {kernel.metadata.shared} bytes; {spilled_bytes(kernel)} bytes spilled")
    return failed


def main() -> int:
    if "--compile-only" in sys.argv:
        return compile_only()
    import torch

    from bench.gemm8 import operands, quantized
    from kiln.kernels import cublaslt, tma_gemm
    from kiln.kernels.gemm import TileConfig
    from kiln.tactics.timer import median_ms

    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__)
    tile = TileConfig(128, 128, 128, 4, 3)
    for name, M, K, N, act, fp8_out in SHAPES:
        x16, w16, b = operands(M, K, N)
        x8, sx, w8, sw = quantized(x16, w16, "fp8", "realistic")  # one weight scale, as cuBLASLt takes
        ys = torch.tensor(0.05, device="cuda") if fp8_out else None
        kw = dict(x_scale=sx, w_scale=sw, y_scale=ys)

        def theirs(kw=kw, act=act, x8=x8, w8=w8, b=b):
            return tma_gemm.gemm(x8, w8, b, act, config=tile, qtype="fp8", out_dtype=torch.float16, **kw)

        want = theirs()
        print(f"\n## {name}: M {M}, K {K}, N {N}, {act or 'no activation'}, {'FP8' if fp8_out else 'FP16'} output "
              f"({2 * M * K * N / 1e9:.1f} GFLOP)", flush=True)
        print(f"tma_gemm {tile.name}: {1000 * median_ms(theirs, runs=20):.1f} us", flush=True)
        try:
            lt_us = 1000 * median_ms(lambda: cublaslt.fp8_gemm(x8, w8, sx, sw, b, act, ys), runs=20)
            print(f"cuBLASLt FP8 with the epilogue: {lt_us:.1f} us", flush=True)
        except Exception as e:  # cuBLASLt offers no kernel for this epilogue here
            print(f"cuBLASLt FP8 with the epilogue: failed {type(e).__name__}: {e}", flush=True)
        for (bm, bn), stages in [(t, s) for t in TILES for s in STAGE_COUNTS]:
            check_and_time(f"gluon {bm}x{bn}x{BK} s{stages}",
                           lambda t=(bm, bn), s=stages: gemm(x8, w8, b, sx, sw, act, ys, t, s), want, "tma_gemm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
