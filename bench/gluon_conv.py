"""Experiment: the 8-bit 3x3 TMA convolution written in Gluon, warp-specialized, against Kiln's Triton one.

Nsight Compute found the Triton TMA convolution latency-bound on the H200 (bench/results/H200-ncu-*-1108.log:
Tensor Cores 22-30% busy, two 4-warp programs an SM, warps stalled on dependencies, global loads and barriers).
Here a loader warp fills a ring of shared-memory stages by TMA ([1, 8, 8, 128] input boxes, one per filter tap
and channel block, and [128, 128] weight tiles), running ahead into the next output tile while the 4-warp MMA
partition finishes the last one; the MMA partition reads each box as the wgmma's [64, 128] left tile straight
from shared memory and keeps one INT8 wgmma in flight. The epilogue is tma_conv's (gemm.finish's arithmetic:
x_scale * w_scale[oc], bias, the ReLU in the clamp, the next layer's INT8 quantization), so the outputs must be
equal. Stride 1, pad 1, C a multiple of 128, no residual: ResNet-50's stride-1 3x3 layers of stages 2-4.

Triton's own kernels do neither (bench/sm90_compile.py): its pipeliner waits for every INT8 wgmma, and the box
reaches the MMA through registers; its automatic warp specialization does not apply to these loops. Gluon
(`triton.experimental.gluon`, Triton's lower-level language) states all three. Compiled for sm_90 on the CPU
(2026-12-01) with Triton 3.6.0, the GPU machine's, and 3.8.0, CI's: `ttg.warp_specialize` in the IR, one wgmma
kept in flight (`pendings = 1`), the box reshaped as a shared-memory view, 107 KB of shared memory and 128
registers a thread (two programs an SM), no spills. Under 3.6 a warp-specialized default partition cannot return
a tensor, so it stores its own result.
Not yet run on a GPU; Triton's interpreter does not run Gluon.

    python bench/gluon_conv.py                     (GPU: each variant against tma_conv's output, and timed)
    python bench/gluon_conv.py --compile-only      (any machine: compiles the kernel for sm_90)
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

BH, BW, BN, BK = 8, 8, 128, 128  # an 8x8 patch of output pixels by 128 channels; K walked 128 channels a tap
STAGES = 4
# the GPU run's variants: (block_h, block_w) patches, ring stages, programs an SM
PATCHES, STAGE_COUNTS, PER_SM = [(8, 8), (8, 16), (16, 8)], [3, 4], [1, 2]


@gluon.jit
def relu_int8(v, inv_ys):
    """gemm.quantize's INT8 codes of relu(v) (v dequantized, biased and with any residual added, in gemm.finish's
    order), the ReLU in the clamp: v / y_scale rounded to nearest even by the FP32 adder."""
    v = gl.minimum(gl.maximum(v * inv_ys, 0.0), 127.0)
    return (v + 12582912.0).to(gl.int32, bitcast=True).to(gl.int8)


@gluon.jit
def mma_steps(acc, a_bufs, b_bufs, ready, empty, it, steps, STAGES: gl.constexpr):
    """`steps` K tiles of the ring (from position `it`) multiplied into acc, one INT8 wgmma in flight, each stage
    handed back to the loader once the MMA reading it is done. Returns (acc, the ring position after them). A
    convolution's [1, BH, BW, BK] box is read as the [BH * BW, BK] left tile, a view of the same shared memory."""
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_K: gl.constexpr = b_bufs.type.shape[2]
    for kb in range(steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_bufs.index(s).reshape([BLOCK_M, BLOCK_K])
        acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if kb > 0:  # the MMA before this one has finished: its stage can be refilled
            mbarrier.arrive(empty.index((it - 1) % STAGES))
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it - 1) % STAGES))
    return acc, it


@gluon.jit
def _tile(tile, tiles_w, tiles_hw, tiles_n, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr):
    """(image, first output row, first output column, first channel) of output tile `tile`; channel tiles of one
    patch are neighbours, as in tma_conv."""
    patch = tile // tiles_n
    return (patch // tiles_hw, (patch % tiles_hw) // tiles_w * BLOCK_H, (patch % tiles_w) * BLOCK_W,
            (tile % tiles_n) * BLOCK_N)


