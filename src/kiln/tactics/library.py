"""Library tactics: cuDNN, cuBLASLt and SDPA kernels reached through torch ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import cublaslt, cudnn_conv
from ..ops.fused import (
    activation,
    attention,
    float_type,
    fused_conv,
    skip_layer_norm,
    writes_fp32,
)
from . import layer_gemm, tactic

_LOW = (torch.float16, torch.bfloat16)


# --- FusedConv ----------------------------------------------------------------
def _conv2d_geometry(node, x, w):
    """(stride, padding, dilation, groups) when torch's conv2d takes the node's padding as is."""
    if x.dim() != 4 or node.attr("auto_pad", "NOTSET") != "NOTSET":
        return None
    pads = node.attr("pads") or [0, 0, 0, 0]
    if pads[0] != pads[2] or pads[1] != pads[3]:
        return None
    return (node.attr("strides") or [1, 1], pads[:2], node.attr("dilations") or [1, 1], node.attr("group", 1))


def _cuda_conv(node, args, act=None, residual=None):
    x, w = args[0], args[1]
    if not x.is_cuda or _conv2d_geometry(node, x, w) is None:
        return False
    z = args[3] if len(args) > 3 else None
    if residual is not None and residual != (z is not None):
        return False
    if act is not None and node.attr("activation", "") != act:
        return False
    return z is None or tuple(z.shape) == (x.shape[0], w.shape[0], *_out_hw(node, x, w))


def _out_hw(node, x, w):
    s, p, d, _ = _conv2d_geometry(node, x, w)
    return [(x.shape[2 + i] + 2 * p[i] - d[i] * (w.shape[2 + i] - 1) - 1) // s[i] + 1 for i in range(2)]


@tactic("FusedConv", "cudnn_conv_relu", lambda n, a: _cuda_conv(n, a, "Relu", residual=False))
def cudnn_conv_relu(node, x, w, b=None, z=None):
    s, p, d, g = _conv2d_geometry(node, x, w)
    return torch.cudnn_convolution_relu(x, w, b, s, p, d, g)


@tactic("FusedConv", "cudnn_conv_add_relu", lambda n, a: _cuda_conv(n, a, "Relu", residual=True))
def cudnn_conv_add_relu(node, x, w, b=None, z=None):
    s, p, d, g = _conv2d_geometry(node, x, w)
    return torch.cudnn_convolution_add_relu(x, w, z.to(x.dtype), 1.0, b, s, p, d, g)


@tactic("FusedConv", "cudnn_conv_inplace_epilogue", lambda n, a: _cuda_conv(n, a))
def conv_inplace_epilogue(node, x, w, b=None, z=None):
    """cuDNN convolution, then the residual add and activation in place (no extra buffers)."""
    s, p, d, g = _conv2d_geometry(node, x, w)
    return conv_epilogue(node, F.conv2d(x, w, b, s, p, d, g), z)


def conv_epilogue(node, y, z=None):
    """A FusedConv's residual add and activation applied to the convolution's output y, in place."""
    if z is not None:
        y.add_(z)
    act = node.attr("activation", "")
    if act == "Relu":
        return y.relu_()
    return activation(act, y, node.attr("activation_params", []))


def _patchify_ok(node, args) -> bool:
    """A convolution whose kernel equals its stride (ViT's patch embedding): no padding, dilation or groups."""
    x, w = args[0], args[1]
    z = args[3] if len(args) > 3 else None
    geo = _conv2d_geometry(node, x, w)
    return (x.is_cuda and geo is not None and w.dim() == 4 and list(geo[0]) == list(w.shape[2:])
            and w.shape[2] * w.shape[3] > 1 and not any(geo[1]) and list(geo[2]) == [1, 1] and geo[3] == 1
            and z is None and node.attr("activation", "") in ("", "Relu") and x.dtype == w.dtype)


def patchify_gemm(node, x, w, b=None, z=None):
    """Non-overlapping patches are rows of a GEMM: one copy to gather them, then one cuBLAS call.

    cuDNN runs ViT-B/16's 16x16 stride-16 convolution at a few percent of peak. Patches are
    gathered in (kh, kw, c) order so that channels-last weights are already a [OC, K] matrix;
    the output is channels-last, as the convolution kernels' is.
    """
    n, c, h, wd = x.shape
    oc, _, kh, kw = w.shape
    oh, ow = h // kh, wd // kw  # ONNX (and cuDNN) drop a remainder that does not fill a patch
    patches = x[:, :, :oh * kh, :ow * kw].reshape(n, c, oh, kh, ow, kw).permute(0, 2, 4, 3, 5, 1)
    rows = patches.reshape(n * oh * ow, kh * kw * c)
    w2 = w.permute(0, 2, 3, 1).reshape(oc, kh * kw * c)
    y = torch.addmm(b, rows, w2.t()) if b is not None else rows @ w2.t()
    if node.attr("activation", "") == "Relu":
        y = y.relu_()
    return y.reshape(n, oh, ow, oc).permute(0, 3, 1, 2)


tactic("Conv", "patchify_gemm", _patchify_ok, domain="")(patchify_gemm)  # ONNX Conv with bias alone
tactic("FusedConv", "patchify_gemm", _patchify_ok)(patchify_gemm)


# --- FusedGemm ----------------------------------------------------------------
def _gemm_ok(node, args, acts):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    return (x.is_cuda and x.dim() >= 2 and b is not None and node.attr("activation", "") in acts
            and x.dtype == w.dtype == b.dtype)


def storage_order(x: torch.Tensor):
    """(base, perm) with base contiguous and x == base.permute(perm), when x only reorders its leading axes.

    A GEMM over the last axis treats rows independently, so it can run on `base` and hand back
    the result permuted the same way: no copy of a transposed input (ViT's sequence-first layout).
    """
    if x.is_contiguous() or x.stride(-1) != 1:
        return x, None
    lead = sorted(range(x.dim() - 1), key=lambda i: -x.stride(i))
    base = x.permute(lead + [x.dim() - 1])
    if not base.is_contiguous():
        return x, None
    return base, sorted(range(x.dim()), key=lambda i: (lead + [x.dim() - 1]).index(i))


def _rowwise(gemm, x: torch.Tensor) -> torch.Tensor:
    """gemm(x) for a GEMM over x's last axis, run on x in storage order and permuted back."""
    base, perm = storage_order(x)
    y = gemm(base)
    return y.permute(perm) if perm else y


def _addmm(x, w, b, use_gelu=None):
    def gemm(x):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.addmm(b, x2, w) if use_gelu is None else torch._addmm_activation(b, x2, w, use_gelu=use_gelu)
        return y.reshape(*x.shape[:-1], w.shape[1])

    return _rowwise(gemm, x)


def _fp32_gemm(node) -> bool:
    """A FusedGemm told to write FP32 (builder/precision.py). GemmSkipLayerNorm reuses these tactics for its
    GEMM, whose output_type is the norm's: its GEMM writes the compute type."""
    return node.op_type == "FusedGemm" and writes_fp32(node)


def _typed(node, y):
    """A FusedGemm tactic's result in the layer's output type, where the kernel wrote the compute type."""
    return y.float() if _fp32_gemm(node) else y


@tactic("FusedGemm", "cublaslt_bias", lambda n, a: _gemm_ok(n, a, ("",)))
def cublaslt_bias(node, x, w, b=None):
    return _typed(node, _addmm(x, w, b))


@tactic("FusedGemm", "cublaslt_bias_relu", lambda n, a: _gemm_ok(n, a, ("Relu",)))
def cublaslt_bias_relu(node, x, w, b=None):
    return _typed(node, _addmm(x, w, b, use_gelu=False))


@tactic("FusedGemm", "cublaslt_bias_gelu", lambda n, a: _gemm_ok(n, a, ("GeluTanh",))
        or (_gemm_ok(n, a, ("GeluErf",)) and a[0].dtype in _LOW))
def cublaslt_bias_gelu(node, x, w, b=None):
    """cuBLASLt's GELU epilogue is the tanh form; for erf-GELU it is offered only at FP16/BF16,
    where the builder's check against the reference decides whether it is close enough."""
    return _typed(node, _addmm(x, w, b, use_gelu=True))


def _cublaslt_float(algo: int):
    """FusedGemm at FP16/BF16 on cuBLASLt's kernels that need no scratch, bias and activation in the epilogue, as
    one tactic per heuristic choice `algo`. torch's addmm (above) always offers cuBLASLt a workspace, and with one
    cuBLASLt picks, for BERT's GELU GEMM, a kernel that clears a buffer first: a memset node before every such
    GEMM in a CUDA graph, which delays the GEMM (see docs/design/cublaslt.md)."""

    def spec(node, rows, w, b):
        return cublaslt.spec_of(rows, w, b is not None, node.attr("activation", ""), False, rows.dtype)

    def applies(node, args):
        x, w = args[0], args[1]
        if not _gemm_ok(node, args, ("", "Relu", "GeluErf", "GeluTanh")) or x.dtype not in _LOW:
            return False
        base = storage_order(x)[0]
        # Any choice, not only `algo`: a runtime shape with fewer choices runs the last one (cublaslt._plan).
        return (cublaslt.aligned(base, w)
                and cublaslt.supported(spec(node, base.reshape(-1, base.shape[-1]), w, args[2]), x.device,
                                       workspace_cap=0))

    def run(node, x, w, b=None):
        def gemm(x):
            y = cublaslt.gemm(x.reshape(-1, x.shape[-1]), w, b, node.attr("activation", ""), algo)
            return y.reshape(*x.shape[:-1], w.shape[1])

        return _typed(node, _rowwise(gemm, x))

    return applies, run


for _algo in range(cublaslt.ALGOS):
    _applies, _run = _cublaslt_float(_algo)
    tactic("FusedGemm", "cublaslt_epilogue" + (f"_algo{_algo}" if _algo else "") + "_no_workspace", _applies,
           level=1 if _algo == 0 else 3)(_run)


@tactic("FusedGemm", "cublas_then_activation", lambda n, a: _gemm_ok(n, a, ("GeluErf", "GeluTanh", "Silu",
                                                                             "Sigmoid", "Tanh", "Clip", "LeakyRelu",
                                                                             "HardSwish")))
def cublas_then_activation(node, x, w, b=None):
    return _typed(node, activation(node.attr("activation", ""), _addmm(x, w, b), node.attr("activation_params", [])))


@tactic("FusedGemm", "cublas_matmul", lambda n, a: a[0].is_cuda and a[0].dim() >= 2 and (len(a) < 3 or a[2] is None)
        and n.attr("activation", "") == "" and a[0].dtype == a[1].dtype)
def cublas_matmul(node, x, w, b=None):
    """A GEMM with neither bias nor activation (projections exported without bias). Told to write FP32
    (an LM head's logits), cuBLAS writes them from its FP32 sums, FP16/BF16 operands in (torch.mm's out_dtype):
    no second pass over the logits to widen them."""
    if _fp32_gemm(node) and x.dtype in _LOW:
        return _rowwise(lambda x: _mm_fp32(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1]), x)
    return _typed(node, _rowwise(lambda x: torch.matmul(x, w), x))


