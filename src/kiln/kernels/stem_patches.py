"""Stem patches in one pass: the image read once where it lies (any float type and strides, NCHW as exported) and
written as the channels-last rows of the stride-1 convolution passes/stem_patches.py makes of an RGB stem,
quantized for it when it is 8-bit.

Each program owns a block of output pixels and writes their whole rows (64 values for a 7x7 stem), one
contiguous store; 128 pixels a program is the fastest block (see docs/design/stem.md). The image's values are
read once per cell column a row
holds (four times for a 7x7 stem), the repeats from cache: the patches of a batch-32 224x224 image are 25.7 MB
of int8 against 19.3 MB of FP32 image.

Reference: kiln.ops.fused.stem_patches_reference (and quantize).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm import QTYPES, quantize


@triton.jit
def _stem_patches_kernel(x_ptr, y_ptr, ys_ptr, P, C, H, W, HC, OW, FIRST, sxn, sxc, sxh, sxw,
                         K: tl.constexpr, CELL_C: tl.constexpr, QUANT: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    rp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixels (n, i, j) flattened
    rk = tl.arange(0, BLOCK_K)  # ((t * 2 + pr) * 2 + pc) * CELL_C + c
    j = rp % OW
    i = (rp // OW) % HC
    n = rp // (OW * HC)
    c = rk % CELL_C
    pc = (rk // CELL_C) % 2
    pr = (rk // (2 * CELL_C)) % 2
    t = rk // (4 * CELL_C)
    row = 2 * i[:, None] + pr[None, :]
    col = 2 * (j[:, None] + FIRST + t[None, :]) + pc[None, :]
    p_ok = rp < P
    ok = p_ok[:, None] & (c < C)[None, :] & (rk < K)[None, :] & (row < H) & (col >= 0) & (col < W)
    v = tl.load(x_ptr + (n * sxn)[:, None] + (c * sxc)[None, :] + row * sxh + col * sxw, mask=ok, other=0.0)
    v = quantize(v, ys_ptr, QUANT)
    out_ok = p_ok[:, None] & (rk < K)[None, :]
    tl.store(y_ptr + rp[:, None] * K + rk[None, :], v.to(y_ptr.dtype.element_ty), mask=out_ok)


def _sizes(node, x: torch.Tensor) -> tuple[int, int]:
    """(output pixels, values per pixel) of the node's patches of x."""
    return x.shape[0] * (x.shape[2] // 2) * node.attr("width"), node.attr("columns") * 4 * node.attr("channels")


def supports(node, x: torch.Tensor) -> bool:
    """A 4-D float image of even height and width, no more channels than a cell holds, 32-bit indexable."""
    if not (x.dim() == 4 and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel() > 0
            and x.shape[1] <= node.attr("channels") and x.shape[2] % 2 == 0 and x.shape[3] % 2 == 0):
        return False
    p, k = _sizes(node, x)
    return x.numel() < 2**31 and p * k < 2**31


def stem_patches(node, x: torch.Tensor, y_scale: torch.Tensor | None = None, qtype: str = "",
                 block_p: int = 128) -> torch.Tensor:
    """As the reference, for a `supports` x: [N, columns * 4 * channels, H/2, width] channels-last, quantized with
    y_scale (per tensor) to qtype ("int8" / "fp8") when given, else in x's type."""
    n, c, h, w = x.shape
    p, k = _sizes(node, x)
    quant = qtype if y_scale is not None else ""
    y = torch.empty((n, h // 2, node.attr("width"), k), dtype=QTYPES[quant] if quant else x.dtype, device=x.device)
    _stem_patches_kernel[(triton.cdiv(p, block_p),)](
        x, y, y_scale if quant else x, p, c, h, w, h // 2, node.attr("width"), node.attr("first"), *x.stride(),
        K=k, CELL_C=node.attr("channels"), QUANT=quant, BLOCK_P=block_p, BLOCK_K=triton.next_power_of_2(k))
    return y.permute(0, 3, 1, 2)
