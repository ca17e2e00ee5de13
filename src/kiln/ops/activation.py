"""Activation ops, and the Softmax family."""

import math

import torch
import torch.nn.functional as F

from .registry import register


@register("Relu")
def relu(node, x):
    return torch.relu(x)


@register("LeakyRelu")
def leaky_relu(node, x):
    return F.leaky_relu(x, node.attr("alpha", 0.01))


@register("PRelu")
def prelu(node, x, slope):
    if node.opset < 7 and slope.dim() == 1 and slope.numel() > 1 and x.dim() > 2:
        slope = slope.reshape(-1, *([1] * (x.dim() - 2)))  # old PRelu: a 1-D slope is per channel
    return torch.where(x < 0, x * slope, x)


@register("Sigmoid")
def sigmoid(node, x):
    return torch.sigmoid(x)


@register("HardSigmoid")
def hard_sigmoid(node, x):
    return torch.clamp(x * node.attr("alpha", 0.2) + node.attr("beta", 0.5), 0, 1)


@register("HardSwish")
def hard_swish(node, x):
    return F.hardswish(x)


@register("Elu")
def elu(node, x):
    return F.elu(x, node.attr("alpha", 1.0))


@register("Selu")
def selu(node, x):
    alpha = node.attr("alpha", 1.67326319217681884765625)
    gamma = node.attr("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x > 0, x, alpha * torch.expm1(x))


@register("Celu")
def celu(node, x):
    return F.celu(x, node.attr("alpha", 1.0))


def _check_gelu(node):
    a = node.attr("approximate", "none")
    return None if a in ("none", "tanh") else f"Gelu approximate={a!r} (must be 'none' or 'tanh')"


@register("Gelu", check=_check_gelu)
def gelu(node, x):
    return F.gelu(x, approximate=node.attr("approximate", "none"))


@register("Mish")
def mish(node, x):
    return F.mish(x)


@register("Swish")
def swish(node, x):
    return x * torch.sigmoid(node.attr("alpha", 1.0) * x)


@register("SwiGLU", since=28)
def swiglu(node, a, b):
    if a.shape != b.shape:
        raise ValueError(f"SwiGLU gate {tuple(a.shape)} and value {tuple(b.shape)} must have one shape "
                         "(no broadcasting)")
    return a * torch.sigmoid(node.attr("alpha", 1.0) * a) * b


@register("Softplus")
def softplus(node, x):
    return F.softplus(x)


@register("Softsign")
def softsign(node, x):
    return F.softsign(x)


@register("ThresholdedRelu")
def thresholded_relu(node, x):
    return torch.where(x > node.attr("alpha", 1.0), x, torch.zeros_like(x))


@register("Shrink")
def shrink(node, x):
    lambd, bias = node.attr("lambd", 0.5), node.attr("bias", 0.0)
    zero = torch.zeros_like(x)
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, zero)).to(x.dtype)


@register("ScaledTanh")
def scaled_tanh(node, x):
    return node.attr("alpha", 1.0) * torch.tanh(node.attr("beta", 1.0) * x)


@register("ParametricSoftplus")
def parametric_softplus(node, x):
    return node.attr("alpha", 1.0) * F.softplus(node.attr("beta", 1.0) * x)


@register("ImageScaler")
def image_scaler(node, x):
    y = x * node.attr("scale", 1.0)
    # One bias per channel (axis 1), added slice by slice: building a tensor from
    # the list would be a host-to-device copy, which CUDA-graph capture forbids.
    for c, b in enumerate(node.attr("bias") or ()):
        y[:, c] += b
    return y


def _along_axis(node, x, fn):
    """Opset >= 13: `fn` along `axis` (default -1). Before 13 the input is coerced
    to 2-D at `axis` (default 1) and `fn` runs over the flattened trailing part."""
    if node.opset >= 13:
        return fn(x, node.attr("axis", -1))
    axis = node.attr("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    outer = math.prod(x.shape[:axis])
    return fn(x.reshape(outer, math.prod(x.shape[axis:])), 1).reshape(x.shape)


def _hardmax(x, dim):
    if x.numel() == 0:
        return x
    return torch.zeros_like(x).scatter_(dim, x.argmax(dim, keepdim=True), 1)


# FP16/BF16: ONNX defines Softmax as Exp(x - max) / ReduceSum(...), each step
# rounded to the tensor type; torch's fused kernels round once at the end and
# differ from that by an ulp or two, so low precision runs the steps.
def _softmax(x, dim):
    if x.dtype not in (torch.float16, torch.bfloat16):
        return torch.softmax(x, dim)
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def _log_softmax(x, dim):
    if x.dtype not in (torch.float16, torch.bfloat16):
        return torch.log_softmax(x, dim)
    y = x - x.amax(dim, keepdim=True)
    return y - torch.log(torch.exp(y).sum(dim, keepdim=True))


@register("Softmax")
def softmax(node, x):
    return _along_axis(node, x, _softmax)


@register("LogSoftmax")
def log_softmax(node, x):
    return _along_axis(node, x, _log_softmax)


@register("Hardmax")
def hardmax(node, x):
    return _along_axis(node, x, _hardmax)