def _mm_fp32(x, w):
    try:
        return torch.mm(x, w, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # a torch without mm's out_dtype (or a device without it)
        return torch.mm(x, w).float()


# --- PooledGemm (a CNN's head) -----------------------------------------------------
@tactic("PooledGemm", "mean_then_cublaslt", lambda n, a: a[0].dim() == 4 and _gemm_ok(n, a, ("", "Relu")))
def mean_then_cublaslt(node, x, w, b=None):
    """The unfused head's kernels: torch's mean over H and W, then cuBLASLt with its bias (+ ReLU) epilogue."""
    y = _addmm(x.mean(dim=(2, 3)), w, b, use_gelu=False if node.attr("activation", "") == "Relu" else None)
    return y.float() if writes_fp32(node) else y


# --- Attention ----------------------------------------------------------------
def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(node, q, k, v, mask=None, y_scale=None, qkv_scale=None):  # qkv_scale: declined (_attn_ok)
        if node.attr("k_transposed", 0):
            k = k.transpose(-1, -2)
        if mask is not None:
            mask = mask.to(q.dtype)
        with sdpa_kernel(chosen):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=node.attr("scale", None))
        out = torch.nan_to_num_(out, nan=0.0) if node.attr("nan_guard", 0) else out
        if y_scale is None:
            return out
        from ..kernels.rescale import to_8bit

        return to_8bit(out, y_scale, node.attr("qtype", "int8"))  # 8-bit output: one more pass

    return run


