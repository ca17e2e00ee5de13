"""Programmatic dependent launch (Hopper): a kernel launched with launch_pdl may have its programs scheduled
while the kernel before it in the stream (or CUDA graph) is still finishing, once that kernel's programs have all
said it may (griddepcontrol.launch_dependents) or exited. Its programs then set up (barriers, descriptors) in the
tail of the one before and wait (griddepcontrol.wait) before reading anything it wrote. Both instructions do
nothing in a kernel launched without it. The Triton kernels issue them by start_after_previous (below), the Gluon
ones by warp_specialized's wait_for_previous_kernel and let_next_kernel_start.

A kernel launched with launch_options() must wait before its first read of an activation: the kernel before may
still be writing it. It saves a fraction of a microsecond a kernel in chains of short kernels (see
docs/design/small-kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

def launch_options(device: torch.device, pdl: bool = True) -> dict:
    """The launch keyword for a kernel that waits for the one before (above), on device; none with pdl=False (the
    launchers' `pdl` keyword: bench/pdl_chain.py times chains both ways)."""
    if not pdl or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"launch_pdl": True}


@triton.jit
def start_after_previous(PDL: tl.constexpr):
    """A Triton kernel's first step where it was launched with launch_options (PDL: a constexpr, as Triton's
    interpreter has no inline assembly): wait for the kernel before, which may still be writing its inputs, then
    let the next one be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
