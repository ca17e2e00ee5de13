"""Tiled GEMM with a fused epilogue: y = act(x @ w + b), one kernel, output written once.

x [M, K] (callers flatten leading batch dims), w [K, N] (kiln::FusedGemm stores weights
[K, N]), optional bias [N]. Any strides; FP32 accumulation on Tensor Cores (tl.dot).
FP16/BF16 inputs; FP32 inputs use TF32 only when asked (`precision="tf32"`), else exact
FP32 products (input_precision="ieee"). Program ids are swizzled in groups of GROUP_M
rows of tiles so neighbouring programs share tiles of w in L2.

Quantized layers (kiln::QGemm, QUANT "int8" / "fp8"): w is int8 / FP8 E4M3 [K, N]; x is read as
8-bit values, quantized first in one pass (kernels/rescale.py) when it arrives as floats, multiplied
on the 8-bit Tensor Cores (int32 / fp32 accumulator), and the epilogue applies x_scale * w_scale[n]
before the bias and activation (`finish`), then quantizes for the next layer if asked. Tiles
quantized in registers before the dot were miscompiled on sm_90 for some convolutions (Triton 3.6,
the whole output range off; tests/kernels/test_quantized.py runs ResNet-50's layer kinds on the
GPU), and an 8-bit tile read from memory is half the bytes of an FP16 one.

Reference: kiln.ops.fused.fused_gemm (torch.matmul + bias + activation); `reference` below;
kiln.ops.fused.qgemm for the quantized form.
The epilogue activations (`epilogue`) and the (de)quantization helpers are shared with the
convolution kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Activations the epilogue computes; names as kiln.ops.fused.activation spells them.
ACTIVATIONS = ("", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Silu", "HardSwish", "GeluErf", "GeluTanh", "Tanh")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # a quantized layer's qtype -> its weights' dtype
_INT32_MAX = 2**31 - 1


@triton.jit
def erf(x):
    """erf(x) in FP32 to within 1.5e-7 (Abramowitz & Stegun 7.1.26): fewer instructions than libdevice's erff,
    which a GELU epilogue runs on every output element with the whole accumulator tile live (see
    docs/design/small-kernels.md)."""
    a = tl.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    r = 1.0 - p * tl.exp(-a * a)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def epilogue(y, ACT: tl.constexpr, p0, p1):
    """act(y) in FP32; p0/p1 are the activation's parameters (LeakyRelu alpha, Clip bounds)."""
    if ACT == "Relu":
        y = tl.where(y > 0.0, y, 0.0)
    elif ACT == "LeakyRelu":
        y = tl.where(y >= 0.0, y, y * p0)
    elif ACT == "Clip":
        y = tl.minimum(tl.maximum(y, p0), p1)
    elif ACT == "Sigmoid":
        y = tl.sigmoid(y)
    elif ACT == "Silu":
        y = y * tl.sigmoid(y)
    elif ACT == "HardSwish":
        y = y * tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0) * (1.0 / 6.0)
    elif ACT == "GeluErf":
        y = 0.5 * y * (1.0 + erf(y * 0.7071067811865476))
    elif ACT == "GeluTanh":  # tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = y * tl.sigmoid(2.0 * u)  # 0.5 * y * (1 + tanh(u))
    elif ACT == "Tanh":
        y = 2.0 * tl.sigmoid(2.0 * y) - 1.0
    return y


def relu_in_quantize(act: str, y_quantized: bool) -> bool:
    """Whether a kernel leaves its ReLU to `quantize(..., RELU=True)`: a ReLU before an 8-bit output."""
    return act == "Relu" and y_quantized


