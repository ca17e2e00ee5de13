"""Greedy tokens: the argmax of each row of a step's logits [rows, vocab] in one launch spread over the GPU.

torch's argmax reduces each row of a 128k vocabulary in one block of threads, so one SM does a batch-1 step's
whole reduction. Here each row is cut into chunks of BLOCK columns, one program a chunk: each writes its
chunk's largest value and the first column holding it, counts itself in the row's counter, and the program that arrives last reduces the row's chunks (largest value, then the smallest column
among those holding it: torch.argmax's first maximal index) and resets the counter (kernels/fp8_gemv.py's
split-K pattern). NaN counts as larger than every number, as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, start_after_previous

BLOCK = 4096
MAX_ROWS = 1 << 16  # rows one launch may count (the counter buffer's length)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, pv_ptr, pi_ptr, count_ptr, n, stride_x, chunks, BLOCK: tl.constexpr,
                   C_PAD: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    raw = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    is_nan = raw != raw
    v = tl.where(is_nan, float("-inf"), raw)
    top = tl.max(v, 0)
    first = tl.min(tl.where(v == top, cols, n), 0)
    first_nan = tl.min(tl.where(is_nan, cols, n), 0)
    # a chunk holding a NaN reports NaN and its first NaN's column: the row's reduction prefers it to any number
    tl.store(pv_ptr + row * chunks + c, tl.where(first_nan < n, float("nan"), top))
    tl.store(pi_ptr + row * chunks + c, tl.where(first_nan < n, first_nan, first))
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == chunks - 1:
        rc = tl.arange(0, C_PAD)
        ok = rc < chunks
        pv = tl.load(pv_ptr + row * chunks + rc, mask=ok, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(pi_ptr + row * chunks + rc, mask=ok, other=n, cache_modifier=".cg")
        nan_chunk = pv != pv
        any_nan = tl.max(tl.where(nan_chunk, 1, 0), 0)
        best = tl.max(tl.where(nan_chunk, float("-inf"), pv), 0)
        pick = tl.where(any_nan > 0, nan_chunk, pv == best) & ok
        tl.store(out_ptr + row, tl.min(tl.where(pick, pi, n), 0).to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0)  # ready for the next launch (and the next graph replay)


_COUNTERS: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
    return c


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, n] (float) -> int64 [rows]: each row's first maximal column, as torch.argmax(x, dim=-1);
    written into `out` (int64 [rows], contiguous) when given, e.g. a CUDA graph's static buffer."""
    if x.dim() != 2 or not x.dtype.is_floating_point or x.shape[0] > MAX_ROWS:
        raise ValueError(f"argmax_rows takes a 2-D float tensor of at most {MAX_ROWS} rows, got {x.dtype} "
                         f"{list(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, n = x.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"argmax_rows: out must be a contiguous int64 tensor of {rows} rows, got {out.dtype} "
                         f"{list(out.shape)}")
    if rows == 0 or n == 0:
        return out
    chunks = triton.cdiv(n, BLOCK)
    pv = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    pi = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    pdl = launch_options(x.device)
    _argmax_kernel[(rows, chunks)](x, out, pv, pi, _counters(x.device), n, x.stride(0), chunks, BLOCK=BLOCK,
                                   C_PAD=triton.next_power_of_2(chunks), PDL=bool(pdl), num_warps=8, **pdl)
    return out
