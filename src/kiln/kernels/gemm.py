"""Tiled GEMM with a fused epilogue: y = act(x @ w + b), one kernel, output written once.

x [M, K] (callers flatten leading batch dims), w [K, N] (kiln::FusedGemm stores weights
[K, N]), optional bias [N]. Any strides; FP32 accumulation on Tensor Cores (tl.dot).
FP16/BF16 inputs; FP32 inputs use TF32 only when asked (`precision="tf32"`), else exact
FP32 products (input_precision="ieee"). Program ids are swizzled in groups of GROUP_M
rows of tiles so neighbouring programs share tiles of w in L2.

Reference: kiln.ops.fused.fused_gemm (torch.matmul + bias + activation); `reference` below.
The epilogue activations (`epilogue`) are shared with the convolution kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Activations the epilogue computes; names as kiln.ops.fused.activation spells them.
ACTIVATIONS = ("", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Silu", "HardSwish", "GeluErf", "GeluTanh", "Tanh")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT32_MAX = 2**31 - 1


@triton.jit
def epilogue(y, ACT: tl.constexpr, p0, p1):
    """act(y) in FP32; p0/p1 are the activation's parameters (LeakyRelu alpha, Clip bounds)."""
    if ACT == "Relu":
        y = tl.where(y > 0.0, y, 0.0)
    elif ACT == "LeakyRelu":
        y = tl.where(y >= 0.0, y, y * p0)
    elif ACT == "Clip":
        y = tl.minimum(tl.maximum(y, p0), p1)
    elif ACT == "Sigmoid":
        y = tl.sigmoid(y)
    elif ACT == "Silu":
        y = y * tl.sigmoid(y)
    elif ACT == "HardSwish":
        y = y * tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0) * (1.0 / 6.0)
    elif ACT == "GeluErf":
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACT == "GeluTanh":  # tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = y * tl.sigmoid(2.0 * u)  # 0.5 * y * (1 + tanh(u))
    elif ACT == "Tanh":
        y = 2.0 * tl.sigmoid(2.0 * y) - 1.0
    return y


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wk, stride_wn, stride_ym, stride_yn, p0, p1,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M swizzle: walk GROUP_M tile-rows down a column of tiles before moving right.
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge load a valid (wrapped) row instead of masking; the store masks them.
    ram = rm % M
    rbn = rn % N
    x_ptrs = x_ptr + ram[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rk[:, None] * stride_wk + rbn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        acc += tl.load(b_ptr + rbn).to(tl.float32)[None, :]
    acc = epilogue(acc, ACT, p0, p1)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class TileConfig:
    """A tiled kernel's configuration (the implicit-GEMM convolution uses it too: M = output
    pixels, N = output channels, K = the reduction slice)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}"

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory the software pipeline holds: num_stages tiles of x and of w."""
        return self.num_stages * (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize


# (config, lowest optimization level that tries it). Level 3 covers big square GEMMs (batch 32),
# medium ones and skinny-M ones (batch 1); levels 4-5 widen the search.
CONFIGS: list[tuple[TileConfig, int]] = [
    (TileConfig(128, 128, 64, 4, 3), 3),
    (TileConfig(128, 256, 64, 8, 3), 3),
    (TileConfig(64, 128, 64, 4, 3), 3),
    (TileConfig(32, 64, 128, 4, 4), 3),
    (TileConfig(128, 128, 32, 4, 4), 4),
    (TileConfig(128, 64, 32, 4, 4), 4),
    (TileConfig(64, 256, 32, 4, 4), 4),
    (TileConfig(16, 64, 128, 4, 4), 4),
    (TileConfig(128, 128, 64, 8, 5), 5),
    (TileConfig(256, 128, 64, 8, 3), 5),
    (TileConfig(64, 64, 64, 4, 3), 5),
    (TileConfig(64, 32, 32, 2, 5), 5),
]


def dot_precision(dtype: torch.dtype, precision: str) -> str:
    """tl.dot's input_precision: exact FP32 products ("ieee") for FP32 operands unless the layer allows TF32.

    16-bit operands get Triton's default ("tf32"), which only concerns FP32 operands.
    """
    return "ieee" if dtype == torch.float32 and precision != "tf32" else "tf32"


def supports(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str) -> bool:
    """What the kernel handles: x [M, K] (or batched [.., K]), w [K, N], bias of N elements."""
    return (x.dim() >= 2 and w.dim() == 2 and x.shape[-1] == w.shape[0] and x.dtype == w.dtype
            and x.dtype in DTYPES and act in ACTIVATIONS and x.device == w.device
            and x.numel() > 0 and w.numel() > 0
            and (b is None or (b.numel() == w.shape[1] and b.dtype.is_floating_point and b.device == x.device))
            and max(x.numel(), w.numel(), x.numel() // x.shape[-1] * w.shape[1]) <= _INT32_MAX)


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, act: str = "", params=(),
         config: TileConfig = CONFIGS[0][0], precision: str = "float32", out: torch.Tensor | None = None):
    """act(x @ w + b) for x [.., K], w [K, N]; returns [.., N] in x's dtype (written into `out` if given)."""
    lead = x.shape[:-1]
    K, N = w.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    y2 = y.view(M, N)
    p0, p1 = _params(act, params)
    bias = b.reshape(-1) if b is not None else None
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
    _gemm_kernel[grid](
        x2, w, bias if bias is not None else x2, y2, M, N, K,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y2.stride(0), y2.stride(1), p0, p1,
        HAS_BIAS=bias is not None, ACT=act, PREC=dot_precision(x.dtype, precision),
        EVEN_K=K % config.block_k == 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y2.view(*lead, N)


def _params(act: str, params) -> tuple[float, float]:
    params = list(params or [])
    if act == "LeakyRelu":
        return float(params[0] if params else 0.01), 0.0
    if act == "Clip":
        return float(params[0]), float(params[1])
    return 0.0, 0.0


def reference(x, w, b=None, act: str = "", params=()):
    from ..ops.fused import activation

    y = torch.matmul(x.float(), w.float())
    if b is not None:
        y = y + b.float().reshape(-1)
    return activation(act, y, list(params)).to(x.dtype)
