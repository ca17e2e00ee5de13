"""Prefetch the start of a weight into L2 while small kernels run (Hopper: cp.async.bulk.prefetch.L2).

A batch-1 decode step reads its weights from HBM in the GEMVs; between them run the norms, RoPE and attention,
a few microseconds in which HBM is nearly idle. A prefetch kernel launched just before such a stretch asks L2 for
the first bytes of the next GEMV's weight, so that GEMV finds them there.

The kernel is launched as a programmatic dependent (kernels/pdl.py) but lets the next kernel start at once and
issues its prefetches before it waits for the kernel before it (it reads nothing that kernel writes); it still
waits before it ends, so that a kernel after it, which waits for it alone, also finds everything before it done.
A prefetch changes no memory: results are the same with or without it. Elsewhere than on CUDA with sm_90 it is
not launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .pdl import launch_options

CHUNK = 16384  # bytes one thread asks for


@triton.jit
def _prefetch_kernel(p_ptr, nbytes, CHUNK: tl.constexpr, THREADS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    i = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
    start = i.to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK).to(tl.int32)  # whole 16-byte pieces (nbytes is)
    base = p_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [(base + start).to(tl.int64), size], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        gdc_wait()


def supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None) -> None:
    """Ask L2 for the first nbytes (all where None) of the contiguous tensor t's data; a no-op off sm_90."""
    if not supported(t.device) or not t.is_contiguous():
        return
    total = t.numel() * t.element_size()
    n = min(total if nbytes is None else nbytes, total) // 16 * 16
    if n <= 0 or t.data_ptr() % 16:
        return
    threads = 128
    pdl = launch_options(t.device)
    _prefetch_kernel[(triton.cdiv(n, CHUNK * threads),)](t, n, CHUNK=CHUNK, THREADS=threads, PDL=bool(pdl),
                                                          num_warps=threads // 32, **pdl)
