"""Rotary position embedding in one pass: y = x * cos + rotate_half(x) * sin over the last axis.

x is read where it lies (q and k arrive as a transposed view of their projection, [batch, heads, seq, dim]
with the heads' stride inside a token's row), cos and sin broadcast over it through zero strides, and y is
written contiguous. The partner of column j is x[j + split] negated for j < dim - split, else x[j - (dim -
split)], which is rotate_half at split = dim / 2. Sums in FP32, one rounding at the store.

Reference: kiln.ops.rotary.rotary (ONNX's Mul/Slice/Neg/Concat/Add in the inputs' type).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_DIM = 1024  # head dims beyond this are not rotary heads


@triton.jit
def _rotary_kernel(x_ptr, c_ptr, s_ptr, y_ptr, rows, d1, d2, dim, split,
                   sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    j = tl.arange(0, BLOCK_D)[None, :]
    mask = (r < rows) & (j < dim)
    i0, i1, i2 = r // (d1 * d2), (r // d2) % d1, r % d2
    tail = dim - split
    partner = tl.where(j < tail, j + split, j - tail)
    sign = tl.where(j < tail, -1.0, 1.0)
    xrow = x_ptr + i0 * sx0 + i1 * sx1 + i2 * sx2
    x = tl.load(xrow + j * sx3, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(xrow + partner * sx3, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + i0 * sc0 + i1 * sc1 + i2 * sc2 + j * sc3, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2 + j * ss3, mask=mask, other=0.0).to(tl.float32)
    y = x * c + sign * xp * s
    tl.store(y_ptr + r * dim + j, y.to(y_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split: int) -> bool:
    """Float x of rank 1-4, cos and sin of its type broadcasting to its shape (not widening it)."""
    if not (x.dtype in (torch.float16, torch.bfloat16, torch.float32) and cos.dtype == sin.dtype == x.dtype
            and 1 <= x.dim() <= 4 and cos.dim() <= x.dim() and sin.dim() <= x.dim() and x.numel() > 0):
        return False
    try:
        shape = torch.broadcast_shapes(x.shape, cos.shape, sin.shape)
    except RuntimeError:
        return False
    return tuple(shape) == tuple(x.shape) and 0 < split < x.shape[-1] <= MAX_DIM


def _four_d(t: torch.Tensor, shape) -> torch.Tensor:
    t = t.expand(shape)
    return t[(None,) * (4 - t.dim())]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split: int) -> torch.Tensor:
    """x * cos + Concat(-x[..., split:], x[..., :split]) * sin, y contiguous in x's type."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x4, c4, s4 = (_four_d(t, x.shape) for t in (x, cos, sin))  # views: unsqueezed, broadcast by zero strides
    _, d1, d2, dim = x4.shape
    rows = x4.shape[0] * d1 * d2
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, 4096 // block_d)
    _rotary_kernel[(triton.cdiv(rows, block_r),)](x4, c4, s4, y, rows, d1, d2, dim, split, *x4.stride(),
                                                   *c4.stride(), *s4.stride(), BLOCK_R=block_r, BLOCK_D=block_d,
                                                   num_warps=4)
    return y
