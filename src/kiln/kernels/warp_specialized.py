"""What the warp-specialized Gluon kernels (ws_conv.py, ws_gemm.py, halo_conv.py) share: the register split between
their partitions, the shared layout of an 8-bit TMA box, a GEMM loader's walk over K, the MMA partition's walk over
the ring of stages, the 8-bit quantization of their epilogues (gemm.quantize's codes, converted a pair at a time),
and the instructions of programmatic dependent launch (kernels/pdl.py)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# Registers a thread. A warp-specialized kernel runs as 8 warps (the loader's one padded to a warpgroup) and by
# default asks for 256 registers a thread, the whole register file for one program, handing the loader 24 of them
# (setmaxnreg). Capped at 128, every warp keeps 128 (no setmaxnreg is emitted) and two programs share an SM; three
# would need 85, below what ptxas can compile these kernels in (sm_90 PTX).
MAXNREG = 128
LOADER_REGS = gl.constexpr(24)  # the loader's registers where no cap is set


def box_fits(inner_bytes: int) -> bool:
    """Whether an 8-bit TMA box with rows `inner_bytes` long has a swizzled shared layout: rows of 32 or 64 bytes
    (their own swizzle width) or a whole number of 128-byte swizzles (a 96-byte row fits none)."""
    return inner_bytes in (32, 64) or (inner_bytes > 0 and inner_bytes % 128 == 0)


def box_layout(inner_bytes: int, rank: int):
    """The shared layout of an 8-bit TMA box whose rows are `inner_bytes` long (box_fits): the widest swizzle
    they fill."""
    assert box_fits(inner_bytes), inner_bytes
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, inner_bytes), element_bitwidth=8, rank=rank)


def box_descriptor(t, box: list[int]):
    """A TMA descriptor over the whole of 8-bit tensor t (its own shape and strides) whose box is `box`, in
    box_layout's shared layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), box, box_layout(box[-1], len(box)))


@gluon.constexpr_function
def accumulator_layout(block_n, num_warps):
    """The registers of a wgmma accumulator block_n columns wide over num_warps warps (one warpgroup)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 32])


@gluon.constexpr_function
def accumulator_dtype(quant):
    """An 8-bit wgmma's accumulator type: int32 for INT8, float32 for FP8."""
    return gl.int32 if quant == "int8" else gl.float32