@gluon.jit
def _loader(x_desc, w_desc, a_bufs, b_bufs, ready, empty, tiles, tiles_w, tiles_hw, tiles_n, C,
            programs, STAGES: gl.constexpr):
    BLOCK_H: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_W: gl.constexpr = x_desc.block_type.shape[2]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    c_blocks = C // BLOCK_K
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img, oh0, ow0, off_n = _tile(tile, tiles_w, tiles_hw, tiles_n, BLOCK_H, BLOCK_W, BLOCK_N)
        for kb in range(9 * c_blocks):
            tap = kb // c_blocks
            c0 = (kb % c_blocks) * BLOCK_K
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            # the box shifted by the tap; rows and columns past the image read zeros: the padding
            tma.async_copy_global_to_shared(x_desc, [img, oh0 + tap // 3 - 1, ow0 + tap % 3 - 1, c0], ready.index(s),
                                            a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [off_n, tap * C + c0], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _mma_epilogue(y_desc, a_bufs, b_bufs, ready, empty, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles, tiles_w,
                  tiles_hw, tiles_n, C, programs, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_H: gl.constexpr = y_desc.block_type.shape[1]
    BLOCK_W: gl.constexpr = y_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[3]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[4]
    BLOCK_M: gl.constexpr = BLOCK_H * BLOCK_W
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    cols_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    inv_ys = 1.0 / gl.load(ys_ptr).to(gl.float32)
    xs = gl.load(xs_ptr).to(gl.float32)
    c_blocks = C // BLOCK_K
    it = 0
    for tile in range(gl.program_id(0), tiles, programs):
        img, oh0, ow0, off_n = _tile(tile, tiles_w, tiles_hw, tiles_n, BLOCK_H, BLOCK_W, BLOCK_N)
        cols = off_n + gl.arange(0, BLOCK_N, layout=cols_layout)
        scale = xs * gl.load(ws_ptr + cols).to(gl.float32)  # loaded while the loader fills the ring
        bias = gl.load(b_ptr + cols).to(gl.float32)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.int32, layout=acc_layout)
        acc, it = mma_steps(acc, a_bufs, b_bufs, ready, empty, it, 9 * c_blocks, STAGES)
        out = relu_int8(acc.to(gl.float32) * scale[None, :] + bias[None, :], inv_ys)
        tma.store_wait(pendings=0)  # the last tile's store has read y_smem
        y_smem.reshape([BLOCK_M, BLOCK_N]).store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(y_desc, [img, oh0, ow0, off_n], y_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_conv_kernel(x_desc, w_desc, y_desc, b_ptr, xs_ptr, ws_ptr, ys_ptr, N, OH, OW, OC, C,
                    programs, STAGES: gl.constexpr, num_warps: gl.constexpr):
    tiles_w = gl.cdiv(OW, y_desc.block_type.shape[2])
    tiles_hw = gl.cdiv(OH, y_desc.block_type.shape[1]) * tiles_w
    tiles_n = gl.cdiv(OC, y_desc.block_type.shape[3])
    tiles = N * tiles_hw * tiles_n
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    y_smem = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_epilogue, (y_desc, a_bufs, b_bufs, ready, empty, y_smem, b_ptr, xs_ptr, ws_ptr, ys_ptr, tiles, tiles_w,
                         tiles_hw, tiles_n, C, programs, STAGES, num_warps)),
        (_loader, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, tiles, tiles_w, tiles_hw, tiles_n, C, programs,
                   STAGES)),
    ], [1], [24])


