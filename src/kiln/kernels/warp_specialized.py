"""What the warp-specialized Gluon kernels (ws_conv.py, ws_gemm.py) share: the register split between their
partitions, the shared layout of an 8-bit TMA box, the MMA partition's walk over the ring of stages, and the
8-bit quantization of their epilogues (gemm.quantize's arithmetic, so their outputs equal the Triton kernels')."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

# Registers a thread. A warp-specialized kernel runs as 8 warps (the loader's one padded to a warpgroup) and by
# default asks for 256 registers a thread, the whole register file for one program, handing the loader 24 of them
# (setmaxnreg). Capped at 128, every warp keeps 128 (no setmaxnreg is emitted) and two programs share an SM; three
# would need 85, below what ptxas can compile these kernels in (sm_90 PTX from Triton 3.8, 2026-12-01).
MAXNREG = 128
LOADER_REGS = gl.constexpr(24)  # the loader's registers where no cap is set


def box_layout(inner_bytes: int, rank: int):
    """The shared layout of an 8-bit TMA box whose rows are `inner_bytes` long: the widest swizzle they fill."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, inner_bytes), element_bitwidth=8, rank=rank)


@gluon.jit
def quantize8(v, inv_ys, QUANT: gl.constexpr, RELU: gl.constexpr):
    """gemm.quantize's 8-bit codes of FP32 v with 1 / y_scale inv_ys; RELU: of relu(v), by the clamp's lower end."""
    v = v * inv_ys
    if QUANT == "int8":
        if RELU:
            v = gl.maximum(v, 0.0)
        else:
            v = gl.maximum(v, -128.0)
        v = gl.minimum(v, 127.0)
        # round half to even by the FP32 adder, read out of the low mantissa bits (as gemm.quantize)
        return (v + 12582912.0).to(gl.int32, bitcast=True).to(gl.int8)
    else:
        if RELU:
            v = gl.maximum(v, 0.0)
        else:
            v = gl.maximum(v, -448.0)
        return gl.minimum(v, 448.0).to(gl.float8e4nv)


@gluon.jit
def mma_steps(acc, a_bufs, b_bufs, ready, empty, it, steps, STAGES: gl.constexpr):
    """`steps` K tiles of the ring (from position `it`) multiplied into acc, one 8-bit wgmma in flight, each stage
    handed back to the loader once the MMA reading it is done. Returns (acc, the ring position after them). An
    input box is read as the [BLOCK_M, BLOCK_K] left tile: a view of the same shared memory."""
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
