"""Per-row dynamic FP8 quantization of activations, in one kernel: each row's absolute maximum, its scale
amax / 448 (at least 1e-12) and its E4M3 codes x / scale (saturated to +-448, rounded to nearest even).

It feeds torch._scaled_mm's row-wise scales for the FP8 weight GEMM of steps with many rows: where torch needs
an abs, a max, a divide, a clamp and casts (nine launches for a few microseconds of data each, a few
times per layer), this is one launch. The quotients are rounded to nearest (div_rn), as torch's are.
`reference` is the same in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    top = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(top, axis=0), 448.0), 1e-12)
    tl.store(s_ptr + row, scale)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        v = tl.math.div_rn(v, tl.broadcast_to(scale, v.shape))
        tl.store(q_row + offs, tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv), mask=offs < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, 1] FP32) with x ~ codes * scales."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a 2-D float16, bfloat16 or float32 tensor, got {x.dtype} {list(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    codes = torch.empty((m, k), dtype=FP8, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(4096, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, codes, scales, k, x.stride(0), codes.stride(0), BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    return codes, scales


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # A tensor divisor: torch divides by a Python number as a product with its reciprocal on the GPU, a last
    # bit away from the kernel's correctly rounded division
    scales = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(1e-12)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales
