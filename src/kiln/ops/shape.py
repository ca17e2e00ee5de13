"""Shape and data-movement ops: Shape, Reshape, Transpose, Concat, Slice, Pad...

Ops that read an input as Python numbers (Reshape's shape, Slice's starts...)
declare it in host_inputs: in an engine those values come from shape
arithmetic that the runtime evaluates on the host once per input shape.
"""

import math

import torch

from ..errors import UnsupportedError
from ..ir import dtypes
from .indexing import signed_view
from .registry import register


def _ints(t) -> list[int]:
    """A host tensor of integers (or an attribute list) as Python ints."""
    return [int(v) for v in (t.reshape(-1).tolist() if isinstance(t, torch.Tensor) else t)]


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# --- shape queries (evaluated on the host) ------------------------------------

@register("Shape", shape_only=True)
def shape(node, x):
    dims = list(x.shape)
    rank = len(dims)
    # start/end (opset 15) select a range of axes, clamped like Python slicing.
    start = min(max(_axis(node.attr("start", 0), rank), 0), rank)
    end = min(max(_axis(node.attr("end", rank), rank), 0), rank)
    return torch.tensor(dims[start:end], dtype=torch.int64)


@register("Size", shape_only=True)
def size(node, x):
    return torch.tensor(x.numel(), dtype=torch.int64)


# --- views and layout ---------------------------------------------------------

@register("Reshape", host_inputs=(1,))
def reshape(node, x, shape=None):
    target = _ints(shape if node.opset >= 5 else node.attr("shape"))
    if not node.attr("allowzero", 0):
        # 0 copies the input's dimension at that position (unless allowzero=1).
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return x.reshape(target)


@register("Flatten")
def flatten(node, x):
    axis = _axis(node.attr("axis", 1), x.dim())
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _squeeze_axes(node, axes):
    return _ints(axes) if node.opset >= 13 and axes is not None else node.attr("axes")


@register("Squeeze", host_inputs=(1,))
def squeeze(node, x, axes=None):
    axes = _squeeze_axes(node, axes)
    if axes is None:
        return x.squeeze()
    return x.squeeze(tuple(_axis(a, x.dim()) for a in axes)) if axes else x


@register("Unsqueeze", host_inputs=(1,))
def unsqueeze(node, x, axes=None):
    axes = _squeeze_axes(node, axes)
    rank = x.dim() + len(axes)
    # Axes index the output, so insert in ascending order.
    for a in sorted(_axis(a, rank) for a in axes):
        x = x.unsqueeze(a)
    return x


@register("Transpose")
def transpose(node, x):
    perm = node.attr("perm") or list(range(x.dim() - 1, -1, -1))
    return x.permute(perm)


@register("Identity")
def identity(node, x):
    return (x,)  # a 1-tuple: x may be a sequence (a list), which must not read as several outputs


# Random only in training mode (opset 12's input); inference models lose Dropout in remove_noops.
@register("Dropout", host_inputs=(1, 2), nondeterministic=True, since=7)
def dropout(node, x, ratio=None, training_mode=None):
    rate = ratio.item() if ratio is not None else node.attr("ratio", 0.5)
    if training_mode is not None and bool(training_mode.item()) and rate > 0:
        mask = torch.rand(x.shape, device=x.device) >= rate
        return x * mask / (1 - rate), mask
    # Inference: the input passes through and the mask keeps everything.
    if len(node.outputs) < 2 or not node.outputs[1]:
        return x
    mask_type = torch.bool if node.opset >= 10 else x.dtype
    return x, torch.ones(x.shape, dtype=mask_type, device=x.device)


# --- broadcasting and repetition ------------------------------------------------

@register("Expand", host_inputs=(1,), since=8)
def expand(node, x, shape):
    # Bidirectional broadcast: a 1 in `shape` keeps x's dimension.
    return x.expand(torch.broadcast_shapes(x.shape, tuple(_ints(shape))))


@register("Tile", host_inputs=(1,), since=6)
def tile(node, x, repeats):
    return x.repeat(_ints(repeats))


# --- joining and splitting ------------------------------------------------------

@register("Concat")
def concat(node, *xs):
    return torch.cat(xs, dim=_axis(node.attr("axis", 1), xs[0].dim()))


