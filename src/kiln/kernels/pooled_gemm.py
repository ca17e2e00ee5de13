"""Pooled GEMV: y[m] = act(mean over pixels of x[m] @ w + b), a CNN's head at small batch in one kernel.

At batch 1 ResNet-50's head is a 7x7 average pool over 2048 channels and a 2048 -> 1000 classifier:
about a microsecond of HBM traffic (4 MB of weights), but a pool kernel and a cuBLAS GEMM on 64x8
tiles, several times that. Here one program per (image, BLOCK_N outputs, BLOCK_K channels) sums
its channels over the pixels (an L2-resident [pixels, BLOCK_K] tile of x) and multiplies the sums into
its [BLOCK_K, BLOCK_N] weight tile: one pass, no loop over K, so hundreds of programs each wait for
one round of loads (a loop over K was slower; see docs/design/small-kernels.md). The
partial products meet in an FP32 sum by atomics; the last program of an output tile to arrive
divides by the pixel count and applies bias and activation (workspace.py). No Tensor Cores: with
one row per image a GEMV is bound by the weight read.

x [N, C, H, W] through its strides (channels-last is what the convolutions write), w [C, N_out].
Reference: kiln.ops.fused.pooled_gemm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemm import ACTIVATIONS, _params, epilogue
from .workspace import add_part, zeroed_workspace

_BLOCK_P = 64  # pixels per load; the loop covers any H*W


@triton.jit
def _pooled_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, sum_ptr, count_ptr, C, HW, W, NOUT, sxn, sxc, sxh, sxw,
                        swk, swn, syn, syo, inv_hw, p0, p1, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < NOUT
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = rk < C
    rp = tl.arange(0, BLOCK_P)
    sums = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for first in range(0, HW, BLOCK_P):
        pix = first + rp
        off = (pix // W) * sxh + (pix % W) * sxw
        xs = tl.load(x_ptr + m * sxn + off[:, None] + rk[None, :] * sxc, mask=(pix < HW)[:, None] & k_ok[None, :],
                     other=0.0)
        sums += tl.sum(xs.to(tl.float32), 0)
    wt = tl.load(w_ptr + rk[:, None] * swk + rn[None, :] * swn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    part = tl.sum(sums[:, None] * wt.to(tl.float32), 0)

    tile = m * tl.num_programs(0) + pid_n
    acc, last = add_part(part, sum_ptr + tile * BLOCK_N + tl.arange(0, BLOCK_N), n_ok, count_ptr + tile,
                         tl.num_programs(1))
    if last:  # the last channel block in
        acc *= inv_hw
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        acc = epilogue(acc, ACT, p0, p1)
        tl.store(y_ptr + m * syn + rn * syo, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4

    @property
    def name(self) -> str:
        return f"n{self.block_n}_k{self.block_k}_w{self.num_warps}"


# ResNet-50's head at batch 1 (C = 2048, 1000 outputs): 128-512 programs.
CONFIGS = (GemvConfig(64, 128), GemvConfig(32, 128), GemvConfig(64, 256, num_warps=8))
MAX_BATCH = 8  # beyond this, programs re-reading their weight tile per image lose to a GEMM


def supports(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str = "") -> bool:
    return (act in ACTIVATIONS and x.dim() == 4 and w.dim() == 2 and x.shape[1] == w.shape[0]
            and 0 < x.shape[0] <= MAX_BATCH and x.shape[2] * x.shape[3] > 0
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and w.dtype == x.dtype
            and (b is None or (tuple(b.shape) == (w.shape[1],) and b.dtype == x.dtype)))


def pooled_gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, act: str = "", params=(),
                config: GemvConfig = CONFIGS[0], out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """act(x.mean((2, 3)) @ w + b) as [N, N_out] in out_dtype (default x's; the sums are FP32 either way);
    act one of gemm.ACTIVATIONS."""
    p0, p1 = _params(act, params)
    n, c, h, wd = x.shape
    nout = w.shape[1]
    grid = (triton.cdiv(nout, config.block_n), triton.cdiv(c, config.block_k), n)
    total, counters = zeroed_workspace(x.device, n * grid[0] * config.block_n, n * grid[0])
    y = torch.empty((n, nout), dtype=out_dtype or x.dtype, device=x.device)
    _pooled_gemv_kernel[grid](
        x, w, b if b is not None else y, y, total, counters, c, h * wd, wd, nout, *x.stride(), *w.stride(),
        *y.stride(), 1.0 / (h * wd), p0, p1, HAS_BIAS=b is not None, ACT=act,
        BLOCK_P=_BLOCK_P, BLOCK_K=config.block_k, BLOCK_N=config.block_n, num_warps=config.num_warps,
    )
    return y


def reference(x, w, b=None, act: str = "", params=()):
    from ..ops.fused import activation

    y = x.float().mean(dim=(2, 3)) @ w.float()
    return activation(act, y if b is None else y + b.float(), list(params)).to(x.dtype)