def _attn_ok(node, args, needs_no_mask=False, low_only=False):
    """SDPA takes float q, k, v (not an FP8 engine's codes, input 5's scale: the flash kernel reads those)."""
    q = args[0]
    mask = args[3] if len(args) > 3 else None
    return (q.is_cuda and q.dim() == 4 and q.dtype.is_floating_point and q.element_size() > 1
            and (mask is None or not needs_no_mask) and (q.dtype in _LOW or not low_only))


def _scores_bytes(node, args):
    q, v = args[0], args[2]
    return q.shape[0] * q.shape[1] * q.shape[2] * v.shape[2] * 4 * 2  # fp32 scores and probabilities


for _name, _kw in [("FLASH_ATTENTION", dict(needs_no_mask=True, low_only=True)),
                   ("EFFICIENT_ATTENTION", {}), ("CUDNN_ATTENTION", dict(low_only=True))]:
    tactic("Attention", f"sdpa_{_name.split('_')[0].lower()}",
           (lambda kw: lambda n, a: _attn_ok(n, a, **kw))(_kw))(_sdpa(_name))

tactic("Attention", "sdpa_math", lambda n, a: _attn_ok(n, a), workspace=_scores_bytes)(_sdpa("MATH"))
tactic("Attention", "unfused_matmul_softmax", lambda n, a: a[0].is_cuda, workspace=_scores_bytes)(attention)


