"""Normalization layers.

Statistics are computed in FP32 even when a layer runs in FP16/BF16, as the
`stash_type` of LayerNormalization, RMSNormalization and GroupNormalization
asks by default: torch's fused layer_norm and instance_norm kernels already
accumulate in FP32, the other layers upcast explicitly. Only the statistics are wider, so none of
these ops needs to keep its whole layer in FP32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir import dtypes
from .registry import register

_LOW = (torch.float16, torch.bfloat16)


def _stash_type(node):
    return dtypes.onnx_to_torch(node.attr("stash_type", 1))


def _stash(node, x):
    """The dtype statistics are computed in: stash_type, or the input's if that is wider."""
    return torch.promote_types(_stash_type(node), x.dtype)


def _channel(t, x):
    """Per-channel (C,) parameter -> broadcastable against x of shape (N, C, ...)."""
    return t.reshape(1, -1, *[1] * (x.dim() - 2))


def _check_batch_norm(node):
    if node.opset < 9 and node.attr("spatial", 1) == 0:
        return "BatchNormalization with spatial=0 (per-element statistics) is not supported"
    if node.opset < 14 and len([o for o in node.outputs if o]) > 1:
        return "training-mode outputs of BatchNormalization before opset 14 are not supported"
    return None


@register("BatchNormalization", check=_check_batch_norm)
def batch_norm(node, x, scale, bias, mean, var):
    eps = node.attr("epsilon", 1e-5)
    scale, bias, mean, var = (t.to(x.dtype) for t in (scale, bias, mean, var))
    if not (node.opset >= 14 and node.attr("training_mode", 0)):
        return F.batch_norm(x, mean, var, scale, bias, training=False, eps=eps)
    # Training mode: normalize with the batch statistics and return updated running statistics.
    momentum = node.attr("momentum", 0.9)
    dims = [0, *range(2, x.dim())]
    batch_var, batch_mean = torch.var_mean(x, dim=dims, correction=0)
    y = F.batch_norm(x, batch_mean, batch_var, scale, bias, training=False, eps=eps)
    return y, mean * momentum + batch_mean * (1 - momentum), var * momentum + batch_var * (1 - momentum)


@register("InstanceNormalization")
def instance_norm(node, x, scale, bias):
    return F.instance_norm(x, weight=scale.to(x.dtype), bias=bias.to(x.dtype), eps=node.attr("epsilon", 1e-5))


def _norm_axes(node, x):
    axis = node.attr("axis", -1)
    return axis + x.dim() if axis < 0 else axis


@register("LayerNormalization", since=17)
def layer_norm(node, x, scale, bias=None):
    axis = _norm_axes(node, x)
    shape = x.shape[axis:]
    eps = node.attr("epsilon", 1e-5)
    scale = scale.expand(shape)
    bias = bias.expand(shape) if bias is not None else None
    stats = len(node.outputs) > 1 and any(node.outputs[1:])
    stash = _stash(node, x)
    if not stats and (stash == x.dtype or (x.dtype in _LOW and stash == torch.float32)):
        return F.layer_norm(x, shape, scale, bias, eps)
    y, mean, rstd = torch.native_layer_norm(x.to(stash), shape, scale.to(stash),
                                            bias.to(stash) if bias is not None else None, eps)
    # Mean and InvStdDev (of the stash type) keep the normalized axes as size 1.
    keep = tuple(x.shape[:axis]) + (1,) * (x.dim() - axis)
    u = _stash_type(node)
    return y.to(x.dtype), mean.reshape(keep).to(u), rstd.reshape(keep).to(u)


@register("RMSNormalization", since=23)
def rms_norm(node, x, scale):
    axis = _norm_axes(node, x)
    shape = x.shape[axis:]
    stash = _stash(node, x)
    y = F.rms_norm(x.to(stash), shape, eps=node.attr("epsilon", 1e-5)).to(x.dtype)
    return y * scale


def _check_group_norm(node):
    if node.attr("num_groups") is None:
        return "GroupNormalization needs the num_groups attribute"
    return None


@register("GroupNormalization", check=_check_group_norm, since=18)
def group_norm(node, x, scale, bias):
    groups = node.attr("num_groups")
    c = x.shape[1]
    if node.opset < 21:  # opset 18: one scale and bias per group
        scale, bias = scale.repeat_interleave(c // groups), bias.repeat_interleave(c // groups)
    stash = _stash(node, x)
    y = F.group_norm(x.to(stash), groups, eps=node.attr("epsilon", 1e-5)).to(x.dtype)
    return y * _channel(scale.to(x.dtype), x) + _channel(bias.to(x.dtype), x)


def _check_lp_norm(node):
    if node.attr("p", 2) not in (1, 2):
        return f"LpNormalization p={node.attr('p')} (ONNX allows only 1 and 2)"
    return None


@register("LpNormalization", check=_check_lp_norm)
def lp_norm(node, x):
    acc = x.float() if x.dtype in _LOW else x  # sums of squares overflow FP16
    norm = torch.linalg.vector_norm(acc, ord=node.attr("p", 2), dim=node.attr("axis", -1), keepdim=True)
    # ONNX's reference gives 0 for an all-zero slice instead of 0/0.
    return torch.where(norm == 0, 0.0, acc / norm).to(x.dtype)


@register("MeanVarianceNormalization", since=9)  # opset 1 had other attributes
def mean_variance_norm(node, x):
    axes = node.attr("axes", [0, 2, 3])
    acc = x.float() if x.dtype in _LOW else x
    var, mean = torch.var_mean(acc, dim=axes, correction=0, keepdim=True)
    return ((acc - mean) / (var.sqrt() + 1e-9)).to(x.dtype)
