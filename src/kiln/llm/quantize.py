"""Weight quantization of the decoder's linear layers, and the matrix multiply of each format.

Formats (`--weights`):
- fp8       FP8 E4M3 codes, one FP32 scale per output channel (amax / 448). On CUDA, a decode step's few rows
            (at most GEMV_MAX_M) go through kiln.kernels.fp8_gemv (weight-only: activations are not quantized,
            codes and activations meet in an FP16 dot, so the step reads one byte a weight); more rows quantize the
            activations per token to FP8 (kiln.kernels.fp8_rows, one kernel) for torch._scaled_mm
            (row-wise scales). Dequantized weights elsewhere.
- int8      INT8 weight-only, one scale per output channel (amax / 127). On CUDA, few rows run the same
            weight-only GEMV as fp8; otherwise the weight is dequantized for the matmul (the arithmetic stays
            in the model's float type).
- w8a8      SmoothQuant: per input channel j, s_j = amax|x_j|^alpha / amax|W_:,j|^(1 - alpha) (alpha 0.5,
            activation maxima from calibration) moves quantization difficulty from activations to weights;
            W * s is INT8 per output channel, activations x / s are INT8 per token at run time
            (torch._int_mm on CUDA where the shapes allow; an exact-integer FP32 product elsewhere).
- int4-awq  AWQ: 4-bit asymmetric codes in groups of 128 input channels (the last group of a row may be
            shorter) with an FP32 scale and a 4-bit zero per group, two codes a byte. Before rounding, the
            weight's input channels are multiplied by s = mean|x|^r (r searched on calibration activations to
            minimise the layer's output error) and the activations divided by s at run time. On CUDA, few rows
            run the weight-only GEMV over the 4-bit codes (dequantized in registers, a group per K step).

A `QuantizedWeight` stands exactly where the float weight [out, in] of an `F.linear` stood: the model keeps
calling `F.linear(x, w, bias)` and the tensor's `__torch_function__` runs the quantized matmul. Its own storage
is the codes, so counting a weight's bytes counts what a step reads.

Float matrices (`none`, and the LM head of every format) take the same route on CUDA through `DecodeWeight`
(`use_decode_gemv`): a decode step's few rows go to kiln.kernels.bf16_gemv where it beat cuBLAS on this device
for that shape and row count (timed once per shape when the engine is built), to torch's matmul otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError

METHODS = ("none", "fp8", "int8", "w8a8", "int4-awq")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
INT4_GROUP = 128
SMOOTH_ALPHA = 0.5
AWQ_GRID = 20
DECODE_GEMV_MIN_BYTES = 4 << 20  # float matrices smaller than this stay with cuBLAS (launch-bound either way)
GEMV_MAX_M = 16  # rows up to which the weight-only GEMV beats a GEMM on these weights (fp8, int8, int4) on CUDA
# The decoder's matrices (model.py's layer dict keys); embeddings, norms and the LM head stay in float.
LINEAR_KEYS = ("qkv", "o", "gate_up", "down", "fc", "proj")


class _OwnLinear(torch.Tensor):
    """A weight whose `F.linear` runs its own matmul_into(x, bias); every other op sees a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is F.linear:
                return args[1].matmul_into(args[0], args[2] if len(args) > 2 else kwargs.get("bias"))
            return func(*args, **kwargs)


