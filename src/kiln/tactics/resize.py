"""Resize / Upsample of a 4-D image over H and W in one pass, for the cases where that one pass computes exactly
what ONNX asks for:
  Resize, Upsample  torch_upsample_nearest  integer factors, nearest: each input pixel repeated s_h x s_w times,
                    as one copy into the output's memory format (a YOLO-style FPN's 2x upsample); every
                    coordinate rule and rounding mode but tf_crop_and_resize picks the same source pixels there
  Resize, Upsample  torch_interpolate_linear  linear with half_pixel (pytorch_half_pixel at outputs longer than
                    one) or align_corners coordinates: torch's bilinear kernel, whose edge rule is ONNX's edge
                    padding (MobileViT's resize of a 7x7 map to the patch grid and back)

The reference (ops/image.py) builds its sampling indices and weights on the device at every call and resamples
one axis at a time: a dozen small kernels and two passes a layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tactic

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _host_list(t):
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    return t.reshape(-1).tolist()


def _plan(node, args):
    """(oh, ow, scales (sh, sw) or None, ctm, mode) of a Resize/Upsample that resizes only H and W of a 4-D float
    input, with no ROI, axes or aspect-ratio policy; else None."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in _FLOATS or x.numel() == 0:
        return None
    mode = node.attr("mode", "nearest")
    if node.op_type == "Upsample" or node.opset < 11:
        ctm, nearest = "asymmetric", "floor"
        scales = node.attr("scales") if node.op_type == "Upsample" and node.opset < 9 else \
            _host_list(args[1] if len(args) > 1 else None)
        sizes = None
    else:
        if node.attr("antialias", 0) or node.attr("axes") is not None \
                or node.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
            return None
        ctm = node.attr("coordinate_transformation_mode", "half_pixel")
        nearest = node.attr("nearest_mode", "round_prefer_floor")
        scales = _host_list(args[2] if len(args) > 2 else None)
        sizes = _host_list(args[3] if len(args) > 3 else None)
    n, c, h, w = x.shape
    if sizes is not None:
        if len(sizes) != 4 or int(sizes[0]) != n or int(sizes[1]) != c:
            return None
        oh, ow, factors = int(sizes[2]), int(sizes[3]), None
    elif scales is not None:
        if len(scales) != 4 or scales[0] != 1.0 or scales[1] != 1.0 or min(scales[2:]) <= 0:
            return None
        oh, ow, factors = int(h * scales[2]), int(w * scales[3]), (float(scales[2]), float(scales[3]))
    else:
        return None
    if oh < 1 or ow < 1:
        return None
    return oh, ow, factors, ctm, mode, nearest


def _picks_input_over_s(ctm: str, nearest: str, s: int) -> bool:
    """Whether nearest sampling at integer factor s maps output i = k*s + r to input k (for every r < s)."""
    if s == 1:
        return ctm != "tf_crop_and_resize"  # every rule maps i to i itself
    if ctm == "asymmetric":  # i / s = k + r / s
        return nearest == "floor" or (nearest == "round_prefer_floor" and s == 2)
    if ctm in ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel"):
        # k + (r + 0.5) / s - 0.5 lies strictly within half a pixel of k: any rounding gives k
        return nearest in ("round_prefer_floor", "round_prefer_ceil")
    return False  # align_corners maps i to i * (n - 1) / (n * s - 1); tf_crop_and_resize through its ROI


def _nearest_factors(node, args):
    """(s_h, s_w) integer factors of a nearest Resize whose every output pixel is input pixel // s, else None."""
    plan = _plan(node, args)
    if plan is None:
        return None
    oh, ow, factors, ctm, mode, nearest = plan
    h, w = args[0].shape[2:]
    if mode != "nearest" or oh % h or ow % w:
        return None
    sh, sw = oh // h, ow // w
    if factors is not None and factors != (float(sh), float(sw)):
        return None
    if not (_picks_input_over_s(ctm, nearest, sh) and _picks_input_over_s(ctm, nearest, sw)):
        return None
    return sh, sw


def _nearest_ok(node, args) -> bool:
    return args[0].is_cuda and _nearest_factors(node, args) is not None


def torch_upsample_nearest(node, x, *rest):
    sh, sw = _nearest_factors(node, [x, *rest])
    n, c, h, w = x.shape
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        nhwc = x.permute(0, 2, 3, 1)
        y = nhwc[:, :, None, :, None, :].expand(n, h, sh, w, sw, c).reshape(n, h * sh, w * sw, c)
        return y.permute(0, 3, 1, 2)
    return x[:, :, :, None, :, None].expand(n, c, h, sh, w, sw).reshape(n, c, h * sh, w * sw)


def _linear_plan(node, args):
    """(size, scale_factor, align_corners) for F.interpolate, of a linear Resize it computes exactly, else None."""
    plan = _plan(node, args)
    if plan is None:
        return None
    oh, ow, factors, ctm, mode, _ = plan
    if mode != "linear":
        return None
    if ctm == "align_corners":
        return ((oh, ow), None, True)
    if ctm == "half_pixel" or (ctm == "pytorch_half_pixel" and oh > 1 and ow > 1):
        # ONNX maps through the given scale; torch through its scale_factor when given one, else in / out
        return (None, factors, False) if factors is not None else ((oh, ow), None, False)
    return None


def _linear_ok(node, args) -> bool:
    return args[0].is_cuda and _linear_plan(node, args) is not None


def torch_interpolate_linear(node, x, *rest):
    size, factors, corners = _linear_plan(node, [x, *rest])
    if size is not None:
        return F.interpolate(x, size=size, mode="bilinear", align_corners=corners)
    return F.interpolate(x, scale_factor=factors, mode="bilinear", align_corners=False, recompute_scale_factor=False)


for _op in ("Resize", "Upsample"):
    tactic(_op, "torch_upsample_nearest", _nearest_ok, domain="")(torch_upsample_nearest)
    tactic(_op, "torch_interpolate_linear", _linear_ok, domain="")(torch_interpolate_linear)