@triton.jit
def quantize(a, xs_ptr, QUANT: tl.constexpr, RELU: tl.constexpr = False):
    """A float tile quantized in registers with the per-tensor scale *xs_ptr (QUANT "int8" / "fp8", as
    kiln.ops.fused.quantize does), or `a` as is (QUANT ""). RELU: quantize relu(a), exactly, with the ReLU done
    by the saturation's lower bound (0 instead of the type's minimum; scales are positive): one instruction less
    per value (sm_90 SASS of the TMA GEMM's 128x128 INT8 tile with residual, 8-bit output and copy: 2785 -> 2657)."""
    if QUANT != "":
        # x * (1/sx) rather than x / sx: a division per element would dominate an ALU-bound pass. It can
        # differ from the reference's quotient by an ulp, moving a value within an ulp of a rounding tie by
        # one quantization step (never when sx is a power of two).
        v = a.to(tl.float32) * (1.0 / tl.load(xs_ptr).to(tl.float32))
        if QUANT == "int8":
            # saturate first: round(clamp(v)) == clamp(round(v))
            v = tl.minimum(tl.maximum(v, 0.0 if RELU else -128.0), 127.0)
            # Round half to even like torch.round: adding 1.5 * 2**23 makes the FP32 adder round v to an integer
            # (to nearest even) and leaves it in the low mantissa bits, read out as int8 without a float->int
            # conversion. libdevice.rint would do on the GPU but does not run in Triton's interpreter.
            a = (v + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
        else:
            # Saturate to E4M3's largest finite value, then round to nearest even (cvt.rn.satfinite on sm_89+).
            a = tl.minimum(tl.maximum(v, 0.0 if RELU else -448.0), 448.0).to(tl.float8e4nv)
    return a


@triton.jit
def dequant_scale(cols, xs_ptr, ws_ptr, stride_ws):
    """A quantized layer's dequantization scale for output columns `cols`: x_scale * w_scale[cols], in FP32."""
    return tl.load(xs_ptr).to(tl.float32) * tl.load(ws_ptr + cols * stride_ws).to(tl.float32)


@triton.jit
def finish(acc, z, cols, b_ptr, xs_ptr, ws_ptr, ys_ptr, zs_ptr, stride_ws, p0, p1, Y_DTYPE: tl.constexpr,
           HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
           Y_QUANTIZED: tl.constexpr, Z_SCALED: tl.constexpr, RELU: tl.constexpr, scale=None, bias=None):
    """Every GEMM and convolution kernel's epilogue, up to its store: the accumulator dequantized (quantized layers:
    x_scale * w_scale[cols]), plus bias[cols] and the residual tile z, activated. Returns (the output as Y_DTYPE,
    quantized with *ys_ptr when the next layer reads 8-bit values (Y_QUANTIZED: quantized here instead of by it);
    the FP32 result, for `copy`). RELU: the ReLU is left to the quantization's clamp (relu_in_quantize).
    scale, bias: those column vectors as `columns` loaded them ahead, else they are loaded here."""
    if QUANT != "":
        if scale is None:
            scale = dequant_scale(cols, xs_ptr, ws_ptr, stride_ws)
        acc = acc.to(tl.float32) * scale[None, :]
    if HAS_BIAS:
        if bias is None:
            bias = tl.load(b_ptr + cols).to(tl.float32)
        acc += bias[None, :]
    if HAS_Z:
        acc += residual(z, zs_ptr, Z_SCALED)
    if not RELU:
        acc = epilogue(acc, ACT, p0, p1)
    out = quantize(acc, ys_ptr, QUANT, RELU).to(Y_DTYPE) if Y_QUANTIZED else acc.to(Y_DTYPE)
    return out, acc


@triton.jit
def columns(cols, b_ptr, xs_ptr, ws_ptr, stride_ws, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr):
    """`finish`'s column vectors loaded ahead, in FP32: the dequantization scale x_scale * w_scale[cols] and
    bias[cols] (each unused where the layer has none). Loaded by `finish` after the K loop, they keep a tile's
    warps waiting as its epilogue begins (long-scoreboard stalls in Nsight Compute, bench/ncu_layers.py);
    loaded before it, the MMAs hide that wait but the vectors hold registers through the loop
    (tma_gemm's EARLY_COLUMNS says where that pays)."""
    scale = cols.to(tl.float32)
    if QUANT != "":
        scale = dequant_scale(cols, xs_ptr, ws_ptr, stride_ws)
    bias = scale
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols).to(tl.float32)
    return scale, bias


