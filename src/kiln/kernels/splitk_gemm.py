"""Split-K GEMM partial products: p[s] = x[:, Ks] @ w[Ks, :] for S slices Ks of the K axis, FP32.

At small M (BERT at batch 1: M = 128 rows, K = 3072) a plain tiling gives a few dozen thread
blocks, each streaming all of K: too little memory parallelism for a GEMM whose cost is reading
w. Splitting K over S blocks per output tile multiplies the parallelism by S; the S partial
products are summed by whoever reads them (kernels/layernorm.py's partials input, so the sum,
bias, residual and norm are one pass) instead of a reduction kernel of their own.

x [M, K] and w [K, N], any strides, FP16/BF16 (tl.dot on Tensor Cores, FP32 accumulation).
Reference: `reference` below, the sum of the slices: x @ w in FP32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _partials_kernel(x_ptr, w_ptr, p_ptr, M, N, K, k_slice, sxm, sxk, swk, swn,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k0 = pid_s * k_slice
    for k in range(k0, k0 + k_slice, BK):
        rk = k + tl.arange(0, BK)
        in_k = (rk < K) & (rk < k0 + k_slice)
        a = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm < M)[:, None] & in_k[None, :], other=0.0)
        b = tl.load(w_ptr + rk[:, None] * swk + rn[None, :] * swn, mask=in_k[:, None] & (rn < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    out = p_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


@dataclass(frozen=True)
class SplitKConfig:
    slices: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    @property
    def name(self) -> str:
        return f"s{self.slices}_{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}"

    def smem_bytes(self, itemsize: int) -> int:
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * itemsize


# The fastest at BERT's batch-1 shapes (M = 128; K = 768 and 3072, N = 768; see docs/design/tactic-levels.md).
CONFIGS = (SplitKConfig(4, 64, 64, 64), SplitKConfig(2, 64, 64, 64), SplitKConfig(4, 64, 64, 128, num_stages=3))


def partial_products(x: torch.Tensor, w: torch.Tensor, cfg: SplitKConfig) -> torch.Tensor:
    """FP32 [slices, M, N] whose sum over axis 0 is x @ w."""
    m, k = x.shape
    n = w.shape[1]
    k_slice = triton.cdiv(triton.cdiv(k, cfg.slices), cfg.block_k) * cfg.block_k
    p = torch.empty(cfg.slices, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.slices)
    _partials_kernel[grid](x, w, p, m, n, k, k_slice, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                           BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages)
    return p


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float()
