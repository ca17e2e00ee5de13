"""Rows of a table by index (ONNX Gather on axis 0 of a 2-D table: an embedding lookup) in one kernel.

The reference wraps the indices first (negatives count from the end: a `remainder` kernel on the GPU) and then
runs torch's gather: two launches and an index tensor written and read in between (see
docs/design/small-kernels.md). The builder times this against the reference.
Here each program reads its block of indices, wraps them as the reference does (Python's remainder, so an index
outside [-rows, rows) wraps instead of faulting, like the reference on a GPU) and copies their rows.

Reference: kiln.ops.indexing.gather.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(t_ptr, i_ptr, y_ptr, n_idx, n_rows, n_cols, stride_t,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = r < n_idx, c < n_cols
    idx = tl.load(i_ptr + r, mask=r_ok, other=0).to(tl.int64) % n_rows
    idx = tl.where(idx < 0, idx + n_rows, idx)  # C's remainder keeps the sign: make it Python's
    ok = r_ok[:, None] & c_ok[None, :]
    v = tl.load(t_ptr + idx[:, None] * stride_t + c[None, :], mask=ok)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * n_cols + c[None, :], v, mask=ok)


def supports(table: torch.Tensor, indices: torch.Tensor) -> bool:
    """A 2-D table with unit-stride rows and integer indices, both on one device."""
    return (table.dim() == 2 and table.stride(1) == 1 and table.shape[0] > 0 and table.shape[1] > 0
            and not indices.dtype.is_floating_point and indices.dtype != torch.bool
            and indices.device == table.device and indices.numel() > 0)


def gather_rows(table: torch.Tensor, indices: torch.Tensor, block_r: int = 16, block_c: int = 256) -> torch.Tensor:
    """table[indices] ([*indices.shape, cols]), negative indices counted from the end."""
    rows, cols = table.shape
    idx = indices.reshape(-1)
    y = torch.empty((idx.numel(), cols), dtype=table.dtype, device=table.device)
    block_c = min(block_c, triton.next_power_of_2(cols))
    grid = (triton.cdiv(idx.numel(), block_r), triton.cdiv(cols, block_c))
    _gather_rows_kernel[grid](table, idx.contiguous(), y, idx.numel(), rows, cols, table.stride(0),
                              BLOCK_R=block_r, BLOCK_C=block_c)
    return y.reshape(*indices.shape, cols)
