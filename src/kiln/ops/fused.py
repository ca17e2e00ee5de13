"""Kiln's fused layers (domain "kiln"), produced by the fusion passes.

Each has a torch reference implementation here (the ground truth, runs on CPU);
faster implementations are tactics (src/kiln/tactics/) timed on the GPU at build.
A fused node keeps its source ONNX nodes in node.sources for the inspector.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import int4
from .registry import lookup, register

KILN = "kiln"


def activation(name: str, x: torch.Tensor, params=()) -> torch.Tensor:
    """The activations fusion can absorb into a GEMM or convolution epilogue."""
    if not name:
        return x
    if name == "Relu":
        return torch.relu(x)
    if name == "LeakyRelu":
        return F.leaky_relu(x, params[0] if params else 0.01)
    if name == "Clip":
        return torch.clamp(x, params[0], params[1])
    if name == "Sigmoid":
        return torch.sigmoid(x)
    if name == "Silu":
        return F.silu(x)
    if name == "HardSwish":
        return F.hardswish(x)
    if name == "GeluErf":
        return F.gelu(x)
    if name == "GeluTanh":
        return F.gelu(x, approximate="tanh")
    if name == "Tanh":
        return torch.tanh(x)
    raise ValueError(f"unknown fused activation {name!r}")


@register("FusedConv", domain=KILN)
def fused_conv(node, x, w, b=None, z=None):
    """act(conv(x, w) + b + z): Conv + bias + optional residual Add + optional activation."""
    y = lookup("Conv").impl(node, x, w, b)
    if z is not None:
        y = y + z
    return activation(node.attr("activation", ""), y, node.attr("activation_params", []))


def fused_gemm(node, x, w, b=None):
    """act(x @ w + b) with w stored [K, N]; x may have leading batch dims."""
    y = torch.matmul(x, w)
    if b is not None:
        y = y + b
    return activation(node.attr("activation", ""), y, node.attr("activation_params", []))


@register("FusedGemm", domain=KILN)
def fused_gemm_layer(node, x, w, b=None):
    """fused_gemm as a layer. output_type "float32": the result in FP32 whatever the layer's precision (a model's
    FP32 output, an LM head's logits)."""
    y = fused_gemm(node, x, w, b)
    return y.float() if writes_fp32(node) else y


@register("PooledGemm", domain=KILN)
def pooled_gemm(node, x, w, b=None):
    """act(mean over H, W of x [N, C, H, W] @ w + b), w stored [C, N_out]: a CNN's global average pool and
    classifier as one layer, so the pool's sums can feed the GEMM without a round trip through memory.
    output_type "float32": the result in FP32 whatever the layer's precision (a model's FP32 output)."""
    y = fused_gemm(node, x.mean(dim=(2, 3)), w, b)
    return y.float() if writes_fp32(node) else y


def writes_fp32(node) -> bool:
    """A layer told to write a model's FP32 output itself (attribute output_type, builder/precision.py)."""
    return node.attr("output_type", "") == "float32"


@register("Attention", domain=KILN, saturating_inputs=(3,), uncast_inputs=(4, 5))
def attention(node, q, k, v, mask=None, y_scale=None, qkv_scale=None):
    """softmax(q @ k^T * scale + mask) @ v, as one layer (SDPA/flash class).

    k arrives already transposed ([.., D, S]) when node.attr("k_transposed"): the
    exporter's own transpose is left in place and undone here as a free view.
    nan_guard: exporters zero the probabilities of rows whose keys are all masked.
    y_scale (input 4, attribute qtype): the result as 8-bit values for the quantized layer that reads it
    (BERT's output projection; kiln/builder/quantized_io.py).
    qkv_scale (input 5): q, k and v are FP8 codes of this one scale (an FP8 engine's merged QKV projection
    writes them so), computed in the layer's float type (attribute float_type).
    """
    if qkv_scale is not None:
        ft = float_type(node, q)
        q, k, v = ((t.float() * qkv_scale.float()).to(ft) for t in (q, k, v))
    if node.attr("k_transposed", 0):
        k = k.transpose(-1, -2)
    scale = node.attr("scale", 1.0 / math.sqrt(q.shape[-1]))
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1)
    if node.attr("nan_guard", 0):
        probs = torch.nan_to_num(probs, nan=0.0)
    return quantized_output(node, torch.matmul(probs.to(v.dtype), v), y_scale)


