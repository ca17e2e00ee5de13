"""Image and detection ops: Resize/Upsample, GridSample/AffineGrid, RoiAlign/MaxRoiPool,
DepthToSpace/SpaceToDepth, Col2Im, CenterCropPad and NonMaxSuppression.

Resampling is written as explicit per-axis sampling weights (Resize) or tap
gathers (GridSample, RoiAlign) rather than mapped onto F.interpolate /
F.grid_sample: ONNX's coordinate, rounding and padding rules differ from
PyTorch's at the edges, and one general formulation covers every mode.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from .registry import register

_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _scalars(t: torch.Tensor | None) -> list | None:
    """A host input as a Python list; None when omitted or empty (Resize-11 passes '' or [])."""
    if t is None or t.numel() == 0:
        return None
    return t.reshape(-1).tolist()


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """Float type to interpolate `x` in: its own for floats; wide enough for integers."""
    if x.dtype in _FLOAT_TYPES:
        return x.dtype
    return torch.float32 if x.element_size() <= 2 and x.dtype != torch.uint16 else torch.float64


def _back_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast an interpolated result back, rounding and saturating integer types as ONNX does."""
    if dtype in _FLOAT_TYPES or dtype == y.dtype:
        return y.to(dtype)
    if dtype == torch.bool:
        return y != 0
    info = torch.iinfo(dtype)
    return y.round().clamp(info.min, info.max).to(dtype)


# ----------------------------------------------------------------------------- Resize

_CTMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
         "tf_crop_and_resize")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple")


def _source_coords(ctm: str, n_in: int, n_out: int, scale: float, length: float,
                   roi: tuple[float, float] | None, device) -> torch.Tensor:
    """Input coordinate (float64) each output index samples, per coordinate_transformation_mode.

    `length` is the resized extent before flooring (in * scale): ONNX maps coordinates
    through it, not through the integer output size.
    """
    y = torch.arange(n_out, dtype=torch.float64, device=device)
    if ctm == "align_corners":
        return y * ((n_in - 1) / (length - 1)) if length != 1 else torch.zeros_like(y)
    if ctm == "asymmetric":
        return y / scale
    if ctm == "pytorch_half_pixel":
        return (y + 0.5) / scale - 0.5 if length > 1 else torch.zeros_like(y)
    if ctm == "half_pixel_symmetric":
        # Centers the fractional scaled extent on the integer output canvas.
        offset = n_in / 2 * (1 - n_out / length)
        return offset + (y + 0.5) / scale - 0.5
    if ctm == "tf_crop_and_resize":
        start, end = roi
        if length <= 1:
            return torch.full_like(y, (start + end) / 2 * (n_in - 1))
        return y * ((end - start) * (n_in - 1) / (length - 1)) + start * (n_in - 1)
    return (y + 0.5) / scale - 0.5  # half_pixel


def _round_nearest(x: torch.Tensor, nearest_mode: str, scale: float) -> torch.Tensor:
    if nearest_mode == "round_prefer_ceil":
        return torch.floor(x + 0.5)
    if nearest_mode == "floor":
        return torch.floor(x)
    if nearest_mode == "ceil":
        return torch.ceil(x)
    if nearest_mode == "simple":  # Upsample and Resize-10 predate nearest_mode (onnxruntime's legacy rule)
        return torch.ceil(x) if scale < 1 else torch.trunc(x)
    return torch.ceil(x - 0.5)  # round_prefer_floor: halves go down


def _cubic_kernel(d: torch.Tensor, a: float) -> torch.Tensor:
    d = d.abs()
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return torch.where(d <= 1, near, torch.where(d < 2, far, torch.zeros_like(d)))


def _interp_weights(x: torch.Tensor, n_in: int, node, mode: str, scale: float) -> torch.Tensor:
    """[n_out, n_in] matrix of linear/cubic sampling weights for source coordinates x."""
    a = node.attr("cubic_coeff_a", -0.75)
    radius = 1 if mode == "linear" else 2
    # Antialiasing stretches the kernel by 1/scale when downsampling, so more taps contribute.
    antialias = bool(node.attr("antialias", 0))
    s = min(scale, 1.0) if antialias else 1.0
    first = math.floor(-radius / s) + 1
    offsets = torch.arange(first, 2 - first, dtype=torch.float64, device=x.device)
    taps = torch.floor(x)[:, None] + offsets  # [n_out, taps]
    d = (taps - x[:, None]) * s
    w = (1 - d.abs()).clamp(min=0) if mode == "linear" else _cubic_kernel(d, a)
    if antialias:
        w = w / w.sum(1, keepdim=True)
    if node.attr("exclude_outside", 0):
        w = torch.where((taps < 0) | (taps > n_in - 1), torch.zeros_like(w), w)
        total = w.sum(1, keepdim=True)
        w = w / torch.where(total == 0, torch.ones_like(total), total)
    # Taps past the edges repeat the edge sample (edge padding), so their weight lands there.
    idx = taps.clamp(0, n_in - 1).long()
    return torch.zeros(x.shape[0], n_in, dtype=torch.float64, device=x.device).scatter_add_(1, idx, w)


