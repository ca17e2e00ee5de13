"""Concat along the channels of channels-last images: each input's [pixels, channels] rows copied into its
channel range of the output's rows, up to four inputs a launch.

A YOLO-style C2f block concatenates the two halves of a split (channel slices of one channels-last map, so not
contiguous) and its bottlenecks' outputs; torch.cat takes inputs like those one strided copy at a time on its
generic kernel. Here a program copies a block of pixel rows of one input, the channels contiguous in both
tensors (a slice of a channels-last map is rows of stride C with its channels contiguous).

Reference: torch.cat(xs, dim=1) (kiln.ops.shape.concat).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_INPUTS = 4  # a launch's inputs; more take further launches
BLOCK_P = 64


@triton.jit
def _copy_rows(y_ptr, src, sp, c, off, P, C_OUT, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)[:, None]
    row_ok = rows < P
    for start in range(0, c, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)[None, :]
        m = row_ok & (cols < c)
        v = tl.load(src + rows * sp + cols, mask=m)
        tl.store(y_ptr + rows * C_OUT + off + cols, v, mask=m)


@triton.jit
def _concat_kernel(y_ptr, x0, x1, x2, x3, s0, s1, s2, s3, c0, c1, c2, c3, o0, o1, o2, o3, P, C_OUT,
                   BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    which = tl.program_id(1)  # each input in a branch of its own: its arguments' types never meet another's
    if which == 0:
        _copy_rows(y_ptr, x0, s0, c0, o0, P, C_OUT, BLOCK_P, BLOCK_C)
    if which == 1:
        _copy_rows(y_ptr, x1, s1, c1, o1, P, C_OUT, BLOCK_P, BLOCK_C)
    if which == 2:
        _copy_rows(y_ptr, x2, s2, c2, o2, P, C_OUT, BLOCK_P, BLOCK_C)
    if which == 3:
        _copy_rows(y_ptr, x3, s3, c3, o3, P, C_OUT, BLOCK_P, BLOCK_C)


def pixel_stride(x: torch.Tensor) -> int | None:
    """The one stride between consecutive pixels (n, h, w) of a 4-D image whose channels are contiguous, or None."""
    n, c, h, w = x.shape
    sn, sc, sh, sw = x.stride()
    if c > 1 and sc != 1:
        return None
    step = None
    for size, stride in ((w, sw), (h, sh), (n, sn)):  # innermost pixel axis first
        if size == 1:
            continue
        if step is None:
            step, expect = stride, stride * size
        elif stride != expect:
            return None
        else:
            expect *= size
    return step if step is not None else c


def supports(xs: list[torch.Tensor]) -> bool:
    """4-D images of one float type and device with the same N, H, W, each's pixels a row of contiguous channels."""
    if len(xs) < 2 or any(x.dim() != 4 for x in xs):
        return False
    first = xs[0]
    return (first.dtype in (torch.float16, torch.bfloat16, torch.float32) and first.numel() > 0
            and all(x.dtype == first.dtype and x.device == first.device and x.shape[0] == first.shape[0]
                    and x.shape[2:] == first.shape[2:] and x.shape[1] > 0 for x in xs)
            and all(pixel_stride(x) is not None for x in xs))


def concat_channels(xs: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(xs, 1) written channels-last."""
    n, _, h, w = xs[0].shape
    c_out = sum(x.shape[1] for x in xs)
    y = torch.empty((n, c_out, h, w), dtype=xs[0].dtype, device=xs[0].device, memory_format=torch.channels_last)
    pixels = n * h * w
    offsets = [0]
    for x in xs[:-1]:
        offsets.append(offsets[-1] + x.shape[1])
    for at in range(0, len(xs), MAX_INPUTS):
        group, offs = xs[at:at + MAX_INPUTS], offsets[at:at + MAX_INPUTS]
        k = len(group)
        pad = MAX_INPUTS - k
        ptrs = group + [group[0]] * pad
        strides = [pixel_stride(x) for x in group] + [0] * pad
        chans = [x.shape[1] for x in group] + [0] * pad
        block_c = min(128, triton.next_power_of_2(max(x.shape[1] for x in group)))
        _concat_kernel[(triton.cdiv(pixels, BLOCK_P), k)](
            y, *ptrs, *strides, *chans, *(offs + [0] * pad), pixels, c_out, BLOCK_P=BLOCK_P, BLOCK_C=block_c)
    return y
