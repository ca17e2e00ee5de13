"""A convolution's bias, residual add and activation in one generated elementwise pass, in place.

cuDNN's convolutions through torch take the bias as a second pass (a broadcast add of [1, C, 1, 1], which torch
runs on its generic strided kernel over a channels-last output) and leave the residual add and any activation but
ReLU to passes of their own: a YOLO-style block's 3x3 convolution with SiLU reads and writes its output three
times after the convolution. Here the convolution runs without its bias, and one kiln::Elementwise program
(kernels/elementwise.py) computes act(y + b [+ z]) in FP32 and stores it over y: one pass, one rounding.

Reference: kiln.ops.fused.fused_conv (its bias, residual and activation after the convolution).
"""

from __future__ import annotations

import torch

from . import elementwise

# A fused activation (kiln.ops.fused.activation's names) as program lines over its input {x}: {t} is the line's
# own temporary, {s} the first line's, {p0}/{p1} the activation's parameters.
_ACTIVATION = {
    "Relu": ["Relu {t} {x}"],
    "Sigmoid": ["Sigmoid {t} {x}"],
    "Silu": ["Sigmoid {t} {x}", "Mul {t} {x} {s}"],
    "HardSwish": ["HardSwish {t} {x}"],
    "GeluErf": ["Gelu {t} {x}"],
    "GeluTanh": ["GeluTanh {t} {x}"],
    "Tanh": ["Tanh {t} {x}"],
    "LeakyRelu": ["LeakyRelu {t} {x} {p0}"],
    "Clip": ["Clip {t} {x} {p0} {p1}"],
}
_DEFAULT_PARAMS = {"LeakyRelu": (0.01,)}


def _literal(v: float) -> str:
    return "c" + repr(float(v))  # elementwise.parse reads cNUMBER (inf, -inf and nan included)


def program(activation: str, params=(), residual: bool = False) -> list[str] | None:
    """The program over inputs i0 = y, i1 = bias [1, C, 1, 1] (, i2 = residual): act(y + b [+ z]); None for an
    activation it has no lines for."""
    lines = ["Add t0 i0 i1"]
    if residual:
        lines.append("Add t1 t0 i2")
    if activation:
        steps = _ACTIVATION.get(activation)
        if steps is None:
            return None
        params = tuple(params) or _DEFAULT_PARAMS.get(activation, ())
        if activation in ("LeakyRelu", "Clip") and len(params) < (1 if activation == "LeakyRelu" else 2):
            return None
        x, first = f"t{len(lines) - 1}", len(lines)
        for k, step in enumerate(steps):
            lines.append(step.format(t=f"t{first + k}", s=f"t{first}", x=x,
                                     **{f"p{i}": _literal(p) for i, p in enumerate(params)}))
    return lines


def supports(out_shape, dtype: torch.dtype, b, z, activation: str, params=()) -> bool:
    """A 4-D float output whose bias is a vector of its channels in its own type, a residual (if any) of its
    shape and type, and an activation the program has lines for."""
    if b is None or len(out_shape) != 4 or not dtype.is_floating_point:
        return False
    if b.dim() != 1 or b.numel() != out_shape[1] or b.dtype != dtype:
        return False
    if z is not None and (tuple(z.shape) != tuple(out_shape) or z.dtype != dtype or z.device != b.device):
        return False
    return program(activation, params, z is not None) is not None


def apply(y: torch.Tensor, b: torch.Tensor, z, activation: str, params=()) -> torch.Tensor:
    """act(y + b [+ z]) written over y (the convolution's fresh output), returned."""
    inputs = [y, b.view(1, -1, 1, 1)] + ([z] if z is not None else [])
    return elementwise.run(program(activation, params, z is not None), inputs, out=y)


def reference(y, b, z, activation: str, params=()) -> torch.Tensor:
    from ..ops.fused import activation as act

    y = y.float() + b.float().view(1, -1, 1, 1)
    if z is not None:
        y = y + z.float()
    return act(activation, y, list(params)).to(b.dtype)