def _resize_axis(x: torch.Tensor, axis: int, n_out: int, scale: float, length: float, roi, node,
                 mode: str, ctm: str, nearest_mode: str) -> torch.Tensor:
    n_in = x.shape[axis]
    coords = _source_coords(ctm, n_in, n_out, scale, length, roi, x.device)
    if mode == "nearest":
        idx = _round_nearest(coords, nearest_mode, scale).clamp(0, n_in - 1).long()
        y = x.index_select(axis, idx)
    else:
        w = _interp_weights(coords, n_in, node, mode, scale).to(x.dtype)
        y = torch.matmul(x.movedim(axis, -1), w.t()).movedim(-1, axis)
    if ctm == "tf_crop_and_resize":
        outside = (coords < 0) | (coords > n_in - 1)
        shape = [1] * x.dim()
        shape[axis] = n_out
        fill = torch.tensor(node.attr("extrapolation_value", 0.0), dtype=y.dtype, device=y.device)
        y = torch.where(outside.reshape(shape), fill, y)
    return y


def _resize(node, x: torch.Tensor, roi, scales, sizes, *, mode: str, ctm: str, nearest_mode: str,
            axes: list[int] | None = None) -> torch.Tensor:
    rank = x.dim()
    axes = [a % rank for a in axes] if axes else list(range(rank))
    in_shape = list(x.shape)
    out_shape = list(in_shape)
    full_scales = [1.0] * rank
    lengths = [float(n) for n in in_shape]  # resized extent per axis before flooring
    if sizes is not None:
        for a, n in zip(axes, sizes):
            out_shape[a] = int(n)
            lengths[a] = float(n)
            full_scales[a] = n / in_shape[a]
        policy = node.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            s = pick(full_scales[a] for a in axes)
            for a in axes:
                full_scales[a] = s
                lengths[a] = s * in_shape[a]
                out_shape[a] = int(lengths[a] + 0.5)  # round half up
    elif scales is not None:
        for a, s in zip(axes, scales):
            full_scales[a] = float(s)
            lengths[a] = s * in_shape[a]
            out_shape[a] = int(lengths[a])  # floor
    full_roi: list = [None] * rank
    if ctm == "tf_crop_and_resize" and roi is not None:
        k = len(axes)
        for i, a in enumerate(axes):
            full_roi[a] = (roi[i], roi[k + i])

    dtype = x.dtype
    y = x if mode == "nearest" else x.to(_work_dtype(x))
    for a in axes:
        trivial_roi = full_roi[a] is None or full_roi[a] == (0.0, 1.0)
        if out_shape[a] == in_shape[a] == lengths[a] and trivial_roi:
            continue
        if ctm == "tf_crop_and_resize" and full_roi[a] is None:
            full_roi[a] = (0.0, 1.0)
        y = _resize_axis(y, a, out_shape[a], full_scales[a], lengths[a], full_roi[a], node, mode, ctm,
                         nearest_mode)
    return y if mode == "nearest" else _back_to(y, dtype)


def _resize_check(node) -> str | None:
    mode = node.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        return f"{node.op_type} mode '{mode}' is not supported (nearest, linear, cubic)"
    if node.op_type == "Upsample":
        return None if mode != "cubic" else "Upsample has no cubic mode"
    if node.opset < 11:
        return None
    ctm = node.attr("coordinate_transformation_mode", "half_pixel")
    if ctm not in _CTMS:
        return f"Resize coordinate_transformation_mode '{ctm}' is not supported"
    nm = node.attr("nearest_mode", "round_prefer_floor")
    if nm not in _NEAREST_MODES[:4]:
        return f"Resize nearest_mode '{nm}' is not supported"
    policy = node.attr("keep_aspect_ratio_policy", "stretch")
    if policy not in ("stretch", "not_larger", "not_smaller"):
        return f"Resize keep_aspect_ratio_policy '{policy}' is not supported"
    return None


@register("Resize", host_inputs=(1, 2, 3), check=_resize_check, since=10)
def resize(node, x, roi=None, scales=None, sizes=None):
    mode = node.attr("mode", "nearest")
    if node.opset < 11:  # Resize-10: inputs (X, scales), Upsample's asymmetric mapping
        return _resize(node, x, None, _scalars(roi), None, mode=mode, ctm="asymmetric", nearest_mode="simple")
    return _resize(
        node, x, _scalars(roi), _scalars(scales), _scalars(sizes), mode=mode,
        ctm=node.attr("coordinate_transformation_mode", "half_pixel"),
        nearest_mode=node.attr("nearest_mode", "round_prefer_floor"),
        axes=node.attr("axes") if node.opset >= 18 else None,
    )


@register("Upsample", host_inputs=(1,), check=_resize_check, since=7)
def upsample(node, x, scales=None):
    scales = node.attr("scales") if node.opset < 9 else _scalars(scales)
    return _resize(node, x, None, scales, None, mode=node.attr("mode", "nearest"), ctm="asymmetric",
                   nearest_mode="simple")
