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
    return torch.float32 if x.element_size() <= 2 else torch.float64


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
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


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
        y = y.masked_fill(outside.reshape(shape), node.attr("extrapolation_value", 0.0))
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
    if nm not in _NEAREST_MODES:
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


# ----------------------------------------------------------------------------- GridSample / AffineGrid

_GRID_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic", "nearest": "nearest"}


def _reflect(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Fold coordinates outside [lo, hi] back in by repeated reflection at the borders."""
    span = hi - lo
    if span <= 0:
        return torch.full_like(x, lo)
    below, above = x < lo, x > hi
    dx = torch.where(below, lo - x, torch.where(above, x - hi, torch.zeros_like(x)))
    n = torch.trunc(dx / span)
    r = dx - n * span
    even = torch.remainder(n, 2) == 0
    from_lo, from_hi = lo + r, hi - r
    return torch.where(below, torch.where(even, from_lo, from_hi),
                       torch.where(above, torch.where(even, from_hi, from_lo), x))


def _grid_taps(coord: torch.Tensor, mode: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(integer position, weight) pairs that interpolate along one axis."""
    if mode == "nearest":
        return [(coord, torch.ones_like(coord))]
    base = torch.floor(coord)
    t = coord - base
    if mode == "linear":
        return [(base, 1 - t), (base + 1, t)]
    return [(base + k, _cubic_kernel(t - k, -0.75)) for k in (-1, 0, 1, 2)]


def _grid_sample_check(node) -> str | None:
    mode, padding = node.attr("mode", "bilinear"), node.attr("padding_mode", "zeros")
    if mode not in _GRID_MODES:
        return f"GridSample mode '{mode}' is not supported"
    if padding not in ("zeros", "border", "reflection"):
        return f"GridSample padding_mode '{padding}' is not supported"
    return None


@register("GridSample", check=_grid_sample_check, since=16)
def grid_sample(node, x, grid):
    mode = _GRID_MODES[node.attr("mode", "bilinear")]
    padding = node.attr("padding_mode", "zeros")
    align = bool(node.attr("align_corners", 0))
    n, c, *dims = x.shape
    out_spatial = grid.shape[1:-1]
    acc_dtype = torch.promote_types(x.dtype if x.dtype in _FLOAT_TYPES else torch.float32, torch.float32)
    coord_dtype = torch.float64 if torch.float64 in (x.dtype, grid.dtype) else torch.float32
    g = grid.to(coord_dtype).reshape(n, -1, len(dims))

    per_axis = []  # per input axis: list of (flat offset, weight) taps
    for i, d in enumerate(dims):
        stride = math.prod(dims[i + 1:])
        v = g[..., len(dims) - 1 - i]  # grid's last axis lists coordinates innermost-first (x, y, z)
        v = (v + 1) / 2 * (d - 1) if align else ((v + 1) * d - 1) / 2
        lo, hi = (0.0, d - 1.0) if align else (-0.5, d - 0.5)
        if mode == "nearest":
            v = torch.round(v)  # half to even, as PyTorch and ONNX's reference do, before padding
        outside = (v < lo) | (v > hi)
        if padding == "border":
            v = torch.where(outside, v.clamp(0, d - 1), v)
        elif padding == "reflection":
            v = torch.where(outside, _reflect(v, lo, hi), v)
        taps = []
        for pos, w in _grid_taps(v, mode):
            if padding == "zeros":
                w = torch.where((pos < 0) | (pos > d - 1), torch.zeros_like(w), w)
            elif padding == "reflection":
                pos = torch.trunc(_reflect(pos, lo, hi))
            pos = pos.clamp(0, d - 1).long()
            taps.append((pos * stride, w))
        per_axis.append(taps)

    flat = x.reshape(n, c, -1)
    out = torch.zeros(n, c, g.shape[1], dtype=acc_dtype, device=x.device)
    for combo in itertools.product(*per_axis):
        idx = sum(p for p, _ in combo)
        w = math.prod(w for _, w in combo)
        vals = flat.gather(2, idx.unsqueeze(1).expand(n, c, -1))
        out += w.unsqueeze(1).to(acc_dtype) * vals.to(acc_dtype)
    return _back_to(out, x.dtype).reshape(n, c, *out_spatial)


@register("AffineGrid", host_inputs=(1,), since=20)
def affine_grid(node, theta, size):
    return F.affine_grid(theta, size.tolist(), align_corners=bool(node.attr("align_corners", 0)))


# ----------------------------------------------------------------------------- DepthToSpace / SpaceToDepth

def _block_mode_check(node) -> str | None:
    mode = node.attr("mode", "DCR")
    return None if mode in ("DCR", "CRD") else f"{node.op_type} mode '{mode}' is not supported (DCR, CRD)"


@register("DepthToSpace", check=_block_mode_check)
def depth_to_space(node, x):
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (b * b), h * b, w * b)


