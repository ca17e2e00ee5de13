"""Softmax over the last axis, one program per row: one read, one write, statistics in FP32.

The reference (kiln.ops.activation) runs ONNX's Exp(x - max) / ReduceSum as four FP16 kernels
to round each step like the spec; this rounds once at the end, within an ulp of it.
Rows fully at -inf give NaN, as the reference does.

Reference: torch.softmax(x.float(), -1).to(x.dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * n_cols + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor) -> bool:
    """Contiguous float rows that fit one block."""
    return (x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.dim() >= 1 and x.is_contiguous()
            and 0 < x.shape[-1] <= 16384 and x.numel() > 0)


def softmax(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    y = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _softmax_kernel[(x.numel() // n,)](x, y, n, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return y


def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), -1).to(x.dtype)