# --- SkipLayerNorm ------------------------------------------------------------
@tactic("SkipLayerNorm", "add_then_layer_norm", lambda n, a: a[0].is_cuda)
def add_then_layer_norm(node, a, b, gamma, beta=None, q_scale=None, c=None):
    """The op's reference on torch's kernels, the 8-bit copy quantized by one kernel (kernels/rescale.py)."""
    from ..kernels.rescale import to_8bit

    y, s = skip_layer_norm(node, a, b, gamma, beta, None, c)
    return (y, s) + (() if q_scale is None else (to_8bit(y, q_scale, node.attr("qtype", "int8")),))


def gemm_without_activation(node, x, w, bias):
    """GemmSkipLayerNorm's GEMM on cuBLAS(Lt): the bias in the epilogue where the types allow it."""
    if bias is not None and _gemm_ok(node, [x, w, bias], ("",)):
        return cublaslt_bias(node, x, w, bias)
    y = cublas_matmul(node, x, w)
    return y if bias is None else y + bias


@tactic("GemmSkipLayerNorm", "cublaslt_then_layer_norm", lambda n, a: a[0].is_cuda and a[0].dim() >= 2)
def cublaslt_then_layer_norm(node, x, w, bias, skip, gamma, beta=None):
    return add_then_layer_norm(node, gemm_without_activation(node, x, w, bias), skip, gamma, beta)


