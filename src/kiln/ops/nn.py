"""Neural-network layers: convolution, pooling and unpooling, GEMM/MatMul/Einsum/Det, LRN.

torch.nn.functional does the work (cuDNN/cuBLAS on GPU). ONNX allows padding
torch's layers do not take (asymmetric, larger than half the kernel, SAME_*),
so the geometry is resolved here first: pads torch accepts go to the layer,
the rest becomes an explicit F.pad.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .registry import register

_CONV = (None, F.conv1d, F.conv2d, F.conv3d)
_CONV_T = (None, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
_MAX_POOL = (None, F.max_pool1d, F.max_pool2d, F.max_pool3d)
_AVG_POOL = (None, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)
_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def _ints(node, name, n, default):
    v = node.attr(name)
    return list(v) if v else [default] * n


def _check_geometry(node):
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad not in _AUTO_PADS:
        return f"auto_pad '{auto_pad}' is not one of {', '.join(_AUTO_PADS)}"
    kernel = node.attr("kernel_shape")
    if kernel and len(kernel) > 3:
        return f"{len(kernel)}-D {node.op_type} is not supported (1-D to 3-D)"
    return None


def _spatial_rank(node, x):
    n = x.dim() - 2
    if not 1 <= n <= 3:
        raise ValueError(f"{node.op_type} supports 1-D to 3-D spatial input, got rank {x.dim()}")
    return n


def _torch_pads(pads):
    """ONNX [b1, b2, ..., e1, e2, ...] (first spatial axis first) -> F.pad order."""
    n = len(pads) // 2
    out = []
    for i in reversed(range(n)):
        out += [pads[i], pads[n + i]]
    return out


def _same_pads(auto_pad, total):
    """Split each axis' total SAME padding; the odd element goes last for SAME_UPPER."""
    total = [max(0, t) for t in total]
    small = [t // 2 for t in total]
    big = [t - t // 2 for t in total]
    return small + big if auto_pad == "SAME_UPPER" else big + small


# ----------------------------------------------------------------- convolution


def _conv_pads(node, spatial, kernel, strides, dilations):
    auto_pad = node.attr("auto_pad", "NOTSET")
    n = len(spatial)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        total = [(math.ceil(spatial[i] / strides[i]) - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i]
                 for i in range(n)]
        return _same_pads(auto_pad, total)
    if auto_pad == "VALID":
        return [0] * (2 * n)
    return _ints(node, "pads", 2 * n, 0)


@register("Conv", check=_check_geometry)
def conv(node, x, w, b=None):
    n = _spatial_rank(node, x)
    kernel = list(w.shape[2:])
    strides = _ints(node, "strides", n, 1)
    dilations = _ints(node, "dilations", n, 1)
    pads = _conv_pads(node, list(x.shape[2:]), kernel, strides, dilations)
    # The symmetric part of each axis' padding goes to the convolution; any excess is padded explicitly.
    sym = [min(pads[i], pads[n + i]) for i in range(n)]
    extra = [p - sym[i % n] for i, p in enumerate(pads)]
    if any(extra):
        x = F.pad(x, _torch_pads(extra))
    return _CONV[n](x, w, b, stride=strides, padding=sym, dilation=dilations, groups=node.attr("group", 1))


def _conv_transpose_geometry(node, x, w, strides, dilations):
    """Leading padding (cropped from the full transposed convolution) and output size per axis."""
    n = x.dim() - 2
    # Size of the full transposed convolution, before any padding is cropped.
    full = [strides[i] * (x.shape[2 + i] - 1) + (w.shape[2 + i] - 1) * dilations[i] + 1 for i in range(n)]
    out_pad = _ints(node, "output_padding", n, 0)[:n]
    auto_pad = node.attr("auto_pad", "NOTSET")
    output_shape = node.attr("output_shape")
    output_shape = list(output_shape)[-n:] if output_shape else None  # some exporters include N and C
    pads = node.attr("pads")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") or (output_shape and not pads):
        if not output_shape:  # SAME_*: the output is the input times the strides
            output_shape = [x.shape[2 + i] * strides[i] for i in range(n)]
        # May be negative: the output then grows with zeros. The odd element goes first unless SAME_UPPER.
        total = [full[i] + out_pad[i] - output_shape[i] for i in range(n)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        return begin, output_shape, full
    pads = list(pads) if pads and auto_pad == "NOTSET" else [0] * (2 * n)
    if not output_shape:
        output_shape = [full[i] + out_pad[i] - pads[i] - pads[n + i] for i in range(n)]
    return pads[:n], output_shape, full


@register("ConvTranspose", check=_check_geometry)
def conv_transpose(node, x, w, b=None):
    n = _spatial_rank(node, x)
    strides = _ints(node, "strides", n, 1)
    dilations = _ints(node, "dilations", n, 1)
    groups = node.attr("group", 1)
    begin, out_shape, full = _conv_transpose_geometry(node, x, w, strides, dilations)
    end = [full[i] - begin[i] - out_shape[i] for i in range(n)]  # negative: the output grows
    # torch crops `padding` at both ends and then adds `output_padding` zeros-plus-bias at the end.
    out_pad = [begin[i] - end[i] for i in range(n)]
    if all(bg >= 0 for bg in begin) and all(0 <= p < max(s, d) for p, s, d in zip(out_pad, strides, dilations)):
        return _CONV_T[n](x, w, b, stride=strides, padding=begin, output_padding=out_pad, groups=groups,
                          dilation=dilations)
    # General case: the full transposed convolution, cropped (negative F.pad) or extended with zeros.
    y = _CONV_T[n](x, w, None, stride=strides, dilation=dilations, groups=groups)
    y = F.pad(y, _torch_pads([-p for p in begin] + [-e for e in end]))
    if b is not None:
        y = y + b.reshape(-1, *[1] * n)
    return y


def _check_causal_conv(node):
    act = node.attr("activation", "none")
    return None if act in ("none", "silu", "swish") else f"CausalConvWithState activation '{act}' is not none/silu/swish"


@register("CausalConvWithState", check=_check_causal_conv, since=27)
def causal_conv_with_state(node, x, w, b=None, past=None):
    """Depthwise causal 1-D convolution over the carried (k - 1) positions and x (Mamba's, Gated DeltaNet's
    token mixer); also returns the last k - 1 positions as the next step's state."""
    k = w.shape[-1]
    if past is None:
        past = x.new_zeros(x.shape[0], x.shape[1], k - 1)
    padded = torch.cat((past.to(x.dtype), x), dim=2)
    y = F.conv1d(padded, w, b, groups=x.shape[1])
    if node.attr("activation", "none") in ("silu", "swish"):
        y = F.silu(y.float()).to(x.dtype)
    return y, padded[:, :, padded.shape[2] - (k - 1):]


def _check_deform_conv(node):
    kernel = node.attr("kernel_shape")
    if kernel and len(kernel) != 2:
        return f"{len(kernel)}-D DeformConv is not supported (2-D only)"
    return None


def _bilinear_gather(planes, py, px):
    """Sample planes (N, G, C, H, W) at float positions py/px (N, G, P), zero outside: (N, G, C, P)."""
    n, g, c, h, w = planes.shape
    flat = planes.reshape(n, g, c, h * w)
    y0, x0 = py.floor(), px.floor()
    out = 0
    for dy in (0, 1):
        for dx in (0, 1):
            yi, xi = y0 + dy, x0 + dx
            weight = (1 - (py - yi).abs()) * (1 - (px - xi).abs())
            weight = weight * ((yi >= 0) & (yi < h) & (xi >= 0) & (xi < w))
            idx = (yi.clamp(0, h - 1) * w + xi.clamp(0, w - 1)).long()
            vals = flat.gather(3, idx.unsqueeze(2).expand(n, g, c, idx.shape[-1]))
            out = out + vals * weight.unsqueeze(2).to(planes.dtype)
    return out


@register("DeformConv", check=_check_deform_conv, since=19)
def deform_conv(node, x, w, offset, b=None, mask=None):
    if x.dim() != 4:
        raise ValueError(f"DeformConv supports 2-D input (rank 4), got rank {x.dim()}")
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    oh, ow = offset.shape[2:]
    groups, og = node.attr("group", 1), node.attr("offset_group", 1)
    (sh, sw), (dh, dw) = _ints(node, "strides", 2, 1), _ints(node, "dilations", 2, 1)
    ph, pw = _ints(node, "pads", 4, 0)[:2]
    # Sampling positions (N, offset_group, kH, kW, oH, oW): the regular grid plus the learned offsets.
    off = offset.float().reshape(n, og, kh, kw, 2, oh, ow)

    def grid(size, step, start=0):
        return torch.arange(size, device=x.device, dtype=torch.float32) * step + start

    py = grid(kh, dh).view(kh, 1, 1, 1) + grid(oh, sh, -ph).view(1, 1, oh, 1) + off[:, :, :, :, 0]
    px = grid(kw, dw).view(1, kw, 1, 1) + grid(ow, sw, -pw).view(1, 1, 1, ow) + off[:, :, :, :, 1]
    cols = _bilinear_gather(x.reshape(n, og, c // og, h, wd), py.reshape(n, og, -1), px.reshape(n, og, -1))
    if mask is not None:
        cols = cols * mask.reshape(n, og, 1, -1).to(x.dtype)
    # im2col layout (N, group, C/group * kH*kW, oH*oW) times the weights per group.
    cols = cols.reshape(n, groups, (c // groups) * kh * kw, oh * ow)
    y = torch.matmul(w.reshape(groups, oc // groups, -1), cols).reshape(n, oc, oh, ow)
    return y if b is None else y + b.reshape(1, -1, 1, 1)


# ------------------------------------------------------------------- pooling


def _pool_geometry(node, x):
    """kernel, strides, dilations, ONNX pads and output sizes of a pooling node."""
    n = _spatial_rank(node, x)
    spatial = list(x.shape[2:])
    kernel = list(node.attr("kernel_shape"))
    strides = _ints(node, "strides", n, 1)
    dilations = _ints(node, "dilations", n, 1)
    eff = [(kernel[i] - 1) * dilations[i] + 1 for i in range(n)]
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [math.ceil(spatial[i] / strides[i]) for i in range(n)]
        pads = _same_pads(auto_pad, [(out[i] - 1) * strides[i] + eff[i] - spatial[i] for i in range(n)])
        return kernel, strides, dilations, pads, out
    pads = [0] * (2 * n) if auto_pad == "VALID" else _ints(node, "pads", 2 * n, 0)
    ceil_mode = bool(node.attr("ceil_mode", 0))
    out = []
    for i in range(n):
        span = spatial[i] + pads[i] + pads[n + i] - eff[i]
        o = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (o - 1) * strides[i] >= spatial[i] + pads[i]:
            o -= 1  # the last window must start inside the input or its leading padding
        out.append(o)
    return kernel, strides, dilations, pads, out


def _torch_out(size, k, s, p, d, ceil_mode):
    span = size + 2 * p - d * (k - 1) - 1
    o = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (o - 1) * s >= size + p:
        o -= 1
    return o


def _native_pool(x, kernel, strides, dilations, pads, out, max_pad):
    """(padding, ceil_mode) that make torch's pooling produce exactly `out`, or None."""
    n = len(kernel)
    sym = pads[:n]
    if sym != pads[n:] or any(p > max_pad(i) for i, p in enumerate(sym)):
        return None
    for ceil_mode in (False, True):
        if all(_torch_out(x.shape[2 + i], kernel[i], strides[i], sym[i], dilations[i], ceil_mode) == out[i]
               for i in range(n)):
            return sym, ceil_mode
    return None


def _pad_to_windows(x, kernel, strides, dilations, pads, out, value):
    """Pad so that the windows of `out` tile the input exactly (ceil mode adds trailing padding)."""
    n = len(kernel)
    end = [(out[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - x.shape[2 + i] - pads[i] for i in range(n)]
    return F.pad(x, _torch_pads(pads[:n] + [max(e, 0) for e in end]), value=value)


def _sum_pool(x, kernel, strides, dilations):
    """Window sums over an already padded input."""
    n = len(kernel)
    if all(d == 1 for d in dilations):
        if n == 1:
            return F.avg_pool2d(x.unsqueeze(2), [1, kernel[0]], [1, strides[0]], divisor_override=1).squeeze(2)
        return _AVG_POOL[n](x, kernel, strides, divisor_override=1)
    # avg_pool has no dilation: a depthwise convolution with a kernel of ones sums dilated windows.
    nc = x.shape[:2]
    ones = torch.ones(1, 1, *kernel, dtype=x.dtype, device=x.device)
    y = _CONV[n](x.reshape(-1, 1, *x.shape[2:]), ones, stride=strides, dilation=dilations)
    return y.reshape(*nc, *y.shape[2:])


def _check_pool(node):
    if not node.attr("kernel_shape"):
        return f"{node.op_type} needs the kernel_shape attribute"
    return _check_geometry(node)


def _flat_indices(idx, in_spatial, pad_begin, padded_spatial, storage_order):
    """torch's per-plane argmax indices -> ONNX's indices into the whole flattened input."""
    coords = []
    for size in reversed(padded_spatial):
        coords.append(idx % size)
        idx = idx // size
    coords = [c - p for c, p in zip(reversed(coords), pad_begin)]
    order = reversed(range(len(coords))) if storage_order else range(len(coords))
    flat = torch.zeros_like(idx)
    for i in order:
        flat = flat * in_spatial[i] + coords[i]
    plane = math.prod(in_spatial)
    nc = idx.shape[0] * idx.shape[1]
    base = torch.arange(nc, device=idx.device, dtype=idx.dtype).reshape(idx.shape[:2] + (1,) * len(in_spatial))
    return flat + base * plane


# y_scale (Kiln's, not ONNX's): quantized readers' scale; the output is then their 8-bit input (attribute qtype),
# as kiln/builder/quantized_io.py links a pool whose every reader quantizes it. With attribute x_quantized, x holds
# 8-bit values at that scale already (a QConv wrote them), and their max is the output as it is.
@register("MaxPool", check=_check_pool, uncast_inputs=(1,))
def max_pool(node, x, y_scale=None):
    if y_scale is not None and not node.attr("x_quantized", 0):
        from .fused import quantize

        return quantize(node, max_pool(node, x), y_scale)
    kernel, strides, dilations, pads, out = _pool_geometry(node, x)
    n = len(kernel)
    want_indices = len(node.outputs) > 1 and bool(node.outputs[1])
    pool = _MAX_POOL[n]
    eff = [(kernel[i] - 1) * dilations[i] + 1 for i in range(n)]
    dtype = x.dtype
    if not dtype.is_floating_point or dtype.itemsize == 1:  # no integer or FP8 pooling; 8-bit values are exact in FP32
        x = x.to(torch.float32 if x.element_size() <= 2 else torch.float64)
    native = _native_pool(x, kernel, strides, dilations, pads, out, lambda i: eff[i] // 2)
    if native is not None:
        padding, ceil_mode = native
        res = pool(x, kernel, strides, padding, dilations, ceil_mode=ceil_mode, return_indices=want_indices)
        pad_begin, padded = [0] * n, list(x.shape[2:])
    else:
        xp = _pad_to_windows(x, kernel, strides, dilations, pads, out, -math.inf)
        res = pool(xp, kernel, strides, 0, dilations, return_indices=want_indices)
        pad_begin, padded = pads[:n], list(xp.shape[2:])
    if not want_indices:
        return res.to(dtype)
    y, idx = res
    return y.to(dtype), _flat_indices(idx, list(x.shape[2:]), pad_begin, padded, node.attr("storage_order", 0))


@register("MaxUnpool", check=_check_pool, host_inputs=(2,), since=9)
def max_unpool(node, x, indices, output_shape=None):
    """Zeros with each pooled value put back at its MaxPool index, flat over the whole output tensor.
    With output_shape the indices address that shape, as in onnxruntime and PyTorch (ONNX's reference
    evaluator instead unpools to the inferred shape and pads it: docs/operators.md)."""
    n = _spatial_rank(node, x)
    if output_shape is not None:
        shape = [int(d) for d in output_shape.reshape(-1).tolist()]
    else:
        kernel = list(node.attr("kernel_shape"))
        strides, pads = _ints(node, "strides", n, 1), _ints(node, "pads", 2 * n, 0)
        shape = list(x.shape[:2]) + [(x.shape[2 + i] - 1) * strides[i] + kernel[i] - pads[i] - pads[n + i]
                                     for i in range(n)]
    y = torch.zeros(math.prod(shape), dtype=x.dtype, device=x.device)
    return y.scatter(0, indices.reshape(-1).long(), x.reshape(-1)).reshape(shape)


@register("AveragePool", check=_check_pool)
def average_pool(node, x):
    kernel, strides, dilations, pads, out = _pool_geometry(node, x)
    n = len(kernel)
    include_pad = bool(node.attr("count_include_pad", 0))
    if all(d == 1 for d in dilations):
        native = _native_pool(x, kernel, strides, dilations, pads, out, lambda i: kernel[i] // 2)
        if native is not None:
            padding, ceil_mode = native
            return _AVG_POOL[n](x, kernel, strides, padding, ceil_mode=ceil_mode, count_include_pad=include_pad)
    # Window sums divided by how many positions each window counts: the input, plus the
    # explicit padding with count_include_pad, never the extra tail of ceil mode.
    xp = _pad_to_windows(x, kernel, strides, dilations, pads, out, 0.0)
    counted = torch.zeros(1, 1, *xp.shape[2:], dtype=x.dtype, device=x.device)
    region = [slice(None), slice(None)]
    for i in range(n):
        size = x.shape[2 + i]
        region.append(slice(0, pads[i] + size + pads[n + i]) if include_pad else slice(pads[i], pads[i] + size))
    counted[tuple(region)] = 1
    return _sum_pool(xp, kernel, strides, dilations) / _sum_pool(counted, kernel, strides, dilations)


def _acc(x):
    """Reductions of powers overflow FP16/BF16: accumulate in FP32 and round the result once."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@register("LpPool", check=_check_pool)
def lp_pool(node, x):
    kernel, strides, dilations, pads, out = _pool_geometry(node, x)
    p = float(node.attr("p", 2))
    xp = _pad_to_windows(_acc(x).abs().pow(p), kernel, strides, dilations, pads, out, 0.0)
    return _sum_pool(xp, kernel, strides, dilations).pow(1.0 / p).to(x.dtype)


@register("GlobalAveragePool")
def global_average_pool(node, x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@register("GlobalMaxPool")
def global_max_pool(node, x):
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


@register("GlobalLpPool")
def global_lp_pool(node, x):
    p = float(node.attr("p", 2))
    dims = tuple(range(2, x.dim()))
    return torch.linalg.vector_norm(_acc(x), ord=p, dim=dims, keepdim=True).to(x.dtype)


@register("LRN")
def lrn(node, x):
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    xa = _acc(x)
    # Mean of squares over channels [c - floor((size-1)/2), c + ceil((size-1)/2)]; avg_pool counts the
    # zero padding, so it divides by `size` as ONNX does (torch's local_response_norm centres even sizes differently).
    planes = F.pad(xa.square().reshape(x.shape[0], 1, x.shape[1], -1), (0, 0, (size - 1) // 2, size // 2))
    mean = F.avg_pool2d(planes, (size, 1), stride=1).reshape(x.shape)
    return (xa / (bias + alpha * mean).pow(beta)).to(x.dtype)


# -------------------------------------------------------------- matrix products


def _matmul(a, b):
    if a.dtype.is_floating_point:
        return torch.matmul(a, b)
    dtype = a.dtype
    if dtype in _UNSIGNED:  # no unsigned arithmetic in torch: wrap-around in int64 is the same modulo 2**bits
        a, b = a.to(torch.int64), b.to(torch.int64)
    if a.device.type == "cpu":
        y = torch.matmul(a, b)
    else:  # cuBLAS has no integer GEMM: exact broadcast multiply-sum
        a2 = a.unsqueeze(-2) if a.dim() == 1 else a
        b2 = b.unsqueeze(-1) if b.dim() == 1 else b
        y = (a2.unsqueeze(-1) * b2.unsqueeze(-3)).sum(-2, dtype=a2.dtype)
        if a.dim() == 1:
            y = y.squeeze(-2)
        if b.dim() == 1:
            y = y.squeeze(-1)
    return y.to(dtype)


@register("MatMul")
def matmul(node, a, b):
    return _matmul(a, b)


@register("Gemm")
def gemm(node, a, b, c=None):
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    if node.attr("transA", 0):
        a = a.t()
    if node.attr("transB", 0):
        b = b.t()
    if a.dtype.is_floating_point:
        if c is None or beta == 0:
            y = torch.mm(a, b)
            return y if alpha == 1 else y * alpha
        return torch.addmm(c.to(a.dtype), a, b, beta=beta, alpha=alpha)  # one cuBLAS call with the bias
    y = _matmul(a, b)
    if alpha != 1:
        y = (y * alpha).to(a.dtype)
    if c is not None and beta != 0:
        y = y + (c * beta).to(a.dtype) if beta != 1 else y + c
    return y


@register("Det", since=11)
def det(node, x):
    # torch's LU has no FP16/BF16 kernels: factor in FP32 and round the determinant once.
    low = x.dtype in (torch.float16, torch.bfloat16)
    return torch.linalg.det(x.float() if low else x).to(x.dtype)


def _check_einsum(node):
    eq = node.attr("equation")
    if not eq:
        return "Einsum needs the equation attribute"
    return None


@register("Einsum", check=_check_einsum, since=12)
def einsum(node, *operands):
    eq = node.attr("equation").replace(" ", "")
    dtype = operands[0].dtype
    if not dtype.is_floating_point and operands[0].device.type != "cpu":
        # cuBLAS has no integer GEMM; FP64 is exact while results stay below 2**53.
        return torch.einsum(eq, *[t.to(torch.float64) for t in operands]).to(torch.int64).to(dtype)
    if dtype in _UNSIGNED:
        operands = [t.to(torch.int64) for t in operands]
    return torch.einsum(eq, *operands).to(dtype)