def int8_layout(inner: int, rank: int = 2):
    """The shared layout of an 8-bit TMA box whose rows are `inner` bytes: the widest swizzle they fill."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, inner), element_bitwidth=8, rank=rank)


# Registers a thread, for the kernel's two warpgroups (the 4-warp MMA partition, the loader warp's group): a
# warp-specialized kernel otherwise assumes 256, the whole register file for one program. At 128, two programs
# share an SM; setmaxnreg then gives the loader 24 and the MMA partition the rest (Gluon's tutorial 08).
MAXNREG = 128


def conv2d(x8, w8, b, x_scale, w_scale, y_scale, programs_per_sm: int = 2, stages: int = STAGES,
           patch: tuple[int, int] = (BH, BW)):
    """relu(conv3x3(x8, w8) * x_scale * w_scale + b) quantized with y_scale, as tma_conv.conv2d computes it for a
    QConv with an 8-bit output: channels-last int8 x [N, C, H, W] and w [OC, C, 3, 3], C % 128 == 0, stride 1,
    pad 1. Returns the channels-last int8 output as an NCHW-shaped view."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    N, C, H, W = x8.shape
    OC = w8.shape[0]
    assert C % BK == 0 and OC % BN == 0 and w8.shape[2:] == (3, 3)
    x_rows = x8.permute(0, 2, 3, 1)  # [N, H, W, C], contiguous for a channels-last x
    w_rows = w8.permute(0, 2, 3, 1).reshape(OC, 9 * C)  # [OC, (r, s, c)]: K-major
    y = torch.empty((N, H, W, OC), dtype=torch.int8, device=x8.device)
    bh, bw = patch
    x_desc = TensorDescriptor(x_rows, list(x_rows.shape), list(x_rows.stride()), [1, bh, bw, BK], int8_layout(BK, 4))
    w_desc = TensorDescriptor(w_rows, list(w_rows.shape), list(w_rows.stride()), [BN, BK], int8_layout(BK))
    y_desc = TensorDescriptor(y, list(y.shape), list(y.stride()), [1, bh, bw, BN], int8_layout(BN, 4))
    tiles = N * triton.cdiv(H, bh) * triton.cdiv(W, bw) * (OC // BN)
    programs = min(tiles, programs_per_sm * torch.cuda.get_device_properties(x8.device).multi_processor_count)
    _ws_conv_kernel[(programs,)](x_desc, w_desc, y_desc, b, x_scale, w_scale.float().contiguous(), y_scale,
                                 N, H, W, OC, C, programs, STAGES=stages, num_warps=4, maxnreg=MAXNREG)
    return y.permute(0, 3, 1, 2)


def compile_and_report(src, name: str, box_view: bool = False) -> int:
    """Compile src for sm_90 with MAXNREG registers a thread and print what the compiler made of it (warp
    specialization, a wgmma kept in flight, with box_view the convolution's box read as a shared-memory view, shared
    memory, spills); 1 if it did not compile, else 0."""
    from bench.sm90_compile import spilled_bytes

    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": MAXNREG})
    except Exception as e:
        print(f"Triton {triton.__version__}: {name} FAILED {type(e).__name__}: {str(e)[:300]}")
        return 1
    ir = kernel.asm["ttgir"]
    box = f"; box read from shared memory: {'memdesc_reshape' in ir}" if box_view else ""
    print(f"Triton {triton.__version__}: {name} compiles for sm_90; warp-specialized: {'ttg.warp_specialize' in ir}; "
          f"wgmma kept in flight: {'pendings = 1' in ir}{box}; shared memory {kernel.metadata.shared} bytes; "
          f"{spilled_bytes(kernel)} bytes spilled")
    return 0


def check_and_time(label: str, call, want, reference: str) -> None:
    """One variant: its output against the Triton kernel's (`want`), then its time; one line either way."""
    import torch

    from kiln.tactics.timer import median_ms

    try:
        got = call()
        off = (got.float() - want.float()).abs().max().item()
        t = 1000 * median_ms(call, runs=20)
        print(f"{label}: {t:.1f} us, equal to {reference}: {torch.equal(got, want)} (max difference {off:.0f} "
              "steps)", flush=True)
    except Exception as e:  # a variant that does not compile or run here
        print(f"{label}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)


def compile_only() -> int:
    """Each variant the GPU run times, compiled for sm_90; 1 if one failed."""
    box4, box2 = int8_layout(BK, 4), int8_layout(BK)
    failed = 0
    for (bh, bw), stages in [(p, s) for p in PATCHES for s in STAGE_COUNTS]:
        sig = {"x_desc": f"tensordesc<i8[1,{bh},{bw},{BK}],{box4!r}>",
               "w_desc": f"tensordesc<i8[{BN},{BK}],{box2!r}>", "y_desc": f"tensordesc<i8[1,{bh},{bw},{BN}],{box4!r}>",
               "b_ptr": "*fp16", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "ys_ptr": "*fp32",
               **{p: "i32" for p in ("N", "OH", "OW", "OC", "C")},
               "programs": "i32", "STAGES": "constexpr", "num_warps": "constexpr"}
        src = GluonASTSource(_ws_conv_kernel, sig, constexprs={"STAGES": stages, "num_warps": 4})
        failed |= compile_and_report(src, f"{bh}x{bw}x{BN}x{BK} s{stages}", box_view=True)
    return failed


def main() -> int:
    if "--compile-only" in sys.argv:
        return compile_only()
    import torch

    from bench.conv_sweep import node
    from kiln.kernels import tma_conv
    from kiln.kernels.tma_conv import PatchConfig
    from kiln.tactics.timer import median_ms

    print(torch.cuda.get_device_name(), torch.__version__, "Triton", triton.__version__)
    cl = torch.channels_last
    for name, hw, c in (("layer2 3x3", 28, 128), ("layer3 3x3", 14, 256), ("layer4 3x3", 7, 512)):
        g = torch.Generator(device="cuda").manual_seed(0)
        i8 = dict(device="cuda", generator=g, dtype=torch.int8)
        x8 = torch.randint(-128, 128, (32, c, hw, hw), **i8).to(memory_format=cl)
        w8 = torch.randint(-127, 128, (c, c, 3, 3), **i8).to(memory_format=cl)
        b = torch.randn(c, device="cuda", generator=g).half()
        xs, ys = torch.tensor(0.02, device="cuda"), torch.tensor(0.05, device="cuda")
        ws = torch.rand(c, device="cuda", generator=g) * 1e-3
        triton_tile = PatchConfig(8, 8, 128, 128, 4, 4)

        def theirs():
            return tma_conv.conv2d(node(3, 1, "int8"), x8, w8, b, config=triton_tile, x_scale=xs, w_scale=ws,
                                   y_scale=ys, out_dtype=torch.float16)

        want = theirs()
        print(f"\n## {name}: batch 32, {hw}x{hw}, {c} -> {c} channels", flush=True)
        print(f"tma_conv {triton_tile.name}: {1000 * median_ms(theirs, runs=20):.1f} us", flush=True)
        for patch in PATCHES:
            for stages in STAGE_COUNTS:
                for per_sm in PER_SM:
                    run = dict(programs_per_sm=per_sm, stages=stages, patch=patch)
                    check_and_time(f"gluon {patch[0]}x{patch[1]}x{BN}x{BK} s{stages} x{per_sm}/SM",
                                   lambda run=run: conv2d(x8, w8, b, xs, ws, ys, **run), want, "tma_conv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