# --- QGemm on cuBLASLt (INT8, FP8) ------------------------------------------------
def _int_mm_ok(node, args):
    x, w_q = args[0], args[1]
    if node.attr("qtype", "int8") != "int8":
        return False
    m = x.numel() // x.shape[-1]
    # cuBLASLt's int8 GEMM (torch._int_mm): M > 16, K and N multiples of 8.
    return x.is_cuda and m > 16 and x.shape[-1] % 8 == 0 and w_q.shape[1] % 8 == 0


@tactic("QGemm", "cublaslt_int8", _int_mm_ok)
def int8_int_mm(node, x, w_q, x_scale, w_scale, b=None, y_scale=None):
    """cuBLASLt's int8 GEMM to int32 sums, then scales, bias, activation and any re-quantization in one pass."""
    from ..kernels.rescale import rescale, to_8bit

    acc = torch._int_mm(to_8bit(x.reshape(-1, x.shape[-1]), x_scale, "int8"), w_q)
    y = rescale(acc, x_scale, w_scale, b, node.attr("activation", ""), node.attr("activation_params", []),
                y_scale, "int8", out_dtype=float_type(node, x))
    return y.reshape(*x.shape[:-1], w_q.shape[1])


def _scaled_mm_ok(node, args):
    x, w_q, _, w_scale = args[:4]
    # cuBLASLt FP8 GEMM (torch._scaled_mm): Ada/Hopper, K and N multiples of 16, one weight scale.
    return (x.is_cuda and node.attr("qtype", "int8") == "fp8" and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and x.shape[-1] % 16 == 0 and w_q.shape[1] % 16 == 0 and w_scale.numel() == 1)


@tactic("QGemm", "cublaslt_fp8", _scaled_mm_ok)
def fp8_scaled_mm(node, x, w_q, x_scale, w_scale, b=None, y_scale=None):
    """cuBLASLt's FP8 GEMM with the scales and bias in its epilogue; an activation or re-quantization after it
    in one more pass."""
    from ..kernels.rescale import rescale, to_8bit

    ft = float_type(node, x)
    out_dtype = ft if ft in _LOW else torch.float32
    bias = b.to(out_dtype) if b is not None and out_dtype != torch.float32 else None  # FP32 output takes no bias
    # cuBLASLt takes B column-major: a no-op for the engine's weights, stored so (kiln/builder/layout.py).
    y = torch._scaled_mm(to_8bit(x.reshape(-1, x.shape[-1]), x_scale, "fp8"), w_q.t().contiguous().t(),
                         scale_a=x_scale.float().reshape(()), scale_b=w_scale.float().reshape(()), bias=bias,
                         out_dtype=out_dtype)
    act = node.attr("activation", "")
    if act or y_scale is not None or (b is not None and bias is None) or y.dtype != ft:
        y = rescale(y, bias=b if bias is None else None, act=act, params=node.attr("activation_params", []),
                    y_scale=y_scale, qtype="fp8", out_dtype=ft)
    return y.reshape(*x.shape[:-1], w_q.shape[1])


def _as_fp8_gemm(node, args):
    """(x rows [M, K], weights [K, N], bias, y_scale) of an FP8 QGemm, or of an FP8 QConv that is a 1x1 convolution
    over channels-last pixels with no residual and one output; None for any other layer."""
    x, w, b, z, y_scale, q_scale, _ = layer_gemm.operands(node, args)
    if (not x.is_cuda or layer_gemm.qtype(node) != "fp8" or float_type(node, x) not in _LOW or z is not None
            or q_scale is not None):
        return None
    mats = layer_gemm.as_gemm(node, x, w)
    return None if mats is None else (mats[0].reshape(-1, mats[0].shape[-1]), mats[1], b, y_scale)


