"""kiln::Rotary: rotary position embedding as HF Llama/Qwen2/Mistral export it, as one layer.

    y = x * cos + Concat(-x[split:end], x[0:split]) * sin      (rotate_half(x) = the Concat)

The slices run along `axis` and the Concat along `concat_axis`, as the exporter wrote them (both the last
axis of a [batch, heads, seq, head_dim] q or k, split = head_dim / 2); cos and sin broadcast against x as
ONNX's Mul does. passes/fuse_rotary.py writes it; its Triton kernel is kernels/rotary.py.
"""

from __future__ import annotations

import torch

from .registry import register

KILN = "kiln"


def rotate(x: torch.Tensor, split: int, end: int, axis: int, concat_axis: int) -> torch.Tensor:
    """Concat(-x[split:end], x[0:split]) along the given axes, the slices clamped as ONNX's Slice clamps them."""
    axis = axis % x.dim()
    head = [slice(None)] * axis
    return torch.cat([-x[(*head, slice(split, end))], x[(*head, slice(0, split))]], dim=concat_axis)


@register("Rotary", domain=KILN)
def rotary(node, x, cos, sin):
    """x * cos + rotate_half(x) * sin, in the inputs' type (the ONNX nodes' own arithmetic)."""
    rot = rotate(x, node.attr("split"), node.attr("end"), node.attr("axis", -1), node.attr("concat_axis", -1))
    return x * cos + rot * sin
