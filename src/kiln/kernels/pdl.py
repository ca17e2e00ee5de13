"""Programmatic dependent launch (Hopper): a kernel launched with launch_pdl may have its programs scheduled
while the kernel before it in the stream (or CUDA graph) is still finishing, once that kernel's programs have all
said it may (let_next_kernel_start) or exited. Its programs then set up (barriers, descriptors, a resident filter)
in the tail of the one before and wait (wait_for_previous_kernel, griddepcontrol.wait) before reading anything it
wrote. Both instructions do nothing in a kernel launched without it.

A kernel launched with launch_options() must wait before its first read of an activation: the kernel before may
still be writing it. On the H200 (2026-12-01, bench/results/H200-pdl-chain-1454.log, -1502.log, -1517.log)
chains of ResNet-50's 8-bit bottleneck blocks ran 0.5-0.8 us a kernel faster with it at layers 1-3, outputs equal;
at layer4's short kernels the two were within noise (-0.4 to +0.2 us a kernel); the host's time to launch the
graph was the same.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ENABLED = True  # False launches without it (bench/pdl_chain.py times both)


def launch_options(device: torch.device) -> dict:
    """The launch keyword for a kernel that waits (wait_for_previous_kernel, or gdc_wait in Triton) on device."""
    if not ENABLED or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"launch_pdl": True}


@gluon.jit
def wait_for_previous_kernel():
    """griddepcontrol.wait: until the kernel before has finished and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def let_next_kernel_start():
    """griddepcontrol.launch_dependents: the next kernel's programs may be scheduled (they take SM room as ours
    leave it, and wait for ours to finish before reading)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
