"""Flash-attention forward on Hopper with TMA and wgmma, written in Gluon: attention.py's arithmetic (the online
softmax in base 2, the FP8 codes' scale folded in) with every q, k and v tile brought by TMA.

Why: at BERT-base batch 32 (sequence 128, head dim 64) Triton compiles attention.py's kernel to plain global loads
that the loop waits on (its sm_90 PTX has no cp.async and no TMA), so each of the 384 programs waits on memory once
per key block for k and again for v; the kernel took 8.4-8.9 us a layer in the FP8 engine (bench/results/
H200-trace-bert-b32-fp8-0643.md), far above its bytes (12.5 MB, about 3 us). Here a program asks for its q tile and
the first STAGES key blocks' k and v at once, and the next blocks while it computes.

One 4- or 8-warp program per (BLOCK_M queries, batch x head): S = q k^T on the Tensor Cores from shared memory (FP8
codes on FP8 ones), the softmax in registers, then O += p v with p from registers in the float type. FP8 v is
converted to that type through a shared buffer (wgmma multiplies like types, and FP8 takes only K-major operands).

Takes: q, k, v of rank 3 or 4 whose rows sit at one stride (batch and head as row or column offsets: heads
interleaved within each position, as a fused QKV projection writes them, or heads contiguous), the last dim
contiguous, FP16/BF16 or FP8 codes of one scale; k not transposed; head dims 32, 64 or 128; sequence lengths whole
numbers of blocks; an additive mask broadcastable to [B, H, Sq, Sk]; a Hopper GPU. Triton's interpreter does not run
Gluon: CI compiles the kernel for sm_90 (tests/kernels/test_gluon_compile.py) and the GPU tests compare it with
attention.reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

from .attention import _LOG2E, FP8, _as4d, _like_q, _shapes
from .gemm import QTYPES, quantize

HEAD_DIMS = (32, 64, 128)
_GL = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
_LOG2E_C = gl.constexpr(_LOG2E)
_thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.8's name, 3.6's


@dataclass(frozen=True)
class TmaFlashConfig:
    """Tiles of block_m queries, keys taken block_n at a time, num_warps warps a program, per_sm programs an SM."""

    block_m: int
    block_n: int
    num_warps: int
    per_sm: int

    @property
    def name(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_x{self.per_sm}"

    def key_blocks(self, sk: int) -> int:
        """Key blocks held in shared memory for sk keys (a power of two: one compiled kernel per bucket)."""
        return triton.next_power_of_2(sk // self.block_n)

    def smem_bytes(self, sk: int, d: int, dv: int, itemsize: int) -> int:
        """Two tiles' q and every key block's k and v, v converted to the float type (FP8 codes), the output tile
        in FP32 for its change of layout, the barriers."""
        keys = self.key_blocks(sk) * self.block_n
        converted = self.block_n * dv * 2 if itemsize == 1 else 0
        return (2 * (self.block_m * d + keys * (d + dv)) * itemsize + converted + self.block_m * dv * 4
                + 16 * (1 + self.key_blocks(sk)))


# (config, lowest optimization level that offers it)
CONFIGS: list[tuple[TmaFlashConfig, int]] = [
    (TmaFlashConfig(64, 128, 4, 3), 3),
    (TmaFlashConfig(64, 64, 4, 3), 3),
    (TmaFlashConfig(128, 128, 8, 1), 3),
    (TmaFlashConfig(64, 128, 4, 2), 4),
]


@gluon.jit
def _tile_coords(tile, tiles_m, H):
    """(batch, head, query block) of a tile; a head's query blocks are neighbours."""
    bh = tile // tiles_m
    return bh // H, bh % H, tile % tiles_m


