"""Elementwise ops: arithmetic, comparison, logic, bitwise and unary math."""

import functools

import torch

from .registry import register

_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def _via_int64(fn):
    """torch has no CPU arithmetic/comparison kernels for uint16/32/64: compute in
    int64 and cast integer results back (int64 -> uintN wraps modulo 2**N). Exact
    except for uint64 values >= 2**63, which order and divide as negatives."""

    @functools.wraps(fn)
    def impl(node, *xs):
        wide = next((x.dtype for x in xs if isinstance(x, torch.Tensor) and x.dtype in _WIDE_UNSIGNED), None)
        if wide is None:
            return fn(node, *xs)
        xs = [x.to(torch.int64) if isinstance(x, torch.Tensor) and x.dtype in _WIDE_UNSIGNED else x for x in xs]
        out = fn(node, *xs)
        return out.to(wide) if out.dtype == torch.int64 else out

    return impl


def _legacy_broadcast(node, a, b):
    """Before opset 7, B broadcasts to A only with broadcast=1, its dims aligned
    at `axis` (default: trailing), not numpy-style."""
    if node.opset >= 7 or not node.attr("broadcast", 0) or b.dim() >= a.dim():
        return b
    axis = node.attr("axis", a.dim() - b.dim())
    axis = axis + a.dim() if axis < 0 else axis
    return b.reshape((1,) * axis + tuple(b.shape) + (1,) * (a.dim() - axis - b.dim()))


def _binary(op_type, fn):
    @register(op_type)
    @_via_int64
    def impl(node, a, b):
        return fn(a, _legacy_broadcast(node, a, b))

    return impl


def _unary(op_type, fn):
    @register(op_type)
    @_via_int64
    def impl(node, x):
        return fn(x)

    return impl


def _int_divisor(b):
    """Integer x / 0 is undefined in ONNX, but torch raises on CPU (and the build's
    validation run feeds random 0/1 integers): divide by 1 there instead."""
    return b.masked_fill(b == 0, 1)


def _div(a, b):
    if a.is_floating_point() or b.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, _int_divisor(b), rounding_mode="trunc")  # ONNX integer Div truncates toward zero


for _op, _fn in {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _div,
    "Equal": torch.eq, "Greater": torch.gt, "GreaterOrEqual": torch.ge, "Less": torch.lt, "LessOrEqual": torch.le,
    "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
    "BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or, "BitwiseXor": torch.bitwise_xor,
}.items():
    _binary(_op, _fn)


@register("Pow")
@_via_int64
def pow_(node, x, y):
    # The output has X's type even when Y's differs (int ** float truncates, like numpy's astype).
    return torch.pow(x, _legacy_broadcast(node, x, y)).to(x.dtype)


def _check_mod(node):
    return None if node.attr("fmod", 0) in (0, 1) else f"Mod fmod={node.attr('fmod')} (must be 0 or 1)"


@register("Mod", check=_check_mod)
@_via_int64
def mod(node, a, b):
    if not b.is_floating_point():
        b = _int_divisor(b)
    # fmod=1: C fmod (sign of the dividend); fmod=0: sign of the divisor, like Python's %.
    return torch.fmod(a, b) if node.attr("fmod", 0) else torch.remainder(a, b)


def _check_bitshift(node):
    d = node.attr("direction")
    return None if d in ("LEFT", "RIGHT") else f"BitShift direction={d!r} (must be LEFT or RIGHT)"


@register("BitShift", check=_check_bitshift)
@_via_int64
def bitshift(node, x, y):
    if node.attr("direction") == "LEFT":
        return torch.bitwise_left_shift(x, y)
    return torch.bitwise_right_shift(x, y)


def _variadic(op_type, fn):
    @register(op_type)
    @_via_int64
    def impl(node, *xs):
        return functools.reduce(fn, xs)

    return impl


_variadic("Max", torch.maximum)
_variadic("Min", torch.minimum)
_variadic("Sum", torch.add)


@register("Mean")
def mean(node, *xs):
    return functools.reduce(torch.add, xs) / len(xs)


@register("Where")
@_via_int64
def where(node, cond, x, y):
    return torch.where(cond, x, y)


@register("Clip")
@_via_int64
def clip(node, x, lo=None, hi=None):
    if node.opset < 11:  # bounds were attributes
        lo, hi = node.attr("min"), node.attr("max")
    if lo is None and hi is None:
        return x
    # If min > max, torch.clamp (like ONNX) sets every element to max.
    return torch.clamp(x, lo, hi)


@register("IsInf")
def isinf(node, x):
    pos = x == float("inf") if node.attr("detect_positive", 1) else torch.zeros_like(x, dtype=torch.bool)
    neg = x == float("-inf") if node.attr("detect_negative", 1) else torch.zeros_like(x, dtype=torch.bool)
    return pos | neg


_unary("IsNaN", torch.isnan)
_unary("Not", torch.logical_not)
_unary("BitwiseNot", torch.bitwise_not)
_unary("Abs", torch.abs)
_unary("Neg", torch.neg)
_unary("Sign", torch.sign)
_unary("Ceil", torch.ceil)
_unary("Floor", torch.floor)
_unary("Round", torch.round)  # half to even, as ONNX specifies
_unary("Reciprocal", torch.reciprocal)
_unary("Sqrt", torch.sqrt)
_unary("Exp", torch.exp)
_unary("Log", torch.log)
_unary("Erf", torch.erf)
_unary("Tanh", torch.tanh)
for _op in ("Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"):
    _unary(_op, getattr(torch, _op.lower()))