def _cublaslt_epilogue(algo: int, workspace_cap: int):
    """QGemm and 1x1 QConv on cuBLASLt's FP8 GEMM with the scales, bias, activation and any FP8 re-quantization
    all in its epilogue: one kernel where torch._scaled_mm needs a second pass for the last two
    (kernels/cublaslt.py). One tactic per heuristic choice `algo` among those needing at most workspace_cap
    bytes of scratch."""

    def spec(node, rows, w, b, y_scale):
        return cublaslt.spec_of(rows, w, b is not None, node.attr("activation", ""), y_scale is not None,
                                float_type(node, rows))

    def applies(node, args):
        gemm = _as_fp8_gemm(node, args)
        if gemm is None or args[2].numel() != 1 or args[3].numel() != 1:
            return False
        # Any choice, not only `algo`: a runtime shape away from the opt shape may have fewer (fp8_gemm then
        # runs its last one), and the float64 reference is no fallback. A shape with fewer times some twice.
        y_scale = gemm[3]
        return (y_scale is None or y_scale.numel() == 1) and cublaslt.supported(spec(node, *gemm), args[0].device,
                                                                                workspace_cap=workspace_cap)

    def run(node, *args):
        from ..kernels.conv import pixels_as_nchw
        from ..kernels.rescale import to_8bit

        x, x_scale, w_scale = args[0], args[2], args[3]
        rows, w, b, y_scale = _as_fp8_gemm(node, args)
        y = cublaslt.fp8_gemm(to_8bit(rows, x_scale, "fp8"), w.t().contiguous().t(), x_scale, w_scale, b,
                              node.attr("activation", ""), y_scale, float_type(node, x), algo, workspace_cap)
        return y.reshape(*x.shape[:-1], w.shape[1]) if node.op_type == "QGemm" else pixels_as_nchw(y, x)

    def workspace(node, args):
        return cublaslt.workspace_bytes(spec(node, *_as_fp8_gemm(node, args)), args[0].device, algo, workspace_cap)

    return applies, run, workspace


for _algo in range(cublaslt.ALGOS):
    for _cap, _suffix in ((cublaslt.MAX_WORKSPACE, ""), (0, "_no_workspace")):
        _applies, _run, _workspace = _cublaslt_epilogue(_algo, _cap)
        for _op in ("QGemm", "QConv"):
            tactic(_op, "cublaslt_fp8_epilogue" + (f"_algo{_algo}" if _algo else "") + _suffix, _applies,
                   workspace=_workspace, level=1 if _algo == 0 else 3)(_run)


def _cudnn_qconv(plan: int):
    """A QConv on cuDNN's graph API with its epilogue fused (kernels/cudnn_conv.py): cuDNN's heuristic choice
    `plan`. Needs the optional cudnn-frontend package."""

    def applies(node, args):
        x, w, b, z, y_scale, q_scale, _ = layer_gemm.operands(node, args)
        return (cudnn_conv.supports(node, x, w, b, z, q_scale, layer_gemm.qtype(node), args[3])
                and cudnn_conv.buildable(node, x, w, b, args[2], args[3], y_scale, float_type(node, x), plan))

    def run(node, *args):
        x, w, b, _, y_scale, _, _ = layer_gemm.operands(node, args)
        return cudnn_conv.conv2d(node, x, w, b, args[2], args[3], y_scale, float_type(node, x), plan)

    def workspace(node, args):
        x, w, b, _, y_scale, _, _ = layer_gemm.operands(node, args)
        return cudnn_conv.workspace_bytes(node, x, w, b, args[2], args[3], y_scale, float_type(node, x), plan)

    return applies, run, workspace


# Level 3 (the default): they win many of ResNet-50's 8-bit 3x3 layers (see docs/design/tactic-levels.md). They
# cost build time: cuDNN compiles each graph it times.
# Registered only with cudnn-frontend installed, so that loading an engine that needs them elsewhere is refused.
for _plan in range(cudnn_conv.PLANS if cudnn_conv.cudnn is not None else 0):
    _applies, _run, _workspace = _cudnn_qconv(_plan)
    tactic("QConv", f"cudnn_graph_plan{_plan}", _applies, workspace=_workspace, level=3)(_run)


