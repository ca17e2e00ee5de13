"""Weight-only matrix multiply for the few rows of a decode step: y = x @ (codes * scale[:, None]).T.

x [M, K] BF16/FP16/FP32 activations (M small: one row per decoding sequence), codes [N, K] FP8 E4M3 or INT8
weights (row-major, as `torch.nn.functional.linear` holds a weight; BF16/FP16 weights take the same kernel
without a scale: kernels/bf16_gemv.py), scale [N] FP32 per output channel. The weight is read once, in its own
width, converted in registers and multiplied on the tensor cores with FP32 accumulation; the per-channel scale
multiplies the accumulator once.

The type the dot runs in (`compute_dtype`): 8-bit codes always go to FP16, since Hopper converts a pair of E4M3
codes to FP16 in one instruction but to BF16 only through FP32, which held the GEMV to a third of HBM's speed.
BF16 activations are then converted to FP16 in the kernel, multiplied by 2^-4 first (exact: a power of two) so
that values up to 2^20 stay finite; the accumulator takes the 2^4 back with the scale. 16-bit weights run in
their own type.

Tiles are "swapped" for small M: each program computes acc [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] @
x_tile.T [BLOCK_K, BLOCK_M], so the weight fills the MMA's large dimension and the few activation rows its
small one (BLOCK_M = M rounded up to a power of two, at least the tile's block_m: 16, or 8, the MMA's narrowest
width, which halves the activations' conversions; the padding columns are zeros).

Split-K gives every SM work when N alone has too few tiles (N = 4096 is 64 tiles of 64 on 132 SMs). Each split
writes its FP32 partial sums to a workspace and counts itself in a per-tile counter; the split that arrives last
adds every split's partials in split order and writes the output, then resets the counter. One launch, and a
row's result does not depend on timing (the sum's order is fixed) nor on M (the tile and split never depend on
M). The counters are one buffer per device, which is safe because kernels of one stream run one after another.

On Hopper the kernels are launched as programmatic dependents (kernels/pdl.py): a program may be scheduled while
the kernel before is finishing and waits (griddepcontrol.wait) before its first load. The weight is not
prefetched into L2 ahead of the loads: that was slower (docs/design/decode-gemv.md).

`choose_config` picks a tile per weight shape and type once: on CUDA outside graph capture it times the
candidates on the device; otherwise it uses the heuristic. `reference` is the same product in torch.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .gated_act import act_mul
from .pdl import launch_options

FP8 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CODES = (FP8, torch.int8, torch.bfloat16, torch.float16)  # 16-bit weights: the same GEMV without a scale
MAX_M = 64  # rows one program holds at most (as the MMA's small dimension); larger batches belong to a GEMM
X_SCALE_BF16 = 2.0 ** -4  # BF16 activations going to an FP16 dot are multiplied by this (exact), see above
MAX_TILES = 1 << 16  # output tiles one launch may count (the split-K counter buffer's length)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _store_or_reduce(acc, y_ptr, part_ptr, count_ptr, pid_n, pid_k, rn, rm, M, N, stride_ym, splits):
    """Write acc [BLOCK_N, BLOCK_M] (FP32, rows rn of the output's columns, rm its rows). With splits > 1: the
    partials go to part [splits, M, N]; the split that counts itself last sums all of them in split order."""
    ok = (rn[:, None] < N) & (rm[None, :] < M)
    if splits == 1:
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        offs = rm[None, :] * N + rn[:, None]
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=ok)
        tl.debug_barrier()  # every thread's partials are written before the count says so
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                total += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], total.to(y_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch (and the next graph replay)


@triton.jit
def _gated_row(x_ptr, K, cols, ok, rm, ACT: tl.constexpr):
    """The activation tile [len(cols), len(rm)] of a one-row x = [gate | up]: act(gate) * up at cols for row 0,
    rounded to x's type (as act_and_mul stores it), zeros in the other columns (as the masked load leaves them).
    The activation is computed once a column of K, not once for each of the tile's padding rows too."""
    a = act_mul(tl.load(x_ptr + cols, mask=ok, other=0.0), tl.load(x_ptr + K + cols, mask=ok, other=0.0), ACT)
    a = a.to(x_ptr.dtype.element_ty)
    return tl.where(rm[None, :] == 0, a[:, None], tl.zeros_like(a)[:, None])


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, splits, stride_xm,
                 stride_wn, stride_ym, X_SCALE: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
                 HAS_SCALE: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr, ONE_ROW: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
    row_ok = rm[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN:  # N and every split's K range are whole tiles
            w = tl.load(w_ptrs)
            if ACT != "" and ONE_ROW:  # x is [gate | up] (see _gated_row)
                xt = _gated_row(x_ptr, K, k + rk, rk < BLOCK_K, rm, ACT)
            else:
                xt = tl.load(x_ptrs, mask=row_ok, other=0.0)
                if ACT != "":  # x is [gate | up]: act(gate) * up, rounded as act_and_mul's output is
                    xt = act_mul(xt, tl.load(x_ptrs + K, mask=row_ok, other=0.0), ACT).to(x_ptr.dtype.element_ty)
        else:
            k_ok = (k + rk) < k_hi
            w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
            if ACT != "" and ONE_ROW:
                xt = _gated_row(x_ptr, K, k + rk, k_ok, rm, ACT)
            else:
                xt = tl.load(x_ptrs, mask=row_ok & k_ok[:, None], other=0.0)
                if ACT != "":
                    xt = act_mul(xt, tl.load(x_ptrs + K, mask=row_ok & k_ok[:, None], other=0.0),
                                 ACT).to(x_ptr.dtype.element_ty)
        if X_SCALE != 1.0:
            xt = xt.to(tl.float32) * X_SCALE
        acc = tl.dot(w.to(CDT), xt.to(CDT), acc, input_precision=PREC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_SCALE:
        acc = acc * (tl.load(s_ptr + rn, mask=rn < N, other=0.0) * (1.0 / X_SCALE))[:, None]
    elif X_SCALE != 1.0:
        acc = acc * (1.0 / X_SCALE)
    _store_or_reduce(acc, y_ptr, part_ptr, count_ptr, pid_n, pid_k, rn, rm, M, N, stride_ym, splits)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, N, K, k_per_split, splits, stride_wn,
                     HAS_SCALE: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ACT: tl.constexpr):
    """One row of x (M = 1) without the tensor cores: each thread multiplies its weights by x in FP32 and keeps
    the products' sums per position of the tile, added across the tile once at the end. Nothing is staged in
    shared memory and no dot needs 16 rows, so a program is small and an SM holds many."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + k_lo + rk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs)
            xv = tl.load(x_ptrs)
            if ACT != "":  # x is [gate | up] (see _gemv_kernel)
                xv = act_mul(xv, tl.load(x_ptrs + K), ACT).to(x_ptr.dtype.element_ty)
        else:
            k_ok = (k + rk) < k_hi
            w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0)
            if ACT != "":
                xv = act_mul(xv, tl.load(x_ptrs + K, mask=k_ok, other=0.0), ACT).to(x_ptr.dtype.element_ty)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out = out * tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    _store_or_reduce(out[:, None], y_ptr, part_ptr, count_ptr, pid_n, pid_k, rn, tl.arange(0, 1), 1, N, 0,
                     splits)


@triton.jit
def _codes_minus_zero(p, zb, MAGIC: tl.constexpr, CDT: tl.constexpr, PRMT: tl.constexpr):
    """The low and high nibbles q of uint8 codes p [BLOCK_N, HALF] less their row's zero point, q - z, as 16-bit
    floats (exact: small integers). zb [BLOCK_N, 1] is B + z in CDT. A nibble becomes B + q by its bits, MAGIC | q
    (B = 1024 in FP16, 128 in BF16), and (B + q) - (B + z) = q - z. PRMT: four bytes at a time in 32-bit registers
    (two byte permutes, a shift for the high nibbles, two three-input logic ops and two paired subtractions for
    four codes), low and high nibbles in two separate pieces of PTX: with one output each, the compiler can
    compute both in the tensor cores' operand layout straight from the loaded bytes (with two outputs, it moved
    the high half there through shared memory). PRMT == 2: the earlier form, both halves from one piece of PTX
    (kept to be timed against)."""
    if PRMT == 2 and MAGIC == 0x4300:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1, u0, u1, v0, v1;\n"
            "prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342;\n"
            "lop3.b32 v0, t0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 v1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 $0, v0, $5; sub.rn.bf16x2 $1, v1, $6;\n"
            "shr.b32 u0, t0, 4; shr.b32 u1, t1, 4;\n"
            "lop3.b32 v0, u0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 v1, u1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 $2, v0, $5; sub.rn.bf16x2 $3, v1, $6; }",
            "=r,=r,=r,=r,r,r,r", [p, zb], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    elif PRMT and MAGIC == 0x4300:  # BF16
        lo = tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1, v0, v1;\n"
            "prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342;\n"
            "lop3.b32 v0, t0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 v1, t1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 $0, v0, $3; sub.rn.bf16x2 $1, v1, $4; }",
            "=r,=r,r,r,r", [p, zb], dtype=tl.bfloat16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1, u0, u1, v0, v1;\n"
            "prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342;\n"
            "shr.b32 u0, t0, 4; shr.b32 u1, t1, 4;\n"
            "lop3.b32 v0, u0, 0x000F000F, 0x43004300, 0xEA; lop3.b32 v1, u1, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 $0, v0, $3; sub.rn.bf16x2 $1, v1, $4; }",
            "=r,=r,r,r,r", [p, zb], dtype=tl.bfloat16, is_pure=True, pack=4)
    elif PRMT:  # FP16
        lo = tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1, v0, v1;\n"
            "prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342;\n"
            "lop3.b32 v0, t0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 v1, t1, 0x000F000F, 0x64006400, 0xEA;\n"
            "sub.rn.f16x2 $0, v0, $3; sub.rn.f16x2 $1, v1, $4; }",
            "=r,=r,r,r,r", [p, zb], dtype=tl.float16, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1, u0, u1, v0, v1;\n"
            "prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342;\n"
            "shr.b32 u0, t0, 4; shr.b32 u1, t1, 4;\n"
            "lop3.b32 v0, u0, 0x000F000F, 0x64006400, 0xEA; lop3.b32 v1, u1, 0x000F000F, 0x64006400, 0xEA;\n"
            "sub.rn.f16x2 $0, v0, $3; sub.rn.f16x2 $1, v1, $4; }",
            "=r,=r,r,r,r", [p, zb], dtype=tl.float16, is_pure=True, pack=4)
    elif MAGIC != 0:
        lo = ((p & 15).to(tl.uint16) | MAGIC).to(tl.uint16).to(CDT, bitcast=True) - zb
        hi = ((p >> 4).to(tl.uint16) | MAGIC).to(tl.uint16).to(CDT, bitcast=True) - zb
    else:
        lo = (p & 15).to(CDT) - zb
        hi = (p >> 4).to(CDT) - zb
    return lo, hi


@triton.jit(do_not_specialize=["M"])
def _int4_gemv_kernel(x_ptr, p_ptr, s_ptr, z_ptr, xs_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                      splits, stride_xm, stride_pn, stride_sn, stride_ym, CDT: tl.constexpr, PREC: tl.constexpr,
                      HAS_XS: tl.constexpr, MAGIC: tl.constexpr, PRMT: tl.constexpr, PDL: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GPS: tl.constexpr,
                      ACT: tl.constexpr, ONE_ROW: tl.constexpr):
    """The same swapped-tile GEMV over 4-bit codes: each K step is one group of GROUP input channels (packed
    GROUP / 2 bytes a row: low nibble = even channel). The codes less their zero point, q - z, are exact small
    integers in the dot's type (_codes_minus_zero), so the even and odd channels meet the matching columns of x
    (times its input scale) in two dots, and the group's scale multiplies only the [BLOCK_N, BLOCK_M] partial
    sums: sum_k (q_k - z) * s * x_k = s * sum_k (q_k - z) x_k. GPS groups a loop step (unrolled: their loads
    independent of each other's arithmetic, more bytes in flight a program); ACT: x is [gate | up] and the
    GEMV multiplies act(gate) * up (see _gemv_kernel)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = GROUP // 2
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rj = tl.arange(0, HALF)
    n_ok = rn < N
    row_ok = rm[None, :] < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if MAGIC == 0x6400:
        base = 1024.0
    elif MAGIC == 0x4300:
        base = 128.0
    else:
        base = 0.0
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # each group's scales are loaded a group ahead (used after the dots: their load need not hold a step up);
    # the zero points are loaded in the step, where the compiler loads them straight into the layout the
    # unpacking runs in (a value carried over from the step before would be in another)
    s_next = tl.load(s_ptr + rn * stride_sn + k_lo // GROUP, mask=n_ok & (k_lo < k_hi), other=0.0)
    for k0 in range(k_lo, k_hi, GROUP * GPS):
        for gi in tl.static_range(GPS):
            k = k0 + gi * GROUP
            live = k < k_hi  # the split's last step may hold fewer than GPS groups
            g = k // GROUP
            s = tl.where(live, s_next, 0.0)
            s_next = tl.load(s_ptr + rn * stride_sn + g + 1, mask=(k + GROUP < k_hi) & n_ok, other=0.0)
            p = tl.load(p_ptr + rn[:, None].to(tl.int64) * stride_pn + (k // 2 + rj)[None, :],
                        mask=n_ok[:, None] & live, other=0)
            zb = (tl.load(z_ptr + rn * stride_sn + g, mask=n_ok & live, other=0).to(tl.float32) + base).to(CDT)
            ke = k + 2 * rj
            e_ok = row_ok & (ke < k_hi)[:, None]
            o_ok = row_ok & ((ke + 1) < k_hi)[:, None]
            if ACT != "" and ONE_ROW:
                x_even = _gated_row(x_ptr, K, ke, ke < k_hi, rm, ACT)
                x_odd = _gated_row(x_ptr, K, ke + 1, (ke + 1) < k_hi, rm, ACT)
            else:
                x_even = tl.load(x_ptr + rm[None, :] * stride_xm + ke[:, None], mask=e_ok, other=0.0)
                x_odd = tl.load(x_ptr + rm[None, :] * stride_xm + (ke + 1)[:, None], mask=o_ok, other=0.0)
            if ACT != "" and not ONE_ROW:
                x_even = act_mul(x_even, tl.load(x_ptr + rm[None, :] * stride_xm + (K + ke)[:, None], mask=e_ok,
                                                 other=0.0), ACT).to(x_ptr.dtype.element_ty)
                x_odd = act_mul(x_odd, tl.load(x_ptr + rm[None, :] * stride_xm + (K + ke + 1)[:, None],
                                               mask=o_ok, other=0.0), ACT).to(x_ptr.dtype.element_ty)
            if HAS_XS:
                x_even = x_even.to(tl.float32) * tl.load(xs_ptr + ke, mask=ke < k_hi, other=0.0)[:, None]
                x_odd = x_odd.to(tl.float32) * tl.load(xs_ptr + ke + 1, mask=(ke + 1) < k_hi, other=0.0)[:, None]
            lo, hi = _codes_minus_zero(p, zb[:, None], MAGIC, CDT, PRMT)
            part = tl.dot(lo, x_even.to(CDT), input_precision=PREC)
            part = tl.dot(hi, x_odd.to(CDT), part, input_precision=PREC)
            acc += s[:, None] * part
    _store_or_reduce(acc, y_ptr, part_ptr, count_ptr, pid_n, pid_k, rn, rm, M, N, stride_ym, splits)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    row: bool = False  # the single-row kernel without the tensor cores (M = 1 only)
    prmt: int = 0  # INT4: nibbles to floats four bytes at a time (inline PTX; CUDA only); 2: one PTX for both halves
    block_m: int = 16  # the dot's activation columns for up to this many rows (8: mma's narrowest, half of x's work)

    @property
    def name(self) -> str:
        kind = "gemv1" if self.row else "gemv"
        prmt = {0: "", 1: "_prmt", 2: "_prmtj"}[int(self.prmt)]
        bm = f"_m{self.block_m}" if self.block_m != 16 else ""
        return (f"{kind}_{self.block_n}x{self.block_k}_split{self.split_k}_w{self.num_warps}_s{self.num_stages}"
                f"{prmt}{bm}")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def split_for(n: int, k: int, block_n: int, block_k: int, num_sms: int, waves: float = 2.0) -> int:
    """K splits that give about `waves` programs per SM, each split at least 4 K tiles long."""
    tiles = -(-n // block_n)
    want = max(1, round(waves * num_sms / tiles))
    return max(1, min(want, k // (4 * block_k)))


def compute_dtype(x_dtype: torch.dtype, codes_dtype: torch.dtype) -> torch.dtype:
    """The type the tensor cores multiply in (see the module's docstring)."""
    if x_dtype == torch.float32:
        return torch.float32
    if codes_dtype in (torch.bfloat16, torch.float16):
        return codes_dtype
    return torch.float16


def heuristic_config(n: int, k: int, num_sms: int = 132, codes_dtype: torch.dtype = FP8) -> GemvConfig:
    """The tile where none was timed (no CUDA, or inside a graph capture): the sweep's most frequent winner
    (docs/design/decode-gemv.md)."""
    if codes_dtype.itemsize == 1:
        return GemvConfig(64, 256, split_for(n, k, 64, 256, num_sms), 4, 4, block_m=8)
    return GemvConfig(64, 128, split_for(n, k, 64, 128, num_sms), 4, 4)


# The tiles choose_config times: the fastest few of each kind in bench/decode_gemv.py's sweep on Llama-3-8B's
# projections at M = 1 (docs/design/decode-gemv.md); `full` adds the rest of the sweep.
# (block_n, block_k for 8-bit codes (16-bit: half), num_warps, num_stages, block_m)
DOT_TILES_8BIT = ((64, 256, 4, 4, 8), (32, 256, 4, 4, 16), (128, 256, 8, 3, 8))
DOT_TILES_16BIT = ((64, 256, 4, 4, 16), (128, 256, 8, 3, 16), (64, 256, 4, 4, 8))
DOT_TILES_MORE = ((64, 256, 4, 4, 16), (128, 256, 8, 3, 16), (64, 512, 8, 3, 16), (32, 256, 4, 4, 8),
                  (128, 256, 8, 3, 8), (64, 256, 4, 4, 8), (32, 256, 4, 4, 16))
ROW_TILES = ((16, 512, 8), (16, 256, 4), (32, 256, 8), (8, 512, 4))  # (block_n, block_k for 8-bit, warps)
ROW_TILES_MORE = ((16, 512, 4),)
# (block_n, block_k (groups a step times 128), warps, stages, prmt): PTX unpacking (1: a piece of PTX for each
# nibble; 2: one for both, timed beside it), 8 activation columns. The sweep's fastest at M = 1.
INT4_TILES = ((256, 128, 8, 3, 1), (128, 256, 8, 3, 1), (64, 128, 4, 4, 1), (256, 128, 8, 3, 2), (128, 256, 8, 3, 2))
# `full` adds the rest of the sweep
INT4_TILES_MORE = ((128, 128, 8, 3, 1), (128, 128, 4, 4, 1), (256, 256, 8, 3, 1), (64, 256, 4, 4, 1),
                   (128, 512, 8, 2, 1), (64, 512, 4, 3, 1), (128, 128, 8, 3, 0), (256, 128, 8, 3, 0),
                   (128, 128, 8, 3, 2), (64, 128, 4, 4, 2))


def candidate_configs(n: int, k: int, num_sms: int, codes_dtype: torch.dtype = FP8,
                      full: bool = False) -> list[GemvConfig]:
    """The tensor-core tiles choose_config times, each with the splits for one and for two programs an SM."""
    wide = codes_dtype.itemsize == 1
    tiles = DOT_TILES_8BIT if wide else DOT_TILES_16BIT
    if full:
        tiles = tiles + tuple(t for t in DOT_TILES_MORE if t not in tiles)
    out = []
    for bn, bk, warps, stages, bm in tiles:
        bk = bk if wide else bk // 2
        for waves in (1.0, 2.0):
            c = GemvConfig(bn, bk, split_for(n, k, bn, bk, num_sms, waves), warps, stages, block_m=bm)
            if c not in out:
                out.append(c)
    return out


def row_candidate_configs(n: int, k: int, num_sms: int, codes_dtype: torch.dtype = FP8,
                          full: bool = False) -> list[GemvConfig]:
    """The single-row kernel's tiles (M = 1): a few rows a program, 256 or 512 bytes of each row a K step,
    splits for two or four programs an SM (they are small)."""
    wide = codes_dtype.itemsize == 1
    out = []
    for bn, bk, warps in ROW_TILES + (ROW_TILES_MORE if full else ()):
        bk = bk if wide else bk // 2
        for waves in (2.0, 4.0):
            c = GemvConfig(bn, bk, split_for(n, k, bn, bk, num_sms, waves), warps, 1, row=True)
            if c not in out:
                out.append(c)
    return out


def check(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None, act: str = "") -> None:
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a 2-D float16, bfloat16 or float32 tensor, got {x.dtype} {list(x.shape)}")
    k = x.shape[1] // 2 if act else x.shape[1]  # with act, x is [gate | up]
    if codes.dtype not in CODES or codes.dim() != 2 or codes.shape[1] != k or (act and x.shape[1] != 2 * k):
        raise ValueError(f"codes must be float8_e4m3fn, int8, bfloat16 or float16 [N, K={k}], got "
                         f"{codes.dtype} {list(codes.shape)}" + (f" (x [gate | up] {list(x.shape)})" if act else ""))
    if scale is not None and scale.numel() != codes.shape[0]:
        raise ValueError(f"scale must have N = {codes.shape[0]} elements, got {scale.numel()}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"fp8_gemv takes at most {MAX_M} rows, got {x.shape[0]}")


_COUNTERS: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of a device (zeros between launches: the last split resets its own)."""
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return c


def fp8_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None, config: GemvConfig | None = None,
             out: torch.Tensor | None = None, pdl: bool = True, act: str = "") -> torch.Tensor:
    """x [M <= 64, K] @ (codes [N, K] FP8 or INT8 * scale [N]).T -> [M, N] in x's dtype (into `out` when given).
    16-bit codes take scale None (a plain GEMV). act ("silu", "gelu_tanh"): x is [M, 2K], gate then up, and the
    product is of act(gate) * up, rounded to x's dtype as it is loaded (kernels/gated_act.py)."""
    check(x, codes, scale, act)
    M, K = x.shape[0], codes.shape[1]
    N = codes.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    if scale is not None:
        scale = scale.reshape(-1)
        if scale.dtype != torch.float32 or not scale.is_contiguous():
            scale = scale.float().contiguous()
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if y.shape != (M, N) or y.stride(1) != 1:
        raise ValueError(f"out must be [{M}, {N}] with unit column stride, got {list(y.shape)} {y.stride()}")
    if M == 0 or N == 0:
        return y
    cfg = config or choose_config(N, K, x.dtype, x.device, codes.dtype, single_row=M == 1)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(K, k_per_split)
    tiles = triton.cdiv(N, cfg.block_n)
    if splits > 1 and tiles > MAX_TILES:
        splits, k_per_split = 1, K
    even = N % cfg.block_n == 0 and K % k_per_split == 0 and k_per_split % cfg.block_k == 0
    cdt = compute_dtype(x.dtype, codes.dtype)
    x_scale = X_SCALE_BF16 if x.dtype == torch.bfloat16 and cdt == torch.float16 else 1.0
    hopper = _is_hopper(x.device)
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else y
    counts = _counters(x.device) if splits > 1 else y
    common = dict(HAS_SCALE=scale is not None, EVEN=even, PDL=hopper and pdl, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  ACT=act, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device, pdl))
    s_arg = scale if scale is not None else y
    if cfg.row:
        if M != 1:
            raise ValueError(f"the single-row GEMV tile {cfg.name} takes one row, got {M}")
        _gemv_row_kernel[(tiles, splits)](x, codes, s_arg, y, part, counts, N, K, k_per_split, splits,
                                          codes.stride(0), **common)
        return y
    _gemv_kernel[(tiles, splits)](
        x, codes, s_arg, y, part, counts, M, N, K, k_per_split, splits, x.stride(0), codes.stride(0), y.stride(0),
        X_SCALE=x_scale, CDT=_TL[cdt], PREC="ieee" if cdt == torch.float32 else "tf32", ONE_ROW=bool(act) and M == 1,
        BLOCK_M=max(cfg.block_m, triton.next_power_of_2(M)), **common)
    return y


def int4_heuristic_config(n: int, k: int, num_sms: int = 132) -> GemvConfig:
    return GemvConfig(256, 128, split_for(n, k, 256, 128, num_sms), 8, 3, prmt=1, block_m=8)


def int4_candidate_configs(n: int, k: int, num_sms: int, full: bool = False) -> list[GemvConfig]:
    """int4_gemv's tiles choose_int4_config times (block_k: the groups of 128 one loop step takes, times 128)."""
    tiles = list(INT4_TILES) + (list(INT4_TILES_MORE) if full else [])
    out = []
    for bn, bk, warps, stages, prmt in tiles:
        for waves in (1.0, 2.0):
            c = GemvConfig(bn, bk, split_for(n, k, bn, bk, num_sms, waves), warps, stages, prmt=prmt, block_m=8)
            if c not in out:
                out.append(c)
    return out


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              input_scale: torch.Tensor | None = None, group: int = 128, config: GemvConfig | None = None,
              pdl: bool = True, act: str = "") -> torch.Tensor:
    """(x [M <= 64, K] * input_scale) @ W.T for kiln.llm.quantize's INT4 layout: packed uint8 [N, G * group / 2]
    (low nibble = even input channel), scale FP32 [N, G], zero uint8 [N, G], W = (code - zero) * scale per group
    of `group` input channels. Returns [M, N] in x's dtype. act ("silu", "gelu_tanh"): x is [M, 2K], gate then
    up, and the product is of act(gate) * up (kernels/gated_act.py)."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.shape[0] > MAX_M:
        raise ValueError(f"x must be a 2-D float16, bfloat16 or float32 tensor of at most {MAX_M} rows, got "
                         f"{x.dtype} {list(x.shape)}")
    M, K = x.shape
    if act:
        K //= 2
    N, G = scale.shape
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (N, G * group // 2) or G != -(-K // group):
        raise ValueError(f"packed must be uint8 [N, G * {group} / 2] with G = ceil(K / {group}) = "
                         f"{-(-K // group)}, got {packed.dtype} {list(packed.shape)} and scales {list(scale.shape)}")
    if tuple(zero.shape) != (N, G):
        raise ValueError(f"zero must be [{N}, {G}], got {list(zero.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    packed, scale, zero = packed.contiguous(), scale.float().contiguous(), zero.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = config or choose_int4_config(N, K, group, x.dtype, x.device, input_scale is not None)
    gps = max(1, cfg.block_k // group)  # groups a loop step
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), group * gps) * group * gps
    splits = triton.cdiv(K, k_per_split)
    tiles = triton.cdiv(N, cfg.block_n)
    if splits > 1 and tiles > MAX_TILES:
        splits, k_per_split = 1, triton.cdiv(K, group) * group
    cdt = _TL[x.dtype]
    magic = {torch.float16: 0x6400, torch.bfloat16: 0x4300}.get(x.dtype, 0)
    hopper = _is_hopper(x.device)
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else y
    counts = _counters(x.device) if splits > 1 else y
    xs = input_scale.float().contiguous() if input_scale is not None else scale
    _int4_gemv_kernel[(tiles, splits)](
        x, packed, scale, zero, xs, y, part, counts, M, N, K, k_per_split, splits, x.stride(0), packed.stride(0),
        scale.stride(0), y.stride(0), CDT=cdt, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        HAS_XS=input_scale is not None, MAGIC=magic, PRMT=int(cfg.prmt) if magic != 0 and x.is_cuda else 0,
        PDL=hopper and pdl,
        BLOCK_M=max(cfg.block_m, triton.next_power_of_2(M)), BLOCK_N=cfg.block_n, GROUP=group, GPS=gps, ACT=act,
        ONE_ROW=bool(act) and M == 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device, pdl))
    return y


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The same product in torch, FP32, returned in x's dtype."""
    check(x, codes, scale)
    w = codes.float() if scale is None else codes.float() * scale.float().reshape(-1, 1)
    return (x.float() @ w.t()).to(x.dtype)


# --- picking a tile on the device ------------------------------------------------------------------------------

_CHOSEN: dict = {}
_TIMED: dict = {}  # (n, k, x dtype, codes dtype or "int4", device) -> {config: us at M = 1}


def tile_timings(n: int, k: int, dtype: torch.dtype, device, codes) -> dict:
    """What choose_config (codes: a torch dtype) or choose_int4_config (codes "int4") measured for this shape:
    {config: microseconds a call at M = 1; inf where it did not compile}."""
    return dict(_TIMED.get((n, k, dtype, codes, str(torch.device(device))), {}))
TIMING_BYTES = 128 << 20  # weights cycled through when timing a tile: more than L2 holds, as a step's layers are


def time_us(fn, weights: list, calls: int = 12) -> float:
    """GPU microseconds a call of fn(w), cycling through `weights` (together larger than L2, as a step's layers
    are) at least `calls` times, replayed in a CUDA graph (a step's launches are; eager launches would time the
    host). A single large weight called a few times only times its first call's ramp too coarsely."""
    reps = -(-calls // len(weights))
    for w in weights:
        fn(w)  # compiles, and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for w in weights:
                fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (3 * reps * len(weights))


def timing_weights(n: int, k: int, dtype: torch.dtype, device, weight: torch.Tensor | None = None) -> list:
    """Weights for timing an [n, k] product: `weight` itself where it alone is larger than L2's reach, else
    zero copies of TIMING_BYTES together."""
    nbytes = n * k * dtype.itemsize
    if weight is not None and nbytes >= TIMING_BYTES:
        return [weight]
    return [torch.zeros((n, k), dtype=dtype, device=device) for _ in range(max(2, -(-TIMING_BYTES // nbytes)))]


def _compile_ahead(candidates, call) -> None:
    """call(c) once for every candidate in threads: each first call compiles, and Triton's compiler runs mostly
    outside the GIL, so the candidates compile side by side. The launches all go to this thread's stream (one
    after another on the device: the split-K counters are never shared by two kernels at once)."""
    stream = torch.cuda.current_stream()

    def one(c):
        try:
            with torch.cuda.stream(stream):
                call(c)
        except Exception:  # noqa: BLE001, S110 - the timing loop meets the same error and records it
            pass

    threads = int(os.environ.get("KILN_GEMV_COMPILE_THREADS", "16"))  # 1: one after another
    with ThreadPoolExecutor(max(1, min(len(candidates), os.cpu_count() or 1, threads))) as pool:
        list(pool.map(one, candidates))
    torch.cuda.synchronize()


def _fastest(candidates, timed: dict, run, fallback, call=None):
    """The fastest of `candidates`, timing by run(c) those not yet in `timed` (config -> us, which keeps them);
    call(c), where given, compiles them all first (_compile_ahead)."""
    if call is not None:
        _compile_ahead([c for c in candidates if c not in timed], call)
    for c in candidates:
        if c not in timed:
            try:
                timed[c] = run(c)
            except Exception:  # noqa: BLE001 - a tile this Triton cannot compile for the device: not a candidate
                timed[c] = float("inf")
    best = min(candidates, key=timed.get, default=None)
    return best if best is not None and timed[best] < float("inf") else fallback


def choose_config(n: int, k: int, dtype: torch.dtype, device: torch.device, codes_dtype: torch.dtype = FP8,
                  weight: torch.Tensor | None = None, single_row: bool = False) -> GemvConfig:
    """The tile for an [n, k] weight of codes_dtype times x of dtype: timed on the device once per shape (CUDA,
    not capturing a graph), else the heuristic. Every M > 1 takes the same tile, so a row's result does not
    depend on its batch; single_row (M = 1) may instead take the single-row kernel where it was faster."""
    device = torch.device(device)
    key = (n, k, dtype, codes_dtype, str(device), single_row)
    cfg = _CHOSEN.get(key)
    if cfg is not None:
        return cfg
    sms = _num_sms(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return heuristic_config(n, k, sms, codes_dtype)
    weights = timing_weights(n, k, codes_dtype, device, weight)
    scale = None if codes_dtype.itemsize == 2 else torch.ones(n, dtype=torch.float32, device=device)
    x = torch.zeros((1, k), dtype=dtype, device=device)
    _counters(device)
    timed = _TIMED.setdefault(key[:5], {})
    cands = candidate_configs(n, k, sms, codes_dtype)
    if single_row:
        cands = cands + row_candidate_configs(n, k, sms, codes_dtype)
    cfg = _fastest(cands, timed, lambda c: time_us(lambda w: fp8_gemv(x, w, scale, c), weights),
                   heuristic_config(n, k, sms, codes_dtype), lambda c: fp8_gemv(x, weights[0], scale, c))
    _CHOSEN[key] = cfg
    return cfg


def choose_int4_config(n: int, k: int, group: int, dtype: torch.dtype, device: torch.device,
                       input_scale: bool = False, full: bool = False) -> GemvConfig:
    """choose_config's rule for int4_gemv's tile (groups of `group`; a K step is one group or a few), timed
    with an input scale where the weight has one (AWQ's). full: time int4_candidate_configs' longer list."""
    device = torch.device(device)
    key = ("int4", n, k, group, dtype, str(device), input_scale)
    cfg = _CHOSEN.get(key)
    if cfg is not None:
        return cfg
    sms = _num_sms(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing() or group != 128:
        return int4_heuristic_config(n, k, sms)
    g = -(-k // group)
    copies = max(2, -(-TIMING_BYTES // (n * g * group // 2)))
    packed = [torch.zeros((n, g * group // 2), dtype=torch.uint8, device=device) for _ in range(copies)]
    scale = torch.ones((n, g), dtype=torch.float32, device=device)
    zero = torch.zeros((n, g), dtype=torch.uint8, device=device)
    x = torch.zeros((1, k), dtype=dtype, device=device)
    xs = torch.ones(k, dtype=torch.float32, device=device) if input_scale else None
    _counters(device)
    cfg = _fastest(int4_candidate_configs(n, k, sms, full), _TIMED.setdefault((n, k, dtype, "int4", str(device)), {}),
                   lambda c: time_us(lambda p: int4_gemv(x, p, scale, zero, xs, group, c), packed),
                   int4_heuristic_config(n, k, sms), lambda c: int4_gemv(x, packed[0], scale, zero, xs, group, c))
    _CHOSEN[key] = cfg
    return cfg