@register("SpaceToDepth", check=_block_mode_check)
def space_to_depth(node, x):
    b = node.attr("blocksize")
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b)
    y = y.permute(0, 3, 5, 1, 2, 4) if node.attr("mode", "DCR") == "DCR" else y.permute(0, 1, 3, 5, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


# ----------------------------------------------------------------------------- Col2Im / CenterCropPad

@register("Col2Im", host_inputs=(1, 2), since=18)
def col2im(node, x, image_shape, block_shape):
    image = image_shape.tolist()
    kernel = block_shape.tolist()
    nd = len(image)
    dil = node.attr("dilations") or [1] * nd
    strides = node.attr("strides") or [1] * nd
    pads = node.attr("pads") or [0] * (2 * nd)
    blocks = [(image[i] + pads[i] + pads[nd + i] - dil[i] * (kernel[i] - 1) - 1) // strides[i] + 1
              for i in range(nd)]
    dev = x.device
    # Output position of every (kernel offset, block) column entry, built up axis by axis (row-major).
    flat = torch.zeros(1, 1, dtype=torch.long, device=dev)
    valid = torch.ones(1, 1, dtype=torch.bool, device=dev)
    for i in range(nd):
        k = torch.arange(kernel[i], device=dev)[:, None]
        b = torch.arange(blocks[i], device=dev)[None, :]
        pos = b * strides[i] - pads[i] + k * dil[i]  # [k_i, b_i]
        ok = (pos >= 0) & (pos < image[i])
        flat = (flat[:, None, :, None] * image[i] + pos[None, :, None, :]).reshape(flat.shape[0] * kernel[i], -1)
        valid = (valid[:, None, :, None] & ok[None, :, None, :]).reshape(flat.shape)
    total = math.prod(image)
    index = torch.where(valid, flat, total).reshape(-1)  # padding lands in a spare slot, dropped below
    n = x.shape[0]
    c = x.shape[1] // math.prod(kernel)
    src = x.reshape(n, c, -1)
    out = torch.zeros(n, c, total + 1, dtype=x.dtype, device=dev).index_add_(2, index, src)
    return out[..., :total].reshape(n, c, *image)


@register("CenterCropPad", host_inputs=(1,), since=18)
def center_crop_pad(node, x, shape):
    target = shape.tolist()
    axes = node.attr("axes") or list(range(x.dim()))
    out_shape = list(x.shape)
    src = [slice(None)] * x.dim()
    dst = [slice(None)] * x.dim()
    for a, size in zip(axes, target):
        a %= x.dim()
        dim = x.shape[a]
        out_shape[a] = size
        if size < dim:  # crop: the extra element of an odd difference comes off the end
            start = (dim - size) // 2
            src[a] = slice(start, start + size)
        elif size > dim:
            start = (size - dim) // 2
            dst[a] = slice(start, start + dim)
    out = x.new_zeros(out_shape)
    out[tuple(dst)] = x[tuple(src)]
    return out


# ----------------------------------------------------------------------------- RoiAlign / MaxRoiPool

def _roi_samples(start, bin_size, grid, n_bins: int, n_grid: int, size: int):
    """Sample positions of RoiAlign along one axis, with their bilinear taps.

    start/bin_size/grid: [R] per ROI. Returns per [R, n_bins, n_grid]: low and high
    tap index, their weights, and whether the sample is in the ROI's grid and on the map.
    """
    dt = start.dtype
    b = torch.arange(n_bins, dtype=dt, device=start.device)[None, :, None]
    i = torch.arange(n_grid, dtype=dt, device=start.device)[None, None, :]
    bs, g = bin_size[:, None, None], grid[:, None, None]
    pos = start[:, None, None] + b * bs + (i + 0.5) * bs / g.clamp(min=1).to(dt)
    use = (i < g) & (pos >= -1.0) & (pos <= size)
    pos = pos.clamp(min=0)
    low = torch.floor(pos).clamp(max=size - 1)
    pos = torch.where(low >= size - 1, low, pos)  # samples past the last row use it alone
    high = torch.where(low >= size - 1, low, low + 1)
    frac = pos - low
    return low.long(), high.long(), 1 - frac, frac, use


def _roi_align_check(node) -> str | None:
    mode = node.attr("mode", "avg")
    if mode not in ("avg", "max"):
        return f"RoiAlign mode '{mode}' is not supported (avg, max)"
    ctm = node.attr("coordinate_transformation_mode", "half_pixel")
    if ctm not in ("half_pixel", "output_half_pixel"):
        return f"RoiAlign coordinate_transformation_mode '{ctm}' is not supported"
    return None


# The number of samples per bin follows the ROI sizes (sampling_ratio=0) and is read on the host.
@register("RoiAlign", data_dependent=True, check=_roi_align_check, since=10)
def roi_align(node, x, rois, batch_indices):
    oh, ow = node.attr("output_height", 1), node.attr("output_width", 1)
    ratio = node.attr("sampling_ratio", 0)
    half_pixel = node.attr("coordinate_transformation_mode",
                           "half_pixel" if node.opset >= 16 else "output_half_pixel") == "half_pixel"
    n, c, h, w = x.shape
    r = rois.shape[0]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    box = rois.to(dt) * node.attr("spatial_scale", 1.0) - (0.5 if half_pixel else 0.0)
    x0, y0, x1, y1 = box.unbind(1)
    roi_w, roi_h = x1 - x0, y1 - y0
    if not half_pixel:  # the legacy mode forces malformed ROIs to 1x1
        roi_w, roi_h = roi_w.clamp(min=1), roi_h.clamp(min=1)
    bin_h, bin_w = roi_h / oh, roi_w / ow
    if ratio > 0:
        gh = gw = torch.full((r,), ratio, dtype=torch.long, device=x.device)
        n_gh = n_gw = ratio
    else:  # adaptive: ceil(bin size) samples per bin, so the sample count depends on the ROI values
        gh, gw = torch.ceil(bin_h).clamp(min=0).long(), torch.ceil(bin_w).clamp(min=0).long()
        n_gh = max(int(gh.max()), 1) if r else 1
        n_gw = max(int(gw.max()), 1) if r else 1
    ylo, yhi, wyl, wyh, yuse = _roi_samples(y0, bin_h, gh, oh, n_gh, h)
    xlo, xhi, wxl, wxh, xuse = _roi_samples(x0, bin_w, gw, ow, n_gw, w)

    def grid(t_y, t_x):  # [R, oh, gh] x [R, ow, gw] -> [R, oh, gh, ow, gw]
        return t_y[:, :, :, None, None], t_x[:, None, None, :, :]

    ys, xs = grid(yuse, xuse)
    on_map = ys & xs
    table = x.permute(0, 2, 3, 1).reshape(n * h * w, c)  # one row of channels per pixel
    # Clamped: an out-of-range index must not fault a device gather.
    base = batch_indices.long().clamp(0, n - 1).reshape(r, 1, 1, 1, 1) * (h * w)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    taps = []
    for ty, wy in ((ylo, wyl), (yhi, wyh)):
        for tx, wx in ((xlo, wxl), (xhi, wxh)):
            iy, ix = grid(ty, tx)
            my, mx = grid(wy, wx)
            weight = torch.where(on_map, my * mx, torch.zeros((), dtype=dt, device=x.device))
            vals = table[(base + iy * w + ix).reshape(-1)].reshape(*weight.shape, c)
            taps.append(weight.unsqueeze(-1).to(acc_dtype) * vals.to(acc_dtype))
    if node.attr("mode", "avg") == "avg":
        count = (gh * gw).clamp(min=1).to(acc_dtype).reshape(r, 1, 1, 1)
        out = sum(taps).sum(dim=(2, 4)) / count
    else:
        # ONNX's max mode takes, per sample, the largest weighted tap (not the interpolated value).
        # Off-map samples count as 0; the padding beyond a ROI's own grid does not count.
        in_grid = (torch.arange(n_gh, device=x.device).reshape(1, 1, -1, 1, 1) < gh.reshape(r, 1, 1, 1, 1)) & (
            torch.arange(n_gw, device=x.device).reshape(1, 1, 1, 1, -1) < gw.reshape(r, 1, 1, 1, 1))
        best = torch.stack(taps).amax(0).masked_fill(~in_grid.unsqueeze(-1), float("-inf"))
        out = best.amax(dim=(2, 4))
        out = out.masked_fill(out == float("-inf"), 0)  # ROIs with no samples
    return out.permute(0, 3, 1, 2).to(x.dtype)


def _range_max_table(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sparse table along `dim`: level k holds the max of the 2**k elements starting at each index."""
    size = t.shape[dim]
    levels = [t]
    while (2 << (len(levels) - 1)) <= size:
        prev, half = levels[-1], 1 << (len(levels) - 1)
        # Entries whose window would run past the end are never queried; any value will do there.
        ahead = torch.cat([prev.narrow(dim, half, size - half), prev.narrow(dim, size - half, half)], dim)
        levels.append(torch.maximum(prev, ahead))
    return torch.stack(levels)


def _level(length: torch.Tensor, levels: int) -> torch.Tensor:
    """floor(log2(length)) for lengths >= 1, below `levels`."""
    return sum(((length >= (1 << k)).long() for k in range(1, levels)), torch.zeros_like(length))


@register("MaxRoiPool")
def max_roi_pool(node, x, rois):
    ph, pw = node.attr("pooled_shape")
    scale = node.attr("spatial_scale", 1.0)
    n, c, h, w = x.shape
    r = rois.shape[0]
    f = rois.float()

    def round_half_away(v):  # C's round(), which Caffe/onnxruntime use for ROI corners
        return torch.sign(v) * torch.floor(v.abs() + 0.5)

    batch = f[:, 0].long().clamp(0, n - 1)  # an out-of-range index must not fault a device gather
    x0, y0, x1, y1 = (round_half_away(f[:, k] * scale) for k in range(1, 5))

    def bins(start, end, count, size):
        bin_size = (end - start + 1).clamp(min=1) / count
        i = torch.arange(count, dtype=torch.float32, device=x.device)
        lo = torch.floor(i * bin_size[:, None]) + start[:, None]
        hi = torch.ceil((i + 1) * bin_size[:, None]) + start[:, None]
        return lo.clamp(0, size).long(), hi.clamp(0, size).long()

    hs, he = bins(y0, y1, ph, h)  # [R, ph]
    ws, we = bins(x0, x1, pw, w)  # [R, pw]
    # A 2-D sparse table answers every bin's max with four lookups, whatever the bin sizes.
    table = _range_max_table(_range_max_table(x.permute(0, 2, 3, 1), 1), 3)  # [Lw, Lh, N, H, W, C]
    lw, lh = table.shape[:2]
    rows = table.reshape(-1, c)
    len_h, len_w = (he - hs).clamp(min=1), (we - ws).clamp(min=1)
    kh, kw = _level(len_h, lh), _level(len_w, lw)
    top = [hs, (he - (1 << kh)).clamp(min=0)]
    left = [ws, (we - (1 << kw)).clamp(min=0)]
    plane = ((kw[:, None, :] * lh + kh[:, :, None]) * n + batch[:, None, None]) * (h * w)  # [R, ph, pw]
    out = None
    for t in top:
        for l in left:
            idx = plane + (t[:, :, None] * w + l[:, None, :]).clamp(max=h * w - 1)
            v = rows[idx.reshape(-1)].reshape(r, ph, pw, c)
            out = v if out is None else torch.maximum(out, v)
    empty = ((he <= hs)[:, :, None] | (we <= ws)[:, None, :]).unsqueeze(-1)
    out = out.masked_fill(empty, 0)
    return out.permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------- NonMaxSuppression

def _box_corners(boxes: torch.Tensor, center_point_box: int):
    """(x_min, y_min, x_max, y_max) per box; corner boxes may list either corner first."""
    if center_point_box:
        cx, cy, bw, bh = boxes.unbind(-1)
        return cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2
    y_a, x_a, y_b, x_b = boxes.unbind(-1)
    return torch.minimum(x_a, x_b), torch.minimum(y_a, y_b), torch.maximum(x_a, x_b), torch.maximum(y_a, y_b)


# The selection loop asks the device whether any class still has a candidate once every this many picks: one
# host sync per check, and at most this many extra (empty) picks after the last class is done.
_NMS_CHECK_EVERY = 8


def _suppressed(planes: torch.Tensor, picked: torch.Tensor, iou_thr: float) -> torch.Tensor:
    """[R, N]: the box picked in row r suppresses box j of row r (IoU > threshold). planes [5, R, N]: x0, y0, x1,
    y1 and area of every box; picked [R, 1] positions. As in ONNX's reference, pairs that do not overlap and
    empty boxes never suppress: an overlap's width and area both positive is that whole test (an empty box's
    zero width or height bounds the overlap's, a zero area from underflow bounds its area, and rounding is
    monotone), and between two nonempty boxes the union is positive."""
    x0, y0, x1, y1, area = planes
    px0, py0, px1, py1, pa = planes.gather(2, picked.view(1, -1, 1).expand(5, -1, 1))  # each [R, 1]
    iw = torch.minimum(x1, px1).sub_(torch.maximum(x0, px0))
    ih = torch.minimum(y1, py1).sub_(torch.maximum(y0, py0))
    inter = iw * ih
    valid = (iw > 0) & (inter > 0)
    return valid & (inter / (area + pa).sub_(inter) > iou_thr)


def _greedy_select(planes: torch.Tensor, alive: torch.Tensor, limit: int, iou_thr: float) -> torch.Tensor:
    """ONNX's greedy selection for every (batch, class) row at once, boxes in score order: each step picks, in
    every row, the first box still alive (no earlier pick suppressed it) and suppresses the boxes it overlaps.
    Returns [R, steps] picked positions, -1 once a row has no box left; a row's picks come first, in order.
    The loop runs at most `limit` steps (max_output_boxes_per_class) and stops when no row has a box left, so
    its length is the most boxes any class keeps, not the number of boxes. A step is about twenty small
    kernels and no host sync (an eager postprocess spends its time launching them)."""
    firsts, found = [], []
    alive = alive.to(torch.uint8)  # argmax reads it as it is
    every = 1 if alive.device.type == "cpu" else _NMS_CHECK_EVERY  # a CPU tensor's check costs no sync
    for step in range(limit):
        if step % every == 0 and step and not bool(alive.any()):
            break
        first = alive.argmax(1, keepdim=True)  # the first alive position (0 where none is)
        firsts.append(first)
        found.append(alive.gather(1, first))
        alive.masked_fill_(_suppressed(planes, first, iou_thr), 0)
        alive.scatter_(1, first, 0)
    if not firsts:
        return torch.full((alive.shape[0], 0), -1, dtype=torch.long, device=alive.device)
    return torch.where(torch.cat(found, 1).bool(), torch.cat(firsts, 1), -1)


@register("NonMaxSuppression", host_inputs=(2, 3, 4), data_dependent=True, since=10,
          keep_fp32="IoU thresholds and score ordering need FP32 box coordinates and scores")
def non_max_suppression(node, boxes, scores, max_output=None, iou_threshold=None, score_threshold=None):
    """Every batch and class at once on the boxes' device: one stable sort of the scores, then at most
    max_output_boxes_per_class vectorized selection steps (_greedy_select), and one host sync for the
    data-dependent output size."""
    dev = boxes.device
    none = torch.zeros(0, 3, dtype=torch.long, device=dev)
    n_batch, n_class, n_box = scores.shape
    limit = min(max(int((_scalars(max_output) or [0])[0]), 0), n_box)  # omitted: 0, i.e. select nothing
    if limit == 0 or n_batch * n_class == 0:
        return none
    if boxes.dtype in (torch.float16, torch.bfloat16):  # an upstream low-precision layer may hand these over
        boxes, scores = boxes.float(), scores.float()
    # Thresholds compare in the boxes' own type, as ONNX's reference does (it matters at the boundary): a Python
    # number beside a tensor is taken in the tensor's type, and costs no copy to the device.
    iou_thr = float((_scalars(iou_threshold) or [0.0])[0])
    score_thr = _scalars(score_threshold)
    x0, y0, x1, y1 = _box_corners(boxes, node.attr("center_point_box", 0))
    planes = torch.stack([x0, y0, x1, y1, (x1 - x0) * (y1 - y0)])  # [5, B, N]
    rows = scores.reshape(n_batch * n_class, n_box)
    order = torch.sort(rows, dim=1, descending=True, stable=True).indices  # ties: lower index first
    batch_of = torch.arange(n_batch, device=dev).repeat_interleave(n_class)  # [R]
    planes = planes[:, batch_of[:, None], order]  # [5, R, N], each row in its class's score order
    if score_thr is None:
        alive = torch.ones_like(order, dtype=torch.bool)
    else:
        alive = rows.gather(1, order) > float(score_thr[0])
    picks = _greedy_select(planes, alive, limit, iou_thr)  # [R, steps]
    kept = picks >= 0
    box = order.gather(1, picks.clamp(min=0))
    row = torch.arange(n_batch * n_class, device=dev)[:, None].expand_as(picks)
    out = torch.stack([row // n_class, row % n_class, box], -1)[kept]  # row-major: batch, class, score order
    return out if out.numel() else none
