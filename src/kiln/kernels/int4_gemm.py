"""Dequantizing GEMM for INT4 weight-only layers: y = (x * in_scale) @ dequant(Wq) + b, FP32 accumulate.

Weights are laid out [K, N] (x @ W) as kiln/ops/int4.py's docstring defines them: packed nibble pairs of
even and odd k, per-group scales and optional zeros, an optional per-input-channel in_scale.

The kernel never materializes the FP weight: each K step loads BLOCK_KP packed rows, splits the
nibbles into the even-k and odd-k halves of the tile and multiplies them with the even and odd
columns of x (two tl.dot's), so no interleave is needed. group_size must be even (a byte never
straddles two groups). Reference: ops/int4.py's `reference` (unpack, dequantize, torch.matmul in FP32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..ops.int4 import check_operands, dequantize, reference, unpack  # noqa: F401  (the format, and the reference)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _int4_gemm_kernel(x_ptr, p_ptr, s_ptr, z_ptr, xs_ptr, b_ptr, y_ptr, M, N, K, KP,
                      stride_xm, stride_xk, stride_pk, stride_pn, stride_sg, stride_sn,
                      stride_zg, stride_zn, stride_ym, stride_yn,
                      GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_XS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ram = rm % M  # edge rows/columns load a valid (wrapped) row; the store masks them
    rbn = rn % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(tl.cdiv(KP, BLOCK_KP)):
        kp = kb * BLOCK_KP + tl.arange(0, BLOCK_KP)  # packed rows
        ke = 2 * kp  # k of the low nibbles
        ko = ke + 1  # k of the high nibbles
        xe = tl.load(x_ptr + ram[:, None] * stride_xm + ke[None, :] * stride_xk, mask=ke[None, :] < K, other=0.0)
        xo = tl.load(x_ptr + ram[:, None] * stride_xm + ko[None, :] * stride_xk, mask=ko[None, :] < K, other=0.0)
        if HAS_XS:
            xe = (xe.to(tl.float32) * tl.load(xs_ptr + ke, mask=ke < K, other=0.0).to(tl.float32)[None, :])
            xo = (xo.to(tl.float32) * tl.load(xs_ptr + ko, mask=ko < K, other=0.0).to(tl.float32)[None, :])
        row_ok = kp[:, None] < KP
        p = tl.load(p_ptr + kp[:, None] * stride_pk + rbn[None, :] * stride_pn, mask=row_ok, other=0).to(tl.int32)
        g = ke // GROUP  # the same group for both nibbles (GROUP is even)
        s = tl.load(s_ptr + g[:, None] * stride_sg + rbn[None, :] * stride_sn, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_ZP:
            z = tl.load(z_ptr + g[:, None] * stride_zg + rbn[None, :] * stride_zn, mask=row_ok, other=0).to(tl.float32)
        else:
            z = 8.0
        we = ((p & 15).to(tl.float32) - z) * s
        wo = (((p >> 4) & 15).to(tl.float32) - z) * s
        xt = y_ptr.dtype.element_ty if PREC == "tf32" else tl.float32
        acc = tl.dot(xe.to(xt), we.to(xt), acc, input_precision=PREC)
        acc = tl.dot(xo.to(xt), wo.to(xt), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rbn).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class Int4GemmConfig:
    block_m: int
    block_n: int
    block_kp: int  # packed rows per K step (2 * block_kp values of k)
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return f"int4_{self.block_m}x{self.block_n}x{2 * self.block_kp}_w{self.num_warps}_s{self.num_stages}"


CONFIGS = [Int4GemmConfig(16, 64, 64), Int4GemmConfig(64, 64, 32), Int4GemmConfig(128, 128, 32, 8)]


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group_size: int, bias: torch.Tensor | None = None, in_scale: torch.Tensor | None = None,
              config: Int4GemmConfig = CONFIGS[0], out: torch.Tensor | None = None) -> torch.Tensor:
    """(x * in_scale) @ dequant(packed) + bias for x [.., K]; returns [.., N] in x's dtype (into `out` if given)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, not {x.dtype}")
    K, N = check_operands(x, packed, scales, zeros, group_size, in_scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    y2 = y.view(M, N)
    if M == 0 or N == 0:
        return y2.view(*lead, N)
    b = bias.reshape(-1).contiguous() if bias is not None else None
    xs = in_scale.reshape(-1).contiguous() if in_scale is not None else None
    z = zeros if zeros is not None else scales
    grid = (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n))
    _int4_gemm_kernel[grid](
        x2, packed, scales, z, xs if xs is not None else x2, b if b is not None else x2, y2, M, N, K, packed.shape[0],
        x2.stride(0), x2.stride(1), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
        z.stride(0), z.stride(1), y2.stride(0), y2.stride(1),
        GROUP=group_size, HAS_ZP=zeros is not None, HAS_XS=xs is not None, HAS_BIAS=b is not None,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_KP=config.block_kp,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y2.view(*lead, N)
