"""An image cast into channels-last with zero channels appended, in one pass: [N, C, H, W] of any float dtype and
strides -> [N, C_OUT, H, W] channels-last of the layer's dtype, channels C..C_OUT-1 zero.

Why: cuDNN runs a 7x7 RGB stem over 4 channels (the fourth zero, weights zero-padded to match) about a third
faster than over 3 (see docs/design/stem.md). The engine casts the FP32 NCHW image into FP16 channels-last anyway;
this kernel writes the
padded layout in that same copy (builder/layout.py picks the convolutions, engine/interpreter.cast_for calls it).

Reference: `reference` below (zeros, then a strided copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pad_channels_kernel(x_ptr, y_ptr, P, C, W, HW, sxn, sxc, sxh, sxw,
                         C_OUT: tl.constexpr, BLOCK: tl.constexpr):
    rp = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # pixels n*H*W + h*W + w
    rc = tl.arange(0, C_OUT)
    n, hw = rp // HW, rp % HW
    src = x_ptr + (n * sxn + (hw // W) * sxh + (hw % W) * sxw)[:, None] + rc[None, :] * sxc
    ok = rp < P
    x = tl.load(src, mask=ok[:, None] & (rc[None, :] < C), other=0.0)
    tl.store(y_ptr + rp[:, None] * C_OUT + rc[None, :], x.to(y_ptr.dtype.element_ty), mask=ok[:, None])


def pad_channels(x: torch.Tensor, channels: int, dtype: torch.dtype, block: int = 256,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, C, H, W] as a channels-last [N, channels, H, W] tensor of `dtype` (written into `out` if given),
    the added channels zero."""
    n, c, h, w = x.shape
    assert c <= channels and channels == triton.next_power_of_2(channels)
    y = out if out is not None else torch.empty((n, channels, h, w), dtype=dtype, device=x.device,
                                                memory_format=torch.channels_last)
    p = n * h * w
    if p:
        _pad_channels_kernel[(triton.cdiv(p, block),)](x, y, p, c, w, h * w, *x.stride(), C_OUT=channels, BLOCK=block)
    return y


def reference(x: torch.Tensor, channels: int, dtype: torch.dtype) -> torch.Tensor:
    n, c, h, w = x.shape
    y = torch.zeros((n, channels, h, w), dtype=dtype, device=x.device).contiguous(memory_format=torch.channels_last)
    y[:, :c].copy_(x)
    return y