# --- QGemm / QConv computed in float (any shape) ---------------------------------------------------
# The same quantized math (quantized activation, quantized weight, both scaled back) computed by a
# GEMM/convolution in the engine's float type (ops.fused.float_type): int8 values are exact in FP16, and
# this is the fallback wherever the integer and FP8 kernels do not apply. The reference sums in float64,
# which is slow on a GPU. A network's first layer reads the FP32 graph input but computes in FP16 in an
# FP16 engine: FP16's rounding of q * scale (2^-11 relative) is far below the 8-bit step, and sums stay
# FP32. An FP32 build keeps FP32: there FP16 rounding would flip the re-quantized output's rounding more
# often than the build's precision allows.
def _fake_quantized(node, x, x_scale, dt):
    """x quantized (here or by the layer before) and scaled back, in dt. INT8 in one kernel (torch's
    fake-quantize: round half to even, saturate), instead of the divide, round, clamp, cast and multiply
    kernels, one pass over the activation each; FP8 through those steps."""
    from ..ops.fused import quantize

    if node.attr("x_quantized", 0):  # the layer before quantized it already
        return x.to(dt) * x_scale.to(dt)
    if node.attr("qtype", "int8") == "int8":
        zero = torch.zeros((), dtype=torch.int32, device=x.device)
        return torch.fake_quantize_per_tensor_affine(x, x_scale.float().reshape(()), zero, -128, 127).to(dt)
    return quantize(node, x, x_scale).to(dt) * x_scale.to(dt)


@tactic("QGemm", "dequantized_gemm", lambda n, a: a[0].is_cuda)
def dequantized_gemm(node, x, w_q, x_scale, w_scale, b=None, y_scale=None):
    from ..ops.fused import quantized_output

    dt = float_type(node, x)
    y = torch.matmul(_fake_quantized(node, x, x_scale, dt), w_q.to(dt) * w_scale.to(dt))
    if b is not None:
        y = y + b.to(dt)
    return quantized_output(node, activation(node.attr("activation", ""), y, node.attr("activation_params", [])),
                            y_scale)


def _dequantized_conv(conv):
    """A QConv tactic computing in float: `conv(node, x, w, b, z)` (a FusedConv implementation, which applies
    the residual and activation) on the fake-quantized x and the dequantized weights."""
    def run(node, x, w_q, x_scale, w_scale, b=None, z=None, y_scale=None, q_scale=None, z_scale=None):
        from ..kernels.rescale import to_8bit
        from ..ops.fused import quantized_output, residual

        dt = float_type(node, x)
        wd = w_q.to(dt) * w_scale.to(dt).reshape(-1, *([1] * (w_q.dim() - 1)))
        y = conv(node, _fake_quantized(node, x, x_scale, dt), wd, b.to(dt) if b is not None else None,
                 residual(z, z_scale, dt) if z is not None else None)
        out = quantized_output(node, y, y_scale)
        return out if q_scale is None else (out, to_8bit(y, q_scale, node.attr("qtype", "int8")))

    return run


def _float_conv_args(args):
    """A QConv's (x, w_q, x_scale, w_scale, b, z, ...) as the FusedConv checks read them: (x, w, b, z)."""
    return [args[0], args[1], args[4] if len(args) > 4 else None, args[5] if len(args) > 5 else None]


dequantized_conv = _dequantized_conv(fused_conv)
tactic("QConv", "dequantized_conv", lambda n, a: a[0].is_cuda)(dequantized_conv)
# The same with cuDNN's fused bias + (residual +) ReLU epilogue: where the 8-bit kernels lose (a network's
# first layer, reading 3 channels), the ReLU pass over the output is saved (ResNet-50's stem: 25.7M values).
tactic("QConv", "dequantized_cudnn_conv_relu",
       lambda n, a: _cuda_conv(n, _float_conv_args(a), "Relu", residual=False))(_dequantized_conv(cudnn_conv_relu))
tactic("QConv", "dequantized_cudnn_conv_add_relu",
       lambda n, a: _cuda_conv(n, _float_conv_args(a), "Relu", residual=True))(_dequantized_conv(cudnn_conv_add_relu))
