"""kiln::ViewChain: a chain of Reshapes and Transposes (passes/fuse_view_chains.py) as one layer that copies at most
once.

MobileViT's unfold turns a channels-last [B, C, H, W] map into patch sequences [B * P, N, C] through Reshape ->
Transpose -> Reshape -> Transpose -> Reshape, and its fold goes back the same way: run one op at a time, each
Reshape of a transposed view copies, three copies where the data moves once. Here the chain is followed on the
input's own strides: every axis of the input is an "atom" (size, stride); a Transpose reorders the axes, a
Reshape regroups the atoms in order, splitting one where a new axis ends inside it (an axis of size a and stride
s splits into r of stride s * a / r and a / r of stride s). At the end each output axis is a group of atoms:
where every group is one stride the result is a view; else one strided copy of the atoms in output order, into
channels-last memory when the result is a 4-D FP16/BF16 image on a GPU that a convolution reads (attribute
channels_last), as the convolution kernels want it.

Attribute steps: "T:p0,p1,..." (Transpose perm) and "R:d0,d1,..." (Reshape shape, ONNX's 0 and -1, allowzero 0).
Where the atoms cannot follow the chain (a Reshape that splits no atom evenly) the ops run one at a time; the
tests compare every chain with the ops one at a time (one_by_one).
"""

from __future__ import annotations

import itertools
import math
import re

import torch

from ..errors import EngineFileError
from .fused import KILN
from .registry import register

_STEP = re.compile(r"([TR]):(-?[0-9]+(?:,-?[0-9]+)*)?")


def parse(steps) -> list[tuple[str, list[int]]]:
    """[(kind, ints)] of the steps attribute; anything else is refused (an engine's attributes are data)."""
    out = []
    for s in steps if isinstance(steps, (list, tuple)) else [None]:
        m = _STEP.fullmatch(s) if isinstance(s, str) else None
        if m is None:
            raise EngineFileError(f"a ViewChain layer's step {str(s)[:40]!r} is not 'T:perm' or 'R:shape'; the "
                                  "engine file is damaged or was not written by Kiln: rebuild it.")
        out.append((m.group(1), [int(v) for v in m.group(2).split(",")] if m.group(2) else []))
    return out


def reshape_target(shape: list[int], spec: list[int]) -> list[int]:
    """ONNX Reshape's output shape (allowzero 0): 0 copies the input's axis, -1 takes what is left."""
    out = [shape[i] if d == 0 else d for i, d in enumerate(spec)]
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        out[out.index(-1)] = math.prod(shape) // known if known else 0
    return out


def plan(shape, strides, steps) -> tuple[list[int], list[list[tuple[int, int]]]] | None:
    """(output shape, each output axis's atoms (size, stride), outermost first) of the chain on an input of this
    shape and these strides, or None where a Reshape splits no atom evenly."""
    dims = [[(n, s)] if n != 1 else [] for n, s in zip(shape, strides)]
    sizes = list(shape)
    for kind, arg in steps:
        if kind == "T":
            perm = arg or list(range(len(dims) - 1, -1, -1))
            dims, sizes = [dims[p] for p in perm], [sizes[p] for p in perm]
            continue
        target = reshape_target(sizes, arg)
        if math.prod(target) != math.prod(sizes):
            return None
        flat = [a for d in dims for a in d]
        new, i = [], 0
        for size in target:
            group, left = [], size
            while left > 1:
                if i >= len(flat):
                    return None
                n, s = flat[i]
                if left % n == 0:
                    group.append((n, s))
                    left //= n
                    i += 1
                elif n % left == 0:  # the axis ends inside this atom: its outer part here, the rest after
                    group.append((left, s * (n // left)))
                    flat[i] = (n // left, s)
                    left = 1
                else:
                    return None
            new.append(group)
        if i != len(flat):
            return None
        dims, sizes = new, target
    return sizes, dims


def _merged(group: list[tuple[int, int]]) -> int | None:
    """The one stride of an output axis whose atoms are laid out as one axis, else None."""
    for (_, s0), (n1, s1) in itertools.pairwise(group):
        if s0 != s1 * n1:
            return None
    return group[-1][1] if group else None


def _one_by_one(x, steps):
    for kind, arg in steps:
        x = x.permute(arg or list(range(x.dim() - 1, -1, -1))) if kind == "T" else \
            x.reshape(reshape_target(list(x.shape), arg))
    return x


def one_by_one(node, x):
    """The Reshapes and Transposes one at a time, as the graph had them (what the tests compare with)."""
    return _one_by_one(x, parse(node.attr("steps")))


@register("ViewChain", domain=KILN)
def view_chain(node, x):
    """The chain followed on x's strides: a view, or one strided copy. The op's implementation on every device,
    so a build's tactic timing sees the layout the engine's later layers will get."""
    steps = parse(node.attr("steps"))
    planned = plan(list(x.shape), list(x.stride()), steps)
    if planned is None:
        return _one_by_one(x, steps)
    shape, dims = planned
    strides = [_merged(g) for g in dims]
    if all(s is not None or not g for s, g in zip(strides, dims)):
        # a view: a size-1 axis takes the stride a contiguous tensor would give it
        out, step = [0] * len(shape), 1
        for k in range(len(shape) - 1, -1, -1):
            out[k] = strides[k] if dims[k] else step
            step = out[k] * shape[k] if dims[k] else step
        return x.as_strided(shape, out, x.storage_offset())
    atoms = [a for g in dims for a in g]
    src = x.as_strided([n for n, _ in atoms], [s for _, s in atoms], x.storage_offset())
    layout = torch.channels_last if (node.attr("channels_last", 0) and len(shape) == 4 and x.is_cuda
                                     and x.dtype in (torch.float16, torch.bfloat16)) else torch.contiguous_format
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=layout)
    # y split into the same atoms (splitting an axis is always a view), so the copy is one pass
    dst_strides = []
    for g, t in zip(dims, y.stride()):
        inner = math.prod(n for n, _ in g)
        for n, _ in g:
            inner //= n
            dst_strides.append(t * inner)
    y.as_strided([n for n, _ in atoms], dst_strides, 0).copy_(src)
    return y
