"""Programmatic dependent launch (Hopper): a Triton kernel launched right after another one on the
stream may start its programs before the previous kernel has finished, so its launch and the
scheduling of its programs overlap the previous kernel's last wave instead of following it. In a
CUDA graph the capture keeps this as a programmatic edge.

Each kernel calls `wait_for_previous(PDL)` before its first memory access: the wait blocks until the
previous kernel has completed and its writes are visible, so reads see its outputs and writes cannot
land on memory it still reads. The same call lets the next kernel launch at once; that kernel waits in
turn. A kernel from a library (cuBLASLt, cuDNN) is launched without the attribute and keeps the
ordinary ordering on both sides.

Off where Triton lacks it, on devices before sm_90, under the interpreter, and with KILN_PDL=0.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: no grid dependency control
    gdc_launch_dependents = gdc_wait = None

ENABLED = os.environ.get("KILN_PDL", "1") != "0" and gdc_wait is not None


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def on(device: torch.device) -> bool:
    """Whether kernels launched on `device` use programmatic dependent launch."""
    return (ENABLED and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device()))


@lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def launch_options(device: torch.device) -> dict:
    """The keyword arguments a launch passes: the kernel's PDL flag and Triton's launch option."""
    enabled = on(device)
    return {"PDL": enabled, "launch_pdl": enabled}


@contextmanager
def ordinary_launches():
    """Launches inside the block do not use PDL (the tactic timer's: see tactics/timer.py)."""
    global ENABLED
    was, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = was