@register("Split", host_inputs=(1,))
def split(node, x, sizes=None):
    axis = _axis(node.attr("axis", 0), x.dim())
    dim = x.shape[axis]
    if sizes is not None:
        parts = _ints(sizes)
    elif node.attr("split") is not None:
        parts = node.attr("split")
    else:
        n = node.attr("num_outputs", len(node.outputs))
        # Opset 18 allows an uneven split: equal chunks, the last one smaller.
        chunk = -(-dim // n)
        parts = [min(chunk, dim - i * chunk) for i in range(n)]
    return tuple(torch.split(x, parts, dim=axis))


def _slice_bounds(start: int, end: int, step: int, dim: int) -> range:
    """The indices ONNX's Slice selects on one axis (its clamping differs from Python's)."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return range(start, end, step)


@register("Slice", host_inputs=(1, 2, 3, 4))
def slice_(node, x, starts=None, ends=None, axes=None, steps=None):
    if node.opset < 10:
        starts, ends, axes = node.attr("starts"), node.attr("ends"), node.attr("axes")
    starts, ends = _ints(starts), _ints(ends)
    axes = _ints(axes) if axes is not None else list(range(len(starts)))
    steps = _ints(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    flips = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _axis(axis, x.dim())
        r = _slice_bounds(start, end, step, x.shape[axis])
        if step > 0:
            index[axis] = slice(r.start, max(r.stop, r.start), step)
        elif len(r) == 0:
            index[axis] = slice(0, 0)
        else:
            # torch has no negative steps: take the same elements forwards, then flip.
            index[axis] = slice(r[-1], r[0] + 1, -step)
            flips.append(axis)
    y = x[tuple(index)]
    return y.flip(flips) if flips else y


def _pad_index(n: int, before: int, after: int, mode: str, device) -> torch.Tensor:
    """Source positions along one axis for reflect/edge/wrap padding."""
    i = torch.arange(-before, n + after, device=device)
    if mode == "edge":
        return i.clamp(0, n - 1)
    if mode == "wrap":
        return i.remainder(n)
    period = 2 * (n - 1)  # reflect (without repeating the edge), repeated for wide pads
    if period == 0:
        return torch.zeros_like(i)
    m = i.abs().remainder(period)
    return torch.where(m >= n, period - m, m)


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


def _check_pad(node):
    mode = node.attr("mode", "constant")
    if mode not in _PAD_MODES:
        return f"Pad mode '{mode}' is not supported (Kiln supports {', '.join(_PAD_MODES)})"
    return None


@register("Pad", host_inputs=(1, 2, 3), check=_check_pad)
def pad(node, x, pads=None, value=None, axes=None):
    if node.opset < 11:
        pads, value = node.attr("pads", node.attr("paddings")), node.attr("value", 0.0)
    pads = _ints(pads)
    value = 0 if value is None else (value.item() if isinstance(value, torch.Tensor) else value)
    rank = x.dim()
    axes = [_axis(a, rank) for a in _ints(axes)] if axes is not None else list(range(rank))
    widths = {a: (pads[i], pads[i + len(axes)]) for i, a in enumerate(axes)}
    # Negative pads crop.
    crop = [slice(None)] * rank
    for a, (before, after) in widths.items():
        crop[a] = slice(max(-before, 0), x.shape[a] - max(-after, 0))
    x = x[tuple(crop)]
    widths = {a: (max(b, 0), max(e, 0)) for a, (b, e) in widths.items()}
    mode = node.attr("mode", "constant")
    if mode == "constant":
        shape, inner = [], []
        for a in range(rank):
            before, after = widths.get(a, (0, 0))
            shape.append(before + x.shape[a] + after)
            inner.append(slice(before, before + x.shape[a]))
        # channels-last in, channels-last out (a convolution's input, e.g. int8 codes padded with their zero point)
        nhwc = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt).fill_(value)
        out[tuple(inner)] = x
        return out
    for a, (before, after) in widths.items():
        if before or after:
            x = x.index_select(a, _pad_index(x.shape[a], before, after, mode, x.device))
    return x


# --- constants and generators ----------------------------------------------------

_CONSTANT_ATTRS = ("value", "value_float", "value_floats", "value_int", "value_ints")


def _check_constant(node):
    if not any(k in node.attrs for k in _CONSTANT_ATTRS):
        return f"Constant carries {sorted(node.attrs) or 'no value'}; Kiln supports numeric {'/'.join(_CONSTANT_ATTRS)}"
    return None


def constant_value(node) -> torch.Tensor:
    """The tensor a Constant node holds, whichever attribute carries it."""
    a = node.attrs
    if "value" in a:
        return a["value"]
    if "value_float" in a:
        return torch.tensor(a["value_float"], dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(a["value_floats"], dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(a["value_int"], dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(a["value_ints"], dtype=torch.int64)
    raise UnsupportedError(
        f"Constant node '{node.label}' carries {sorted(a) or 'no value'}; Kiln supports numeric "
        "value/value_float(s)/value_int(s) constants."
    )


@register("Constant", check=_check_constant)
def constant(node):
    # Top-level Constants become weights during folding (passes/fold_constants.py); this runs the ones in subgraphs.
    return constant_value(node).to(node.device)


@register("ConstantOfShape", host_inputs=(0,), since=9)
def constant_of_shape(node, shape):
    value = node.attr("value")
    if value is None:
        value = torch.zeros(1, dtype=torch.float32)
    return value.to(node.device).reshape(()).expand(_ints(shape)).clone(memory_format=torch.contiguous_format)


@register("Range", host_inputs=(0, 1, 2), since=11)
def range_(node, start, limit, delta):
    s, lim, d = start.item(), limit.item(), delta.item()
    # ceil((limit - start) / delta), exactly for integers.
    n = max(math.ceil((lim - s) / d) if start.is_floating_point() else -((s - lim) // d), 0)
    # start + i * delta in the input's type, as ONNX defines it.
    steps = torch.arange(n, device=node.device, dtype=torch.int64).to(start.dtype)
    return start.to(node.device) + steps * delta.to(node.device)


@register("EyeLike", since=9)
def eye_like(node, x):
    dtype = dtypes.onnx_to_torch(node.attr("dtype")) if node.attr("dtype") is not None else x.dtype
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    cols = torch.arange(x.shape[1], device=x.device)[None, :]
    return (cols - rows == node.attr("k", 0)).to(dtype)


@register("Trilu", host_inputs=(1,), since=14)
def trilu(node, x, k=None):
    k = int(k.item()) if k is not None else 0
    rows = torch.arange(x.shape[-2], device=x.device)[:, None]
    cols = torch.arange(x.shape[-1], device=x.device)[None, :]
    keep = cols - rows >= k if node.attr("upper", 1) else cols - rows <= k
    # A mask rather than torch.triu/tril, which lack unsigned types (so does where: signed view).
    data = signed_view(x)
    return torch.where(keep, data, torch.zeros((), dtype=data.dtype, device=x.device)).view(x.dtype)