@triton.jit
def copy(acc, out, qs_ptr, Q_DTYPE: tl.constexpr, QUANT: tl.constexpr, Y_QUANTIZED: tl.constexpr,
         RELU: tl.constexpr):
    """`finish`'s 8-bit copy for quantized readers (*qs_ptr's scale), made from the stored float values as they
    would quantize them, or from the FP32 result when the output itself is 8-bit (a residual at its own scale
    beside a copy at the next layer's, builder/quantized_io.py). Kernels compute it after storing the output: both
    computed first took more code (sm_90 SASS of the FP8 TMA GEMM with residual, 8-bit output and copy: 11165
    instructions against 10545)."""
    return quantize(acc if Y_QUANTIZED else out, qs_ptr, QUANT, RELU).to(Q_DTYPE)


@triton.jit
def residual(z, zs_ptr, Z_SCALED: tl.constexpr):
    """A residual tile in FP32: an 8-bit one (a quantized block's output, builder/quantized_io.py) times its
    scale *zs_ptr, a float one as it is."""
    z = z.to(tl.float32)
    if Z_SCALED:
        z = z * tl.load(zs_ptr).to(tl.float32)
    return z


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, z_ptr, y_ptr, xs_ptr, ws_ptr, ys_ptr, qs_ptr, q_ptr, zs_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wk, stride_wn, stride_zm, stride_zn, stride_ym, stride_yn, stride_ws,
                 p0, p1, HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
                 EVEN_K: tl.constexpr,
                 QUANT: tl.constexpr, Y_QUANTIZED: tl.constexpr, COPY: tl.constexpr, Z_SCALED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M swizzle: walk GROUP_M tile-rows down a column of tiles before moving right.
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge load a valid (wrapped) row instead of masking; the store masks them.
    ram = rm % M
    rbn = rn % N
    x_ptrs = x_ptr + ram[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rk[:, None] * stride_wk + rbn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if QUANT == "int8" else tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
        # out_dtype names the accumulator (int32 for int8): Triton 3.6 does not infer it.
        acc = tl.dot(a, b, acc, input_precision=PREC, out_dtype=acc.dtype)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # a residual: a 1x1 convolution's shortcut, see conv.pointwise_as_gemm
    z = tl.load(z_ptr + ram[:, None] * stride_zm + rbn[None, :] * stride_zn) if HAS_Z else None
    out, acc = finish(acc, z, rbn, b_ptr, xs_ptr, ws_ptr, ys_ptr, zs_ptr, stride_ws, p0, p1, y_ptr.dtype.element_ty,
                      HAS_BIAS, HAS_Z, ACT, QUANT, Y_QUANTIZED, Z_SCALED, False)
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, out, mask=inside)
    if COPY:  # [M, N] contiguous
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], copy(acc, out, qs_ptr, q_ptr.dtype.element_ty, QUANT,
                                                             Y_QUANTIZED, False), mask=inside)