@gluon.jit
def quantize8(v, QUANT: gl.constexpr, RELU: gl.constexpr):
    """gemm.quantize's 8-bit codes of FP32 [M, N] v, already in units of y_scale (RELU: of relu(v)), as [M, N / 2]
    16-bit pairs of neighbouring columns for store8: each pair converted, saturated and packed by one instruction
    (F2IP for INT8, F2FP for FP8, ptxas's fusion of the conversions below) where gemm.quantize's clamps, rounding
    add and byte packing took five a value. sm_90 SASS of ws_gemm's 128x128 tile with residual and ReLU, INT8
    2034 -> 1650 instructions, FP8 1922 -> 1458; the codes are the same for every number, and a NaN gives 0 (INT8)
    or stays NaN (FP8) where the clamps made it 0, -128 or +-448."""
    M: gl.constexpr = v.type.shape[0]
    N: gl.constexpr = v.type.shape[1]
    if QUANT == "int8":
        if RELU:
            v = gl.maximum(v, 0.0)  # folded into the conversion (F2IP's .RELU)
        lo, hi = gl.split(gl.reshape(v, [M, N // 2, 2]))
        # round half to even (as gemm.quantize's FP32 adder does), saturate to int8, pack lo into the low byte
        return gl.inline_asm_elementwise(
            "{ .reg .s32 a, b, p; cvt.rni.s32.f32 a, $1; cvt.rni.s32.f32 b, $2; cvt.pack.sat.s8.s32.b32 p, b, a, 0; "
            "cvt.u16.u32 $0, p; }", "=h,r,r", [lo, hi], dtype=gl.int16, is_pure=True, pack=1)
    else:
        # cvt.rn.satfinite saturates to +-448 itself; its .relu is the ReLU
        lo, hi = gl.split(gl.reshape(v, [M, N // 2, 2]))
        if RELU:
            return gl.inline_asm_elementwise("cvt.rn.satfinite.relu.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [lo, hi],
                                             dtype=gl.int16, is_pure=True, pack=1)
        else:
            return gl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [lo, hi],
                                             dtype=gl.int16, is_pure=True, pack=1)


@gluon.jit
def store8(smem, codes, ROW0: gl.constexpr = 0):
    """quantize8's code pairs into rows ROW0.. of the 8-bit [M, N] shared buffer smem, through a 16-bit view of the
    same bytes (the swizzle moves 16-byte chunks, whatever their elements)."""
    M: gl.constexpr = smem.type.shape[0]
    N: gl.constexpr = smem.type.shape[1]
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=smem.type.layout.swizzle_byte_width,
                                                element_bitwidth=16, rank=2)
    smem._reinterpret(gl.int16, [M, N // 2], layout).slice(ROW0, codes.type.shape[0]).store(codes)


@gluon.jit
def wait_for_previous_kernel():
    """griddepcontrol.wait: until the kernel before has finished and its writes are visible (kernels/pdl.py)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def let_next_kernel_start():
    """griddepcontrol.launch_dependents: the next kernel's programs may be scheduled (they take SM room as ours
    leave it, and wait for ours to finish before reading; kernels/pdl.py)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """A ring's barriers, STAGES of each kind, each for one arrival: `ready` (stage s has landed by TMA) and
    `empty` (the MMAs are done with stage s)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def load_resident(w_desc, w_res, w_ready):
    """Every K tile of a filter kept in shared memory once, on w_ready: K tile t is columns t * BLOCK_K of w's
    first BLOCK_N rows (one output-channel tile), into w_res[t]."""
    TILES: gl.constexpr = w_res.type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    mbarrier.expect(w_ready, TILES * w_desc.block_type.nbytes)
    for t in gl.static_range(TILES):
        tma.async_copy_global_to_shared(w_desc, [0, t * BLOCK_K], w_ready, w_res.index(t))


@gluon.jit
def load_k_tiles(x_desc, w_desc, a_bufs, b_bufs, ready, empty, it, off_m, off_n, K, STAGES: gl.constexpr):
    """A GEMM loader's K tiles of one output tile, x rows from off_m and w [N, K] rows from off_n, into the ring
    of stages from position `it`, each once the MMAs have handed its stage back. Returns the ring position after
    them."""
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    for kb in range(gl.cdiv(K, BLOCK_K)):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, kb * BLOCK_K], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [off_n, kb * BLOCK_K], ready.index(s), b_bufs.index(s))
        it += 1
    return it


@gluon.jit
def _mma_step(acc, a_bufs, b_bufs, ready, it, kb, STAGES: gl.constexpr, B_RESIDENT: gl.constexpr):
    """K tile kb (ring position `it`) multiplied into acc once it has landed; the wgmma left in flight."""
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_K: gl.constexpr = b_bufs.type.shape[2]
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    a = a_bufs.index(s).reshape([BLOCK_M, BLOCK_K])
    if B_RESIDENT:
        b = b_bufs.index(kb)
    else:
        b = b_bufs.index(s)
    acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc,))


@gluon.jit
def mma_steps(acc, a_bufs, b_bufs, ready, empty, it, steps, STAGES: gl.constexpr, B_RESIDENT: gl.constexpr = False):
    """`steps` (>= 1) K tiles of the ring (from position `it`) multiplied into the zero accumulator acc (gl.zeros),
    one 8-bit wgmma in flight, each stage handed back to the loader once the MMA reading it is done. Returns (acc,
    the ring position after them). The first step is outside the loop so that its wgmma takes acc's constant zeros,
    which the compiler turns into a wgmma that does not read its accumulator: zeroed in the loop, acc cost 88 SASS
    instructions a tile (ws_gemm's 128x128 INT8 tile, Triton 3.8: 1736 -> 1648). A stage is the [BLOCK_M, BLOCK_K]
    left tile (a convolution's [1, BH, BW, BK] box reshaped: a view of the same shared memory). B_RESIDENT: b_bufs
    holds every K tile of the right operand for good (K tile kb at kb), not a stage each."""
    acc = _mma_step(acc, a_bufs, b_bufs, ready, it, 0, STAGES, B_RESIDENT)
    for kb in range(1, steps):
        acc = _mma_step(acc, a_bufs, b_bufs, ready, it + kb, kb, STAGES, B_RESIDENT)
        mbarrier.arrive(empty.index((it + kb - 1) % STAGES))  # the MMA before this one has finished: refill its stage
    it += steps
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it - 1) % STAGES))
    return acc, it