class QuantizedWeight(_OwnLinear):
    """A quantized [out_features, in_features] weight that `F.linear` multiplies in its own format.

    codes: fp8 / int8 [out, in], or uint8 [out, ceil(in / 128) * 64] for int4 (low nibble = even column).
    scale: FP32 [out] (fp8, int8, w8a8) or [out, groups] (int4). zero: uint8 [out, groups] (int4).
    input_scale: FP32 [in] that multiplies x before the matmul (w8a8: 1 / s, int4-awq: 1 / s), else None.
    """

    @staticmethod
    def __new__(cls, codes: torch.Tensor, *, method: str, scale: torch.Tensor, in_features: int,
                zero: torch.Tensor | None = None, input_scale: torch.Tensor | None = None):
        t = torch.Tensor._make_subclass(cls, codes, False)
        t.codes, t.method, t.scale, t.zero, t.input_scale = codes, method, scale, zero, input_scale
        t.in_features, t.out_features = in_features, codes.shape[0]
        return t

    def __repr__(self):
        return (f"QuantizedWeight({self.method}, [{self.out_features}, {self.in_features}], "
                f"codes {self.codes.dtype} on {self.codes.device})")

    # --- the parts a file stores -------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        parts = {"codes": self.codes, "scale": self.scale}
        if self.zero is not None:
            parts["zero"] = self.zero
        if self.input_scale is not None:
            parts["input_scale"] = self.input_scale
        return parts

    @classmethod
    def from_tensors(cls, method: str, in_features: int, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        return cls(parts["codes"], method=method, scale=parts["scale"], in_features=in_features,
                   zero=parts.get("zero"), input_scale=parts.get("input_scale"))

    def to_device(self, device) -> QuantizedWeight:
        def move(t):
            return None if t is None else t.to(device)

        return QuantizedWeight(move(self.codes), method=self.method, scale=move(self.scale),
                               in_features=self.in_features, zero=move(self.zero),
                               input_scale=move(self.input_scale))

    # --- arithmetic ----------------------------------------------------------------------------------------

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The float weight [out, in] these codes stand for."""
        if self.method == "int4-awq":
            w = dequantize_int4(self.codes, self.scale, self.zero, self.in_features)
        else:
            w = self.codes.float() * self.scale[:, None]
        if self.input_scale is not None:  # the stored weight is W * s; W is that divided by s
            w = w * self.input_scale[None, :]
        return w.to(dtype)

    def matmul_into(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias) in x's dtype."""
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if _gemv_fits(x2, self):
            from kiln.kernels import fp8_gemv as gemv

            if self.method == "int4-awq":
                y = gemv.int4_gemv(x2, self.codes, self.scale, self.zero, self.input_scale, INT4_GROUP)
            else:
                y = gemv.fp8_gemv(x2, self.codes, self.scale)
        elif self.method == "fp8" and _scaled_mm_fits(x2, self):
            y = _fp8_matmul(x2, self)
        elif self.method == "w8a8":
            y = _w8a8_matmul(x2, self)
        else:
            xs = x2 if self.input_scale is None else x2 * self.input_scale.to(x2.dtype)
            stored = (dequantize_int4(self.codes, self.scale, self.zero, self.in_features)
                      if self.method == "int4-awq" else self.codes.to(torch.float32) * self.scale[:, None])
            y = F.linear(xs, stored.to(x2.dtype))
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


class DecodeWeight(_OwnLinear):
    """A float [out, in] weight whose `F.linear` runs kiln.kernels.bf16_gemv for at most `gemv_rows` rows on
    CUDA (the rows up to which that kernel beat cuBLAS for this shape here), torch's matmul otherwise."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor, gemv_rows: int):
        t = torch.Tensor._make_subclass(cls, weight, False)
        t.gemv_rows = gemv_rows
        return t

    def matmul_into(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, self, bias): the GEMV for few enough rows on CUDA, torch's matmul otherwise."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= self.gemv_rows and x.is_cuda and x.dtype == self.dtype:
            from kiln.kernels.bf16_gemv import bf16_gemv

            y = bf16_gemv(x2, self)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.reshape(*x.shape[:-1], self.shape[0])
        with torch._C.DisableTorchFunctionSubclass():  # called directly too: F.linear must not come back here
            return F.linear(x, self, bias)

    def __repr__(self):
        return f"DecodeWeight([{self.shape[0]}, {self.shape[1]}], {self.dtype}, GEMV up to {self.gemv_rows} rows)"


def use_decode_gemv(model) -> dict[str, int]:
    """Wrap the decoder's float matrices and its LM head in DecodeWeight where bf16_gemv beats cuBLAS on this
    device (CUDA, BF16/FP16 weights): returns {key: rows} of the wrapped ones ('lm_head' for the head). A
    no-op elsewhere; quantized matrices keep their own GEMV."""
    from kiln.kernels.bf16_gemv import DTYPES, gemv_rows

    if model.device.type != "cuda" or model.dtype not in DTYPES:
        return {}
    chosen = {}

    def wrap(w):
        if (isinstance(w, (QuantizedWeight, DecodeWeight)) or w.dtype not in DTYPES or w.dim() != 2
                or w.numel() * w.element_size() < DECODE_GEMV_MIN_BYTES):
            return w, 0
        rows = gemv_rows(w.shape[0], w.shape[1], w.dtype, w.device, w)
        return (DecodeWeight(w, rows) if rows else w), rows

    for key, w in linear_weights(model).items():
        new, rows = wrap(w)
        if rows:
            set_linear_weight(model, key, new)
            chosen[key] = rows
    head, rows = wrap(model.lm_head)
    if rows:
        model.lm_head = head
        chosen["lm_head"] = rows
    return chosen


def _gemv_fits(x: torch.Tensor, w: QuantizedWeight) -> bool:
    return (w.method in ("fp8", "int8", "int4-awq") and x.is_cuda and x.shape[0] <= GEMV_MAX_M
            and x.dtype in (torch.bfloat16, torch.float16))


def _scaled_mm_fits(x: torch.Tensor, w: QuantizedWeight) -> bool:
    return (x.is_cuda and hasattr(torch, "_scaled_mm") and x.dtype in (torch.bfloat16, torch.float16)
            and w.in_features % 16 == 0 and w.out_features % 16 == 0)


def _fp8_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    from kiln.kernels import fp8_rows

    # per-token scales amax / 448: one kernel on CUDA, torch's form of it elsewhere
    xq, sx = fp8_rows.quantize_rows(x) if x.is_cuda else fp8_rows.reference(x)
    # _scaled_mm wants the second operand column-major: the row-major codes' transpose is exactly that.
    return torch._scaled_mm(xq, w.codes.t(), scale_a=sx, scale_b=w.scale[None, :].float(), out_dtype=x.dtype)


def _w8a8_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    xs = x.float() * w.input_scale
    sx = (xs.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(1e-12)
    xq = torch.round(xs / sx).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    if x.is_cuda and xq.shape[0] > 16 and w.in_features % 8 == 0 and w.out_features % 8 == 0:
        acc = torch._int_mm(xq, w.codes.t()).float()
    else:  # integer products summed in FP32: exact while |sum| < 2^24, within rounding beyond
        acc = xq.float() @ w.codes.float().t()
    return (acc * sx * w.scale[None, :]).to(x.dtype)


# --- quantizers ----------------------------------------------------------------------------------------------


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return QuantizedWeight(codes, method="fp8", scale=scale, in_features=w.shape[1])


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12)
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    codes, scale = _int8_per_channel(w.float())
    return QuantizedWeight(codes, method="int8", scale=scale, in_features=w.shape[1])


def smoothing_factors(w: torch.Tensor, act_absmax: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel s = amax|x|^alpha / amax|W|^(1 - alpha)."""
    w_absmax = w.float().abs().amax(dim=0).clamp_min(1e-5)
    s = act_absmax.float().clamp_min(1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return s.clamp_min(1e-5)


def quantize_w8a8(w: torch.Tensor, act_absmax: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> QuantizedWeight:
    w = w.float()
    s = smoothing_factors(w, act_absmax, alpha)
    codes, scale = _int8_per_channel(w * s[None, :])
    return QuantizedWeight(codes, method="w8a8", scale=scale, in_features=w.shape[1], input_scale=1.0 / s)


def _pad_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    pad = -w.shape[1] % group
    return F.pad(w, (0, pad)) if pad else w


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of w [out, in] in groups of `group` input channels: (packed uint8
    [out, padded_in / 2], scale FP32 [out, groups], zero uint8 [out, groups]). Padding columns are zeros."""
    out, n = w.shape
    wp = _pad_groups(w.float(), group)
    g = wp.reshape(out, -1, group)
    valid = _group_valid(n, g.shape[1], group, w.device)  # padding must not widen a short last group's range
    lo = torch.where(valid, g, torch.inf).amin(dim=2).clamp(max=0)
    hi = torch.where(valid, g, -torch.inf).amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8).reshape(out, -1)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), scale.float(), zero.to(torch.uint8)


def _group_valid(n: int, groups: int, group: int, device) -> torch.Tensor:
    return (torch.arange(groups * group, device=device) < n).reshape(1, groups, group)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int) -> torch.Tensor:
    out = packed.shape[0]
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(out, -1)
    groups = scale.shape[1]
    g = q.reshape(out, groups, -1).float()
    w = (g - zero[..., None].float()) * scale[..., None]
    return w.reshape(out, -1)[:, :in_features]


def quantize_int4_awq(w: torch.Tensor, act_sample: torch.Tensor, group: int = INT4_GROUP,
                      grid: int = AWQ_GRID) -> QuantizedWeight:
    """AWQ: search the activation-aware scale exponent r on calibration inputs act_sample [N, in]."""
    w = w.float()
    x = act_sample.float()
    x_mean = x.abs().mean(dim=0).clamp_min(1e-6)
    reference = x @ w.t()
    best = None
    for i in range(grid + 1):
        r = i / grid
        s = x_mean.pow(r)
        s = s / (s.max() * s.min()).sqrt()  # keep the scaled weight's range centred
        packed, scale, zero = quantize_int4(w * s[None, :], group)
        wq = dequantize_int4(packed, scale, zero, w.shape[1]) / s[None, :]
        err = (x @ wq.t() - reference).pow(2).mean().item()
        if best is None or err < best[0]:
            best = (err, s, packed, scale, zero)
    _, s, packed, scale, zero = best
    return QuantizedWeight(packed, method="int4-awq", scale=scale, in_features=w.shape[1], zero=zero,
                           input_scale=(1.0 / s).float())


def needs_calibration(method: str) -> bool:
    return method in ("w8a8", "int4-awq")


def quantize_weight(w: torch.Tensor, method: str, stats=None) -> QuantizedWeight:
    """One [out, in] weight in `method`; stats (calibrate.ActivationStats of its input) for w8a8 and int4-awq."""
    if method == "fp8":
        return quantize_fp8(w)
    if method == "int8":
        return quantize_int8(w)
    if method in ("w8a8", "int4-awq") and stats is None:
        raise ConfigError(f"--weights {method} needs calibration activations: give --calib TEXT.")
    # Calibration may have run on another device than the one the weights sit on.
    if method == "w8a8":
        return quantize_w8a8(w, stats.absmax.to(w.device))
    if method == "int4-awq":
        return quantize_int4_awq(w, stats.sample.to(w.device))
    raise ConfigError(f"--weights {method!r} is not one of {', '.join(METHODS)}.")


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ConfigError(f"--weights {method!r} is not one of {', '.join(METHODS)}.")
    return method


def linear_weights(model) -> dict[str, torch.Tensor]:
    """The decoder's quantizable matrices, keyed 'layers.N.<key>' (model.py's layer dicts)."""
    return {f"layers.{n}.{k}": layer[k] for n, layer in enumerate(model.layers) for k in LINEAR_KEYS if k in layer}


def set_linear_weight(model, key: str, w) -> None:
    _, n, k = key.split(".")
    model.layers[int(n)][k] = w


def quantize_model(model, method: str, stats: dict | None = None, on_matrix=None) -> dict[str, QuantizedWeight]:
    """Replace every decoder matrix of `model` (a kiln.llm.model.DecoderModel) by its `method` form, in place;
    returns them by key. stats: {key: ActivationStats} from calibrate.activation_stats (w8a8, int4-awq).
    on_matrix(key, done, total): called after each matrix (a progress display)."""
    check_method(method)
    if method == "none":
        return {}
    out = {}
    matrices = linear_weights(model)
    for key, w in matrices.items():
        q = quantize_weight(w, method, (stats or {}).get(key) if needs_calibration(method) else None)
        q = q.to_device(w.device)
        set_linear_weight(model, key, q)
        out[key] = q
        if on_matrix is not None:
            on_matrix(key, len(out), len(matrices))
    return out


def install(model, weights: dict[str, QuantizedWeight]) -> None:
    """Put stored quantized weights (from an engine file) into `model`, on its device."""
    current = linear_weights(model)
    for key, q in weights.items():
        if key not in current:
            raise ConfigError(f"quantized weight '{key}' does not belong to this model.")
        if (q.out_features, q.in_features) != tuple(current[key].shape):
            raise ConfigError(f"quantized weight '{key}' is [{q.out_features}, {q.in_features}], the model's is "
                              f"{list(current[key].shape)}.")
        set_linear_weight(model, key, q.to_device(model.device))