@dataclass(frozen=True)
class TileConfig:
    """A tiled kernel's configuration (the implicit-GEMM convolution uses it too: M = output
    pixels, N = output channels, K = the reduction slice)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}"

    def smem_bytes(self, itemsize: int, w_itemsize: int | None = None) -> int:
        """Shared memory the software pipeline holds: num_stages tiles of x and of w (w_itemsize: 8-bit weights)."""
        w_itemsize = itemsize if w_itemsize is None else w_itemsize
        return self.num_stages * (self.block_m * self.block_k * itemsize + self.block_k * self.block_n * w_itemsize)


# (config, lowest optimization level that tries it). Level 3 covers big square GEMMs (batch 32),
# medium ones and skinny-M ones (batch 1); levels 4-5 widen the search.
CONFIGS: list[tuple[TileConfig, int]] = [
    (TileConfig(128, 128, 64, 4, 3), 3),
    (TileConfig(128, 256, 64, 8, 3), 3),
    (TileConfig(64, 128, 64, 4, 3), 3),
    (TileConfig(32, 64, 128, 4, 4), 3),
    (TileConfig(128, 128, 32, 4, 4), 4),
    (TileConfig(128, 64, 32, 4, 4), 4),
    (TileConfig(64, 256, 32, 4, 4), 4),
    (TileConfig(16, 64, 128, 4, 4), 4),
    (TileConfig(128, 128, 64, 8, 5), 5),
    (TileConfig(256, 128, 64, 8, 3), 5),
    (TileConfig(64, 64, 64, 4, 3), 5),
    (TileConfig(64, 32, 32, 2, 5), 5),
]


# Quantized (QGemm) configurations, offered at their own level (triton_gemm registers them unshifted: the
# INT8/FP8 layers have no other integer kernel for many shapes). BLOCK_K >= 32: 8-bit Tensor Core dots.
QUANT_CONFIGS: list[tuple[TileConfig, int]] = [
    (TileConfig(128, 128, 64, 8, 3), 3),
    (TileConfig(64, 128, 128, 4, 4), 3),
    (TileConfig(128, 256, 64, 8, 3), 3),  # wide tiles: BERT's batch-32 GEMMs on Hopper's 8-bit wgmma
    (TileConfig(128, 256, 128, 8, 3), 3),
    (TileConfig(32, 64, 128, 4, 4), 4),
    (TileConfig(128, 128, 128, 8, 3), 4),
    (TileConfig(128, 128, 64, 4, 3), 5),
    (TileConfig(16, 64, 256, 4, 4), 5),
]


def dot_precision(dtype: torch.dtype, precision: str, qtype: str = "") -> str:
    """tl.dot's input_precision: exact FP32 products ("ieee") for FP32 operands unless the layer allows TF32.

    16-bit operands, and the 8-bit ones of quantized layers (whatever x's dtype), get Triton's default
    ("tf32"), which only concerns FP32 operands.
    """
    return "ieee" if dtype == torch.float32 and precision != "tf32" and not qtype else "tf32"


def operand_dtypes_ok(x: torch.Tensor, w: torch.Tensor, qtype: str = "") -> bool:
    """FP16/BF16/FP32 x; w of x's dtype, or (qtype "int8" / "fp8") int8 / FP8 E4M3 weights, with x
    float or already quantized to the same type."""
    if qtype:
        return x.dtype in (*DTYPES, QTYPES.get(qtype)) and w.dtype == QTYPES.get(qtype)
    return x.dtype in DTYPES and w.dtype == x.dtype


def residual_ok(z: torch.Tensor, qtype: str = "") -> bool:
    """A residual the kernels add: floats, or a quantized layer's 8-bit values of its qtype (read with a scale)."""
    return z.dtype.is_floating_point or (bool(qtype) and z.dtype == QTYPES.get(qtype))


def scales_ok(x_scale, w_scale, n: int, device: torch.device) -> bool:
    """A quantized layer's scales: one float x_scale, one or n float w_scale values, on the kernel's device."""
    return all(isinstance(s, torch.Tensor) and s.dtype.is_floating_point and s.device == device
               for s in (x_scale, w_scale)) and x_scale.numel() == 1 and w_scale.numel() in (1, n)


def supports(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str, qtype: str = "") -> bool:
    """What the kernel handles: x [M, K] (or batched [.., K]), w [K, N], bias of N elements."""
    return (x.dim() >= 2 and w.dim() == 2 and x.shape[-1] == w.shape[0] and operand_dtypes_ok(x, w, qtype)
            and act in ACTIVATIONS and x.device == w.device
            and x.numel() > 0 and w.numel() > 0
            and (b is None or (b.numel() == w.shape[1] and b.dtype.is_floating_point and b.device == x.device))
            and max(x.numel(), w.numel(), x.numel() // x.shape[-1] * w.shape[1]) <= _INT32_MAX)


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, act: str = "", params=(),
         config: TileConfig = CONFIGS[0][0], precision: str = "float32", out: torch.Tensor | None = None,
         qtype: str = "", x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
         y_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, z: torch.Tensor | None = None,
         q_scale: torch.Tensor | None = None, z_scale: torch.Tensor | None = None):
    """act(x @ w + b [+ z]) for x [.., K], w [K, N], z of the output's shape (8-bit with z_scale); returns
    [.., N] in x's dtype (written into `out` if given), and with q_scale also its 8-bit copy (y, q).

    qtype "int8" / "fp8": a QGemm, act(x_scale * w_scale * (q(x) @ w) + b) with w the quantized weights;
    x may arrive quantized already (int8 / FP8), the output is out_dtype (a float type), or quantized
    with y_scale.
    """
    lead = x.shape[:-1]
    K, N = w.shape
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y_dtype = QTYPES[qtype] if y_scale is not None else out_dtype or x.dtype
    y = out if out is not None else torch.empty((M, N), dtype=y_dtype, device=x.device)
    y2 = y.view(M, N)
    q = torch.empty((M, N), dtype=QTYPES[qtype], device=x.device) if q_scale is not None else y2
    p0, p1 = _params(act, params)
    bias = b.reshape(-1) if b is not None else None
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    z2 = z.reshape(M, N) if z is not None else None
    x2, xs, ws, stride_ws = quant_args(x2, qtype, x_scale, w_scale)
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
    _gemm_kernel[grid](
        x2, w, bias if bias is not None else x2, z2 if z2 is not None else x2, y2, xs, ws,
        y_scale if y_scale is not None else xs, q_scale if q_scale is not None else xs, q,
        z_scale if z_scale is not None else xs, M, N, K,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), *(z2.stride() if z2 is not None else (0, 0)),
        y2.stride(0), y2.stride(1), stride_ws, p0, p1,
        HAS_BIAS=bias is not None, HAS_Z=z2 is not None, ACT=act, PREC=dot_precision(x.dtype, precision, qtype),
        EVEN_K=K % config.block_k == 0, QUANT=qtype, Y_QUANTIZED=y_scale is not None, COPY=q_scale is not None,
        Z_SCALED=z_scale is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y2.view(*lead, N) if q_scale is None else (y2.view(*lead, N), q.view(*lead, N))


def quant_args(x: torch.Tensor, qtype: str, x_scale, w_scale) -> tuple:
    """The kernels' (x, x_scale, w_scale, w_scale stride) arguments: x as 8-bit values for a quantized layer
    (quantized here in one pass if it arrives as floats); unused scale placeholders for float layers."""
    if not qtype:
        return x, x, x, 0
    if qtype not in QTYPES or x_scale is None or w_scale is None:
        raise ValueError(f"a quantized kernel needs qtype int8/fp8 and both scales, got {qtype!r}")
    from .rescale import to_8bit

    w_scale = w_scale.reshape(-1)
    stride_ws = w_scale.stride(0) if w_scale.numel() > 1 else 0  # one scale: read with stride 0
    return to_8bit(x, x_scale, qtype), x_scale, w_scale, stride_ws


def _params(act: str, params) -> tuple[float, float]:
    params = list(params or [])
    if act == "LeakyRelu":
        return float(params[0] if params else 0.01), 0.0
    if act == "Clip":
        return float(params[0]), float(params[1])
    return 0.0, 0.0


def reference(x, w, b=None, act: str = "", params=()):
    from ..ops.fused import activation

    y = torch.matmul(x.float(), w.float())
    if b is not None:
        y = y + b.float().reshape(-1)
    return activation(act, y, list(params)).to(x.dtype)
