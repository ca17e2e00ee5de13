"""Reductions: Reduce*, ArgMax/ArgMin, CumSum, CumProd."""

import torch

from .registry import register

_LOW = (torch.float16, torch.bfloat16)
_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_OVERFLOW = "sums overflow FP16's range (max 65504)"


def _dims(node, x, axes) -> tuple[int, ...]:
    """The axes to reduce, sorted and non-negative; () reduces nothing.
    Axes are an attribute before opset 13 (ReduceSum) / 18 (the others), then an input."""
    axes = node.attr("axes") if axes is None else axes.reshape(-1).tolist()
    if not axes:
        return () if node.attr("noop_with_empty_axes", 0) else tuple(range(x.dim()))
    return tuple(sorted({a + x.dim() if a < 0 else a for a in axes}))


def _empty_value(reducer, dtype):
    """What a max/min over an empty set yields: -inf/+inf (or the integer type's limits)."""
    if dtype == torch.bool:
        return reducer is torch.amin
    if dtype.is_floating_point:
        return float("-inf") if reducer is torch.amax else float("inf")
    info = torch.iinfo(dtype)
    return info.min if reducer is torch.amax else info.max


def _prod(x, dims, keep):
    for d in reversed(dims):  # torch.prod reduces one axis at a time
        x = x.prod(d, keepdim=True)
    return x if keep else x.squeeze(dims)


def _reduce(node, x, axes, core, pre=None, post=None, float_math=False, acc32=False):
    """post(core(pre(x))) over the node's axes; with no axes (noop_with_empty_axes)
    only pre and post apply. The result has x's type."""
    dims = _dims(node, x, axes)
    keep = bool(node.attr("keepdims", 1))
    y = x
    if y.dtype in _WIDE_UNSIGNED:
        y = y.to(torch.int64)
    if (float_math and not y.is_floating_point()) or (acc32 and y.dtype in _LOW):
        y = y.to(torch.float64 if float_math and not x.is_floating_point() else torch.float32)
    if pre is not None:
        y = pre(y)
    if dims:
        if core in (torch.amax, torch.amin) and y.numel() == 0:
            shape = [1 if d in dims else s for d, s in enumerate(y.shape) if keep or d not in dims]
            y = torch.full(shape, _empty_value(core, y.dtype), dtype=y.dtype, device=y.device)
        else:
            y = core(y, dims, keep)
    if post is not None:
        y = post(y)
    return y.to(x.dtype)


def _reduce_op(op_type, core, pre=None, post=None, float_math=False, keep_fp32=None):
    @register(op_type, host_inputs=(1,), keep_fp32=keep_fp32)
    def impl(node, x, axes=None):
        return _reduce(node, x, axes, core, pre, post, float_math, acc32=keep_fp32 is not None)

    return impl


def _sum(x, dims, keep):
    return torch.sum(x, dims, keep, dtype=x.dtype)  # ints stay ints (torch would widen to int64)


_reduce_op("ReduceSum", _sum, keep_fp32=_OVERFLOW)
_reduce_op("ReduceSumSquare", _sum, pre=torch.square, keep_fp32=_OVERFLOW)
_reduce_op("ReduceL1", _sum, pre=torch.abs, keep_fp32=_OVERFLOW)
_reduce_op("ReduceL2", _sum, pre=torch.square, post=torch.sqrt, float_math=True, keep_fp32=_OVERFLOW)
_reduce_op("ReduceLogSum", _sum, post=torch.log, float_math=True, keep_fp32=_OVERFLOW)
_reduce_op("ReduceProd", _prod, keep_fp32="products overflow FP16's range (max 65504)")
_reduce_op("ReduceLogSumExp", torch.logsumexp, float_math=True)
_reduce_op("ReduceMean", torch.mean, float_math=True)
_reduce_op("ReduceMax", torch.amax)
_reduce_op("ReduceMin", torch.amin)


def _arg(node, x, fn):
    axis = node.attr("axis", 0)
    axis = axis + x.dim() if axis < 0 else axis
    keep = bool(node.attr("keepdims", 1))
    if x.dtype in _WIDE_UNSIGNED:
        x = x.to(torch.int64)
    if node.attr("select_last_index", 0):  # torch returns the first extremum: search the flipped axis
        return x.shape[axis] - 1 - fn(x.flip(axis), axis, keep)
    return fn(x, axis, keep)


@register("ArgMax")
def argmax(node, x):
    return _arg(node, x, torch.argmax)


@register("ArgMin")
def argmin(node, x):
    return _arg(node, x, torch.argmin)


@register("CumSum", host_inputs=(1,), keep_fp32=_OVERFLOW)
def cumsum(node, x, axis):
    dim = int(axis.reshape(-1)[0])
    y = x.to(torch.int64) if x.dtype in _WIDE_UNSIGNED else x
    if node.attr("reverse", 0):
        y = y.flip(dim)
    y = torch.cumsum(y, dim, dtype=torch.float32 if y.dtype in _LOW else y.dtype)
    if node.attr("exclusive", 0) and y.shape[dim]:  # shift by one: element i sums elements before i
        y = torch.cat([torch.zeros_like(y.narrow(dim, 0, 1)), y.narrow(dim, 0, y.shape[dim] - 1)], dim)
    if node.attr("reverse", 0):
        y = y.flip(dim)
    return y.to(x.dtype)


@register("CumProd", host_inputs=(1,), keep_fp32="products overflow FP16's range (max 65504)", since=26)
def cumprod(node, x, axis):
    dim = int(axis.reshape(-1)[0])
    y = x.to(torch.int64) if x.dtype in _WIDE_UNSIGNED else x  # wraps modulo 2**bits like the unsigned type
    if node.attr("reverse", 0):
        y = y.flip(dim)
    y = torch.cumprod(y, dim, dtype=torch.float32 if y.dtype in _LOW else y.dtype)
    if node.attr("exclusive", 0) and y.shape[dim]:  # shift by one: element i multiplies the elements before i
        y = torch.cat([torch.ones_like(y.narrow(dim, 0, 1)), y.narrow(dim, 0, y.shape[dim] - 1)], dim)
    if node.attr("reverse", 0):
        y = y.flip(dim)
    return y.to(x.dtype)