@register("SkipLayerNorm", domain=KILN, uncast_inputs=(4,))
def skip_layer_norm(node, a, b, gamma, beta=None, q_scale=None, c=None):
    """LayerNorm(a + b) over the last axis; second output is the sum (residual stream). b omitted: LayerNorm(a)
    (a LayerNormalization given an 8-bit copy). With q_scale (input 4, attribute qtype), a third output: the
    normalized rows as 8-bit values for the quantized layers that read them (kiln/builder/quantized_io.py).
    c (input 5): a third addend, broadcast to the sum, added last: LayerNorm((a + b) + c), as BERT's embeddings
    (word + token type, then + position). output_type "float32": the normalized rows in FP32 (a model's output)."""
    s = a if b is None else a + b
    s = s if c is None else s + c
    y = F.layer_norm(s, s.shape[-1:], gamma, beta, node.attr("epsilon", 1e-5))
    q = () if q_scale is None else (quantize(node, y, q_scale),)
    return (y.float() if writes_fp32(node) else y, s) + q


@register("GemmSkipLayerNorm", domain=KILN)
def gemm_skip_layer_norm(node, x, w, bias, skip, gamma, beta=None):
    """LayerNorm(x @ w + bias + skip): a GEMM without activation whose only reader is a SkipLayerNorm, as
    one layer, so a split-K GEMM can leave the sum of its partial products to the norm (one kernel fewer)."""
    y = fused_gemm(node, x, w, bias)
    return skip_layer_norm(node, y, skip, gamma, beta)


# --- generated elementwise chains ------------------------------------------------
# An Elementwise node carries a small program: one instruction per fused ONNX node,
# "OP DST A B..." where operands are inputs (i0, i1...), temporaries (t0...) or
# inline constants (c<float>). The last temporary is the output. An op's ONNX
# attributes follow its tensor operands as constants (ATTRIBUTE_ARGS); Clip's bounds
# are its operands 1 and 2 and Pow's exponent is a constant; GeluTanh is Gelu with
# approximate="tanh". Where's condition is a bool input (true where nonzero).
UNARY = {"Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Neg", "Abs", "Erf", "Reciprocal",
         "HardSwish", "Softplus", "Sign", "Floor", "Ceil", "HardSigmoid", "LeakyRelu", "Elu", "Gelu"}
BINARY = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"}
ATTRIBUTE_ARGS = {"HardSigmoid": ("alpha", "beta"), "LeakyRelu": ("alpha",), "Elu": ("alpha",)}
_PROGRAM_OPS = {"GeluTanh": ("Gelu", {"approximate": "tanh"})}  # program op -> ONNX op and its attributes


def parse_program(program: list[str]) -> list[tuple[str, str, list[str]]]:
    return [(op, dst, args) for op, dst, *args in (line.split() for line in program)]


@register("Elementwise", domain=KILN)
def elementwise(node, *inputs):
    """Runs the program with each op's own registry implementation (same types, same semantics)."""
    from ..ir.graph import Node

    env = {f"i{k}": x for k, x in enumerate(inputs)}
    # the constants' type: the float inputs', else the first input's that is not a Where's condition
    dtype = next((x.dtype for x in inputs if x.dtype.is_floating_point),
                 next((x.dtype for x in inputs if x.dtype != torch.bool), inputs[0].dtype))
    out = None
    for op, dst, args in parse_program(node.attr("program")):
        names = ATTRIBUTE_ARGS.get(op, ())
        args, literals = args[:len(args) - len(names)], args[len(args) - len(names):]
        onnx_op, attrs = _PROGRAM_OPS.get(op, (op, {}))
        attrs = {**attrs, **{k: float(a[1:]) for k, a in zip(names, literals)}}
        # torch.full, not torch.tensor: a fill kernel, where a copy from host memory would break CUDA-graph capture
        vals = [torch.full((), float(a[1:]), dtype=dtype, device=inputs[0].device) if a.startswith("c") else env[a]
                for a in args]
        if op == "Where" and vals[0].dtype != torch.bool:
            vals[0] = vals[0] != 0
        step = Node(onnx_op, list(args), [dst], attrs, opset=max(node.opset, 13), device=node.device)
        out = env[dst] = lookup(onnx_op).impl(step, *vals)
    return out