@gluon.jit
def _load_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, buf, tile, tiles_m, H, kv_blocks,
               q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch):
    """A tile's q and each key block j's k and v, by TMA, into buffer set `buf`: q arriving on its first barrier,
    key block j on barrier 1 + j. Each operand is a 2-D [rows, columns] view whose batch and head offset its rows or
    its columns (_rows_view)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    KEY_BLOCKS: gl.constexpr = k_bufs.type.shape[0] // 2
    b, h, pid_m = _tile_coords(tile, tiles_m, H)
    bar = bars.index(buf * (1 + KEY_BLOCKS))
    mbarrier.expect(bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b * q_rb + h * q_rh + pid_m * BLOCK_M, h * q_ch], bar, q_bufs.index(buf))
    for j in range(kv_blocks):
        bar = bars.index(buf * (1 + KEY_BLOCKS) + 1 + j)
        kv = buf * KEY_BLOCKS + j
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b * k_rb + h * k_rh + j * BLOCK_N, h * k_ch], bar, k_bufs.index(kv))
        tma.async_copy_global_to_shared(v_desc, [b * v_rb + h * v_rh + j * BLOCK_N, h * v_ch], bar, v_bufs.index(kv))


@gluon.jit
def _tma_flash_kernel(q_desc, k_desc, v_desc, o_ptr, m_ptr, ys_ptr, qs_ptr, B, H, SQ, SK, qk_scale,
                      q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, smb, smh, smm, smn, sob, soh, som,
                      HAS_MASK: gl.constexpr, MASK_ROW: gl.constexpr, NAN_GUARD: gl.constexpr,
                      QUANT: gl.constexpr, QKV_SCALED: gl.constexpr, CDT: gl.constexpr, KEY_BLOCKS: gl.constexpr,
                      num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    DV: gl.constexpr = v_desc.block_type.shape[1]
    K_STEP: gl.constexpr = 256 // q_desc.dtype.primitive_bitwidth  # a wgmma's K: 32 for FP8 codes, 16 for FP16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # threads holding 8 neighbouring columns of a row (the MMA layouts' hold 2): v's conversion, the output's store
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    NB: gl.constexpr = 1 + KEY_BLOCKS  # barriers a tile: q's, then one per key block

    # two tiles' operands: the next tile's arrive while this one is computed
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2 * KEY_BLOCKS] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2 * KEY_BLOCKS] + v_desc.block_type.shape, v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2 * NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * NB):
        mbarrier.init(bars.index(i), count=1)
    if QKV_SCALED:  # wgmma multiplies like types: v's codes go through a float copy for p v
        v_float = gl.allocate_shared_memory(CDT, v_desc.block_type.shape,
                                            gl.NVMMASharedLayout.get_default_for(v_desc.block_type.shape, CDT))
        qs = gl.load(qs_ptr).to(gl.float32)
        qk_scale = qk_scale * qs * qs  # q k^T carries the codes' scale twice, p v once (applied at the end)

    tiles_m = SQ // BLOCK_M
    tiles = tiles_m * B * H
    kv_blocks = SK // BLOCK_N
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if pid < tiles:
        _load_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, 0, pid, tiles_m, H, kv_blocks,
                   q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch)
    i = 0
    for tile in range(pid, tiles, nprog):
        x = i % 2
        phase = (i // 2) & 1
        nxt = tile + nprog
        if nxt < tiles:  # into the buffers the previous tile used: every warp is done with them
            _thread_barrier()
            _load_tile(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, 1 - x, nxt, tiles_m, H, kv_blocks,
                       q_rb, q_rh, q_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch)
        b, h, pid_m = _tile_coords(tile, tiles_m, H)
        if HAS_MASK:
            mask_base = m_ptr + b * smb + h * smh
            if not MASK_ROW:
                q_rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_s)
                mask_base = mask_base + q_rows[:, None] * smm
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=rows_s)
        acc = gl.zeros([BLOCK_M, DV], gl.float32, layout=o_layout)
        mbarrier.wait(bars.index(x * NB), phase)
        for j in range(kv_blocks):
            if HAS_MASK:  # asked for before the wait below, so its latency hides behind it
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_s)
                if MASK_ROW:  # one mask row for every query (BERT's padding mask), in log2 units once per column
                    bias = (gl.load(mask_base + cols * smn).to(gl.float32) * _LOG2E_C)[None, :]
                else:
                    bias = gl.load(mask_base + cols[None, :] * smn).to(gl.float32) * _LOG2E_C
            mbarrier.wait(bars.index(x * NB + 1 + j), phase)
            kv = x * KEY_BLOCKS + j
            qk = warpgroup_mma(q_bufs.index(x), k_bufs.index(kv).permute((1, 0)),
                               gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
            if QKV_SCALED:  # while q k^T runs (the previous p v has finished with v_float)
                v_float.store(v_bufs.index(kv).load(rows_layout).to(CDT))
                fence_async_shared()
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            if HAS_MASK:  # log2 units, one FMA an element
                sc = qk * qk_scale + bias
            else:
                sc = qk * qk_scale
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # all keys so far masked: nothing to subtract
            p = gl.exp2(sc - m_ref[:, None])
            alpha = gl.exp2(m_i - m_ref)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
            p_op = gl.convert_layout(p.to(CDT), p_layout)
            if QKV_SCALED:
                acc = warpgroup_mma(p_op, v_float, acc, is_async=True)
            else:
                acc = warpgroup_mma(p_op, v_bufs.index(kv), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            m_i = m_new

        # one division a row, not one an element (FP8 codes: their scale folded in); a fully masked row (l == 0)
        # gives 0 * inf = NaN without nan_guard, like softmax over all -inf
        l_o = gl.convert_layout(l_i, rows_o)
        inv_l = (qs if QKV_SCALED else 1.0) / l_o
        out = acc * inv_l[:, None]
        if NAN_GUARD:
            out = gl.where((l_o > 0.0)[:, None], out, 0.0)
        out = gl.convert_layout(out.to(CDT), rows_layout)
        if QUANT != "":  # 8-bit output for the quantized layer after (rounded to the float type first, as attention.py)
            out = quantize(out, ys_ptr, QUANT)
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
        cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, rows_layout))
        gl.store(o_ptr + b * sob + h * soh + rows[:, None] * som + cols_o[None, :], out.to(o_ptr.dtype.element_ty))
        i += 1
    for i in gl.static_range(2 * NB):
        mbarrier.invalidate(bars.index(i))


def _rows_view(t: torch.Tensor):
    """(batch row offset, head row offset, head column offset, row stride) of t [B, H, S, D] seen as one 2-D matrix
    of rows at a single stride, or None: heads interleaved within a position (a fused projection's output, column
    offsets) or stacked ([B, H, S, D], row offsets); a broadcast batch or head (stride 0) offsets nothing. Rows may
    overlap (the kernel only reads them)."""
    B, H, S, D = t.shape
    sb, sh, ss, sd = t.stride()
    if sd != 1 or ss < D or (B > 1 and sb % ss):
        return None
    rb = sb // ss if B > 1 else 0
    if sh == 0 or H == 1:
        return rb, 0, 0, ss
    if sh % ss == 0:
        return rb, sh // ss, 0, ss
    if (H - 1) * sh + D <= ss:
        return rb, 0, sh, ss
    return None


def supports(q, k, v, mask=None, k_transposed: bool = False, fp8: bool = False,
             config: TmaFlashConfig | None = None) -> bool:
    """Operands this kernel takes (the module's docstring says which), on a Hopper GPU."""
    from .attention import supports as flash_supports

    if k_transposed or not flash_supports(q, k, v, mask, False, fp8):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if not fp8 and q.dtype not in _GL:
        return False
    q4, k4, v4 = (_as4d(t) for t in (q, k, v))
    B, H = q4.shape[0], q4.shape[1]
    k4, v4 = k4.expand(B, H, *k4.shape[2:]), v4.expand(B, H, *v4.shape[2:])
    sq, sk, d, dv = q4.shape[2], k4.shape[2], q4.shape[3], v4.shape[3]
    if d not in HEAD_DIMS or dv not in HEAD_DIMS:
        return False
    if config is not None:
        if sq % config.block_m or sk % config.block_n:
            return False
        smem = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin
        if config.smem_bytes(sk, d, dv, q.element_size()) > smem:
            return False
    for t in (q4, k4, v4):
        view = _rows_view(t)
        if view is None or (view[3] * t.element_size()) % 16 or t.data_ptr() % 16 or (view[2] * t.element_size()) % 16:
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int):
    """t [B, H, S, D] as a 2-D TMA view whose box is `rows` rows by the head dim."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, H, S, D = t.shape
    rb, rh, ch, ss = _rows_view(t)
    shape = [(B - 1) * rb + (H - 1) * rh + S, (H - 1) * ch + D]
    dtype = gl.float8e4nv if t.dtype == FP8 else _GL[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, D], dtype)
    return TensorDescriptor(t, shape, [ss, 1], [rows, D], layout), (rb, rh, ch)


def flash_attention(q, k, v, mask=None, scale: float | None = None, nan_guard: bool = False,
                    config: TmaFlashConfig = CONFIGS[0][0], y_scale: torch.Tensor | None = None, qtype: str = "",
                    qkv_scale: torch.Tensor | None = None, float_type: torch.dtype = torch.float16) -> torch.Tensor:
    """attention.flash_attention's result (k not transposed) on this kernel."""
    lead, sq, sk, d, dv = _shapes(q, k, v, False)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cdt = float_type if qkv_scale is not None else q.dtype
    o = _like_q(q, (*lead, sq, dv), QTYPES[qtype] if y_scale is not None else cdt)
    q4, k4, v4, o4 = _as4d(q), _as4d(k), _as4d(v), _as4d(o)
    B, H = q4.shape[0], q4.shape[1]
    k4, v4 = k4.expand(B, H, *k4.shape[2:]), v4.expand(B, H, *v4.shape[2:])
    q_desc, q_off = _descriptor(q4, config.block_m)
    k_desc, k_off = _descriptor(k4, config.block_n)
    v_desc, v_off = _descriptor(v4, config.block_n)
    if mask is not None:
        m4 = _as4d(mask.expand(*lead, sq, sk))
        ms = m4.stride()
    else:
        m4, ms = q4, (0, 0, 0, 0)
    from .tma_gemm import programs as sm_count

    tiles = sq // config.block_m * B * H
    _tma_flash_kernel[(min(tiles, config.per_sm * sm_count(q.device)),)](
        q_desc, k_desc, v_desc, o4, m4, y_scale if y_scale is not None else q4,
        qkv_scale if qkv_scale is not None else q4, B, H, sq, sk, scale * _LOG2E, *q_off, *k_off, *v_off, *ms,
        o4.stride(0), o4.stride(1), o4.stride(2),
        HAS_MASK=mask is not None, MASK_ROW=mask is not None and ms[2] == 0, NAN_GUARD=bool(nan_guard),
        QUANT=qtype if y_scale is not None else "", QKV_SCALED=qkv_scale is not None, CDT=_GL[cdt],
        KEY_BLOCKS=config.key_blocks(sk), num_warps=config.num_warps)
    return o
