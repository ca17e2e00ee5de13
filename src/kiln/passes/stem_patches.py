"""INT8/FP8 builds: a stride-2 convolution over an image's few channels (an RGB stem) becomes stem patches and a
stride-1 convolution over many channels, which then quantizes like the rest of the network.

Three input channels waste most of an 8-bit Tensor Core step (32 channels), so insert_qdq leaves such a
convolution in float, where it costs an 8-bit engine as much as an FP16 one (see docs/design/stem.md).

Stride 2 splits the image into 2x2 cells (space-to-depth: 4 phases x C channels per cell), and a KH x KW kernel
with padding p becomes a kernel of about KH/2 x KW/2 cells. The patches op (kiln::StemPatches) writes for each
output pixel the cells of its kernel's cell columns side by side, 4 x 4 cells x 4 channels = 64 values for a 7x7
stem (the fourth channel zero), so what is left is a convolution of KH/2 x 1 cell rows, stride 1, over 64
channels: an implicit GEMM with K = 256 that the 8-bit TMA convolution runs, against K = 147 for the original.
The new weights put each (row, column, channel) of the original kernel at its cell's tap and phase, and zeros
where the cells reach past it; the results are the same numbers (tests/passes/test_stem_patches.py).

The patches hold the image's values rearranged, so their calibrated range is the image's. A stem pinned to a
precision (--layerPrecisions) is left as it is.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from .insert_qdq import MIN_CHANNELS
from .rewrite import pinned

CELL_CHANNELS = 4  # channels per cell phase: the image's, zero-padded (3 -> 4)


def geometry(n: Node, shape, w: torch.Tensor) -> dict | None:
    """The rewrite's numbers for a stride-2 2-D stem over a [N, C, H, W] input, or None where it does not apply."""
    if (len(shape) != 4 or not all(isinstance(d, int) for d in shape[1:]) or w.dim() != 4
            or not w.dtype.is_floating_point or shape[1] != w.shape[1] or w.shape[1] >= MIN_CHANNELS):
        return None
    _, _, h, wd = shape
    kh, kw = w.shape[2:]
    if (n.attr("group", 1) != 1 or list(n.attr("strides", [1, 1])) != [2, 2]
            or list(n.attr("dilations", [1, 1])) != [1, 1] or n.attr("auto_pad", "NOTSET") != "NOTSET"
            or h % 2 or wd % 2):
        return None
    top, left, bottom, right = n.attr("pads", [0, 0, 0, 0])
    oh, ow = (h + top + bottom - kh) // 2 + 1, (wd + left + right - kw) // 2 + 1
    first_row, last_row = -top // 2, (kh - 1 - top) // 2  # the cell rows the kernel reaches, relative
    first_col, last_col = -left // 2, (kw - 1 - left) // 2
    pad_bottom = oh - 1 + last_row - (h // 2 - 1)
    if oh < 1 or ow < 1 or pad_bottom < 0:
        return None
    return {"first_row": first_row, "rows": last_row - first_row + 1, "first": first_col,
            "columns": last_col - first_col + 1, "width": ow, "pads": [-first_row, 0, pad_bottom, 0],
            "top": top, "left": left}


def patch_weights(w: torch.Tensor, g: dict) -> torch.Tensor:
    """w [O, C, KH, KW] as the [O, columns * 4 * CELL_CHANNELS, rows, 1] kernel over the patches."""
    o, c, kh, kw = w.shape
    out = torch.zeros(o, g["columns"], 2, 2, CELL_CHANNELS, g["rows"], dtype=w.dtype)
    for a in range(g["rows"]):
        for pr in range(2):
            r = 2 * (g["first_row"] + a) + pr + g["top"]
            for t in range(g["columns"]):
                for pc in range(2):
                    s = 2 * (g["first"] + t) + pc + g["left"]
                    if 0 <= r < kh and 0 <= s < kw:
                        out[:, t, pr, pc, :c, a] = w[:, :, r, s]
    return out.reshape(o, -1, g["rows"], 1)


def run(graph: Graph) -> None:
    amax = graph.quant_amax
    if amax is None:
        return
    inputs = {v.name: v for v in graph.inputs}
    for n in [n for n in graph.nodes if n.op_type == "Conv" and not n.domain and n.inputs[0] in inputs]:
        x = n.inputs[0]
        w = graph.initializers.get(n.inputs[1])
        g = geometry(n, inputs[x].shape or (), w) if w is not None else None
        if g is None or pinned(n) or not amax.get(x, 0) > 0:
            continue
        patches = f"{n.name}.patches"
        graph.nodes.insert(graph.nodes.index(n), Node(
            "StemPatches", [x], [patches], {"channels": CELL_CHANNELS, "first": g["first"], "columns": g["columns"],
                                            "width": g["width"]},
            name=patches, domain="kiln", sources=[n.name]))
        graph.initializers[f"{n.name}.patch_weight"] = patch_weights(w, g)
        n.inputs = [patches, f"{n.name}.patch_weight", *n.inputs[2:]]
        n.attrs.update(kernel_shape=[g["rows"], 1], strides=[1, 1], pads=g["pads"], dilations=[1, 1])
        amax[patches] = amax[x]  # the same values, rearranged
        if graph.quant_absmax is not None and x in graph.quant_absmax:
            graph.quant_absmax[patches] = graph.quant_absmax[x]