# --- INT8 / FP8 layers from explicit quantization (Q/DQ) ---------------------------
# y = act(sx * sw * (q(x) @ w_q) + b): the activation is quantized with the model's own
# scale (round half to even, saturate), weights are int8 with per-channel scales or FP8
# E4M3 with one scale (attribute qtype). Between two quantized layers the activation can
# travel as 8-bit values (kiln/builder/quantized_io.py): the producer quantizes its output
# with the reader's scale (input y_scale) and the reader (attribute x_quantized) takes x as
# is, producing the float type in attribute float_type.
def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x.float() / scale.float()), -128, 127).to(torch.int8)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even into FP8 E4M3 (ONNX QuantizeLinear, saturate=1)."""
    return torch.clamp(x.float() / scale.float(), -448.0, 448.0).to(torch.float8_e4m3fn)


def quantize_as(qtype: str, x, scale):
    return quantize_fp8(x, scale) if qtype == "fp8" else quantize_int8(x, scale)


def quantize(node, x, scale):
    return quantize_as(node.attr("qtype", "int8"), x, scale)


def quantized_input(node, x, x_scale):
    """x as 8-bit values: quantized here, or already quantized by the layer before (x_quantized)."""
    return x if node.attr("x_quantized", 0) else quantize(node, x, x_scale)


def float_type(node, x) -> torch.dtype:
    """The float type a quantized layer computes its epilogue in and returns (unless it re-quantizes): the
    engine's (attribute float_type, kiln/builder/quantized_io.py), not x's. A network's first layer reads the
    FP32 graph input even in an FP16 engine; returning FP32 there would write its output at twice the size
    and cast it back for the FP16 layer after it (ResNet-50's stem: two passes over 25.7M values at batch 32)."""
    from ..ir.dtypes import from_name

    name = node.attr("float_type") or ("float32" if node.attr("x_quantized", 0) else None)  # 8-bit x: no float type
    return from_name(name) if name else x.dtype


def quantized_output(node, y, y_scale):
    """y re-quantized with the next layer's scale when it travels as 8-bit values, else y."""
    return quantize(node, y, y_scale) if y_scale is not None else y


@register("QGemm", domain=KILN, keeps_input_types=True)
def qgemm(node, x, w_q, x_scale, w_scale, b=None, y_scale=None):
    ft = float_type(node, x)
    acc = torch.matmul(quantized_input(node, x, x_scale).double(), w_q.double())  # exact: 8-bit products in float64
    y = (acc * (x_scale.double() * w_scale.double())).to(ft)
    if b is not None:
        y = y + b.to(ft)
    return quantized_output(node, activation(node.attr("activation", ""), y, node.attr("activation_params", [])),
                            y_scale)


def residual(z: torch.Tensor, z_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A residual input in dtype: float as it is, 8-bit values times their scale (in FP32, then rounded once)."""
    return z.to(dtype) if z_scale is None else (z.float() * z_scale.float()).to(dtype)


@register("QConv", domain=KILN, keeps_input_types=True)
def qconv(node, x, w_q, x_scale, w_scale, b=None, z=None, y_scale=None, q_scale=None, z_scale=None):
    """act(sx * sw * conv(q(x), w_q) + b + z): z is an optional residual (ResNet's shortcut Add), float or, with
    z_scale (input 8), the 8-bit copy a quantized block output's producer wrote (builder/quantized_io.py). With
    q_scale (input 7), a second output: y quantized for the quantized layers that read it, while others
    read y as float (a ResNet block's output: the next block's first convolution and its residual) or, with
    y_scale too, as 8-bit values at their own scale (a residual that the copy's scale would clip)."""
    ft = float_type(node, x)
    acc = lookup("Conv").impl(node, quantized_input(node, x, x_scale).double(), w_q.double())  # exact in float64
    if acc.is_cuda and acc.dim() == 4:
        # cuDNN has no float64 NHWC kernels, but every QConv tactic on a GPU writes channels-last: the
        # builder times the layers after this one on the layout they will read (1x1 tactics need it)
        acc = acc.contiguous(memory_format=torch.channels_last)
    scale = (x_scale.double() * w_scale.double()).reshape(1, -1, *([1] * (acc.dim() - 2)))
    y = (acc * scale).to(ft)
    if b is not None:
        y = y + b.to(ft).reshape(1, -1, *([1] * (acc.dim() - 2)))
    if z is not None:
        y = y + residual(z, z_scale, ft)
    y = activation(node.attr("activation", ""), y, node.attr("activation_params", []))
    out = quantized_output(node, y, y_scale)
    return out if q_scale is None else (out, quantize(node, y, q_scale))


def stem_patches_reference(x: torch.Tensor, channels: int, first: int, columns: int, width: int) -> torch.Tensor:
    """x [N, C, H, W] (H, W even) as [N, columns * 4 * channels, H/2, width], channels-last: at (i, j), entry
    ((t * 2 + pr) * 2 + pc) * channels + c is x[c, 2i + pr, 2(j + first + t) + pc], zero outside the image and
    for c >= C. Each row holds the 2x2 cells (space-to-depth) of `columns` neighbouring cell columns."""
    n, c, h, w = x.shape
    left = max(0, -first)  # zero cells before column 0 and after the last
    right = max(0, width + first + columns - 1 - (w // 2 - 1))
    xp = F.pad(x, (2 * left, 2 * right, 0, 0, 0, channels - c))
    cells = xp.reshape(n, channels, h // 2, 2, xp.shape[3] // 2, 2).permute(0, 2, 4, 3, 5, 1)  # [n, i, q, pr, pc, c]
    start = left + first
    y = torch.stack([cells[:, :, start + t:start + t + width] for t in range(columns)], dim=3)
    return y.reshape(n, h // 2, width, -1).permute(0, 3, 1, 2)


# y_scale (input 1): the quantized convolution's input scale; the output is then its 8-bit input (attribute qtype),
# as kiln/builder/quantized_io.py links patches that only quantized layers read.
@register("StemPatches", domain=KILN, keeps_input_types=True, uncast_inputs=(1,))
def stem_patches(node, x, y_scale=None):
    """A stride-2 convolution's input over few channels (an RGB stem) rearranged for the stride-1 convolution over
    many channels that passes/stem_patches.py turns it into (stem_patches_reference says where each value goes)."""
    y = stem_patches_reference(x, node.attr("channels"), node.attr("first"), node.attr("columns"), node.attr("width"))
    return quantize(node, y, y_scale) if y_scale is not None else y


@register("Int4Gemm", domain=KILN, keeps_input_types=True)
def int4_gemm(node, x, packed, scales, b=None):
    """x @ dequant(packed int4 [K/2, N], group scales [K/g, N]) + b, in x's float type."""
    return int4.reference(x, packed, scales.to(torch.float32), None, node.attr("group_size"), bias=b)


@register("RMSNorm", domain=KILN)
def rms_norm(node, x, gamma=None, skip=None):
    """x / sqrt(mean(x^2, last axis) + eps) * gamma, computed in FP32. skip (input 2): x + skip is normalized
    (a residual add joined to the norm), and is the second output."""
    s = x if skip is None else x + skip
    y = F.rms_norm(s.float(), s.shape[-1:], eps=node.attr("epsilon", 1e-6)).to(s.dtype)
    y = y * gamma.to(s.dtype) if gamma is not None else y
    return y if skip is None else (y, s)
