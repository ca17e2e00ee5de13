"""INT4 weight-only quantization: group-wise scales, an AWQ-style scale search, packed storage.

    q = quantize_weight(w_kn, group_size=128, symmetric=True)      # w as x @ w: [K, N]
    y = q.matmul(x)                                                # dequantizing GEMM (Triton on CUDA)
    q, found = quantize_awq(w_kn, x_calib, group_size=64)          # AWQ: per-input-channel scaling
    print(found.alpha, found.error_reduction)
    report = quantize_module(net, x_calib, group_size=32)          # every nn.Linear -> Int4Linear

Storage (what kiln.kernels.int4_gemm reads): codes u in 0..15 packed two per byte
along K ([ceil(K/2), N] uint8, k = 2r in the low nibble of row r), FP32 scales
[G, N] per group of `group_size` consecutive input channels, and for asymmetric
quantization a zero-point code per group ([G, N] uint8). Symmetric: q = u - 8,
scale = max|w| / 7 over the group. Asymmetric: scale = (max - min) / 15 over the
group, zero = round(-min / scale).

AWQ (Lin et al., "Activation-aware Weight Quantization"): input channels with
large activations matter most; scaling them up before rounding protects them.
For s = mean|X|^alpha (normalized so that sqrt(max s * min s) = 1) the layer
computes (X / s) @ Q(diag(s) W); the search tries alpha on a grid in [0, 1]
(alpha = 0 is plain rounding) and keeps the one with the smallest output error
||X W - (X / s) Q(diag(s) W)||. 1/s is kept as the layer's `in_scale`, which
the GEMM applies to x on load (or which can be folded into the previous layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels import int4_gemm as _k
from ..ops.int4 import pack as pack_int4

GROUP_SIZES = (32, 64, 128)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_int4: codes [k, N] (int16)."""
    return _k.unpack(packed, k)


@dataclass
class Int4Weight:
    """A packed INT4 weight of logical shape [K, N] (x @ W)."""

    packed: torch.Tensor  # uint8 [ceil(K/2), N]
    scales: torch.Tensor  # float32 [G, N]
    zeros: torch.Tensor | None  # uint8 [G, N] codes of 0.0 (asymmetric); None: 8 (symmetric)
    group_size: int
    k: int
    in_scale: torch.Tensor | None = None  # [K] multiplier of x (AWQ's 1/s)

    @property
    def shape(self) -> tuple[int, int]:
        return self.k, self.packed.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros, self.in_scale)
                   if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The FP32 weight [K, N] the GEMM multiplies by (in_scale not applied)."""
        return _k.dequantize(self.packed, self.scales, self.zeros, self.group_size, self.k)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, kernel: bool | None = None) -> torch.Tensor:
        """(x * in_scale) @ W + bias; the Triton kernel on CUDA (or when kernel=True), torch otherwise."""
        use = x.is_cuda if kernel is None else kernel
        fn = _k.int4_gemm if use else _k.reference
        return fn(x, self.packed, self.scales, self.zeros, self.group_size, bias, self.in_scale)

    def to(self, device) -> Int4Weight:
        mv = lambda t: t.to(device) if t is not None else None
        return Int4Weight(mv(self.packed), mv(self.scales), mv(self.zeros), self.group_size, self.k, mv(self.in_scale))


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [K, N] -> [G, group_size, N], K padded with zeros to a whole number of groups."""
    K, N = w.shape
    pad = (-K) % group_size
    if pad:
        w = torch.cat([w, w.new_zeros(pad, N)])
    return w.reshape(-1, group_size, N)


def _codes(w: torch.Tensor, group_size: int, symmetric: bool):
    """(codes u [K, N] int16, scales [G, N], zeros [G, N] uint8 or None)."""
    K = w.shape[0]
    wg = _grouped(w.float(), group_size)
    if symmetric:
        scales = (wg.abs().amax(1) / 7).clamp(min=1e-10)
        zeros = None
        zf = torch.full_like(scales, 8.0)
    else:
        hi, lo = wg.amax(1).clamp(min=0), wg.amin(1).clamp(max=0)  # the range holds 0.0 exactly
        scales = ((hi - lo) / 15).clamp(min=1e-10)
        zf = torch.round(-lo / scales).clamp(0, 15)
        zeros = zf.to(torch.uint8)
    u = torch.round(wg / scales[:, None]) + zf[:, None]
    u = u.clamp(0, 15).reshape(-1, w.shape[1])[:K]
    return u.to(torch.int16), scales, zeros


def _check(w: torch.Tensor, group_size: int) -> None:
    if w.dim() != 2:
        raise ConfigError(f"INT4 weight-only quantization takes a 2-D [K, N] weight, got {list(w.shape)}")
    if group_size < 2 or group_size % 2:
        raise ConfigError(f"group_size must be even (a byte holds two values of one group), not {group_size}")


def quantize_weight(w: torch.Tensor, group_size: int = 128, symmetric: bool = True) -> Int4Weight:
    """Round a [K, N] weight (x @ w; an nn.Linear's weight is w.T) to INT4 with per-group scales."""
    _check(w, group_size)
    u, scales, zeros = _codes(w.detach(), group_size, symmetric)
    return Int4Weight(pack_int4(u), scales, zeros, group_size, w.shape[0])


def fake_quantize(w: torch.Tensor, group_size: int = 128, symmetric: bool = True) -> torch.Tensor:
    """Q(w): the dequantized INT4 rounding of w [K, N], in FP32."""
    u, scales, zeros = _codes(w.detach(), group_size, symmetric)
    z = zeros.float() if zeros is not None else torch.full_like(scales, 8.0)
    rep = lambda v: v.repeat_interleave(group_size, dim=0)[:w.shape[0]]
    return (u.float() - rep(z)) * rep(scales)


@dataclass
class AWQResult:
    alpha: float  # the chosen exponent (0: plain rounding won)
    scales: torch.Tensor  # s [K]: the weight's rows are multiplied by s, x divided by it
    error: float  # relative output error ||XW - (X/s)Q(sW)||_F / ||XW||_F at the chosen alpha
    plain_error: float  # the same for plain rounding (alpha = 0)
    errors: dict[float, float] = field(default_factory=dict)  # alpha -> relative error, over the grid

    @property
    def error_reduction(self) -> float:
        """1 - error / plain_error: the share of plain rounding's output error the search removed."""
        return 1.0 - self.error / self.plain_error if self.plain_error > 0 else 0.0

    def __str__(self) -> str:
        return (f"alpha={self.alpha:.2f}: relative output error {self.error:.4g} vs {self.plain_error:.4g} "
                f"plain ({100 * self.error_reduction:.1f}% less)")


def _awq_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    s = mean_abs.clamp(min=1e-4) ** alpha
    return s / math.sqrt(float(s.max()) * float(s.min()))


@torch.no_grad()
def awq_search(w: torch.Tensor, x: torch.Tensor, group_size: int = 128, symmetric: bool = True,
               grid: int = 20) -> AWQResult:
    """Search alpha in {0, 1/grid, ..., 1} for s = mean|x|^alpha minimizing ||x w - (x/s) Q(diag(s) w)||.

    w [K, N] (x @ w), x [.., K] calibration activations of this layer (a few hundred rows suffice).
    """
    _check(w, group_size)
    if x.shape[-1] != w.shape[0]:
        raise ConfigError(f"calibration activations have {x.shape[-1]} features; the weight has K = {w.shape[0]}")
    x = x.reshape(-1, w.shape[0]).float()
    if x.shape[0] == 0:
        raise ConfigError("awq_search needs at least one calibration row")
    w = w.detach().float()
    y = x @ w
    norm = float(y.norm()) or 1.0
    mean_abs = x.abs().mean(0)
    errors: dict[float, float] = {}
    best = (math.inf, 0.0, torch.ones_like(mean_abs))
    for i in range(grid + 1):
        alpha = i / grid
        s = _awq_scales(mean_abs, alpha) if alpha else torch.ones_like(mean_abs)
        err = float(((x / s) @ fake_quantize(w * s[:, None], group_size, symmetric) - y).norm()) / norm
        errors[alpha] = err
        if err < best[0]:
            best = (err, alpha, s)
    return AWQResult(best[1], best[2], best[0], errors[0.0], errors)


def quantize_awq(w: torch.Tensor, x: torch.Tensor, group_size: int = 128, symmetric: bool = True,
                 grid: int = 20) -> tuple[Int4Weight, AWQResult]:
    """quantize_weight after the AWQ search: the weight holds Q(diag(s) w) and in_scale = 1/s."""
    found = awq_search(w, x, group_size, symmetric, grid)
    q = quantize_weight(w.detach().float() * found.scales[:, None], group_size, symmetric)
    if found.alpha:
        q.in_scale = (1.0 / found.scales).float()
    return q, found


class Int4Linear(nn.Module):
    """An nn.Linear whose weight is packed INT4 (weight-only; activations stay float)."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape
        self.group_size, self.k = weight.group_size, weight.k
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("in_scale", weight.in_scale)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)

    @property
    def weight(self) -> Int4Weight:
        return Int4Weight(self.packed, self.scales, self.zeros, self.group_size, self.k, self.in_scale)

    def forward(self, x):
        return self.weight.matmul(x, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        kind = "symmetric" if self.zeros is None else "asymmetric"
        awq = ", awq" if self.in_scale is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, {kind}{awq}")


@torch.no_grad()
def quantize_module(module: nn.Module, calib=None, group_size: int = 128, symmetric: bool = True,
                    awq: bool = True, grid: int = 20, skip: tuple[str, ...] = ()) -> dict[str, AWQResult | None]:
    """Replace every nn.Linear of `module` (in place) by an Int4Linear.

    calib: example inputs for one forward pass (a tensor or a tuple), which record
    each layer's input for the AWQ search; required when awq=True. `module` must
    contain the layers (a bare nn.Linear: wrap it in nn.Sequential). Returns {layer name: AWQResult (None without AWQ)}.
    """
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"group_size must be one of {GROUP_SIZES}, not {group_size}")
    layers = {n: m for n, m in module.named_modules() if type(m) is nn.Linear and n not in skip}
    if not layers:
        raise ConfigError(f"{type(module).__name__} has no nn.Linear layer to quantize")
    seen: dict[str, list[torch.Tensor]] = {}
    if awq:
        if calib is None:
            raise ConfigError("the AWQ search needs calibration inputs (calib=...); or pass awq=False")
        hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: seen.setdefault(n, []).append(a[0].detach()))
                 for n, m in layers.items()]
        try:
            module(*(calib if isinstance(calib, tuple) else (calib,)))
        finally:
            for h in hooks:
                h.remove()
    report: dict[str, AWQResult | None] = {}
    for name, layer in layers.items():
        w = layer.weight.detach().float().t()  # [K, N]
        if awq and name in seen:
            q, report[name] = quantize_awq(w, torch.cat([t.reshape(-1, w.shape[0]) for t in seen[name]]),
                                           group_size, symmetric, grid)
        else:
            q, report[name] = quantize_weight(w, group_size, symmetric), None
        new = Int4Linear(q.to(layer.weight.device), layer.bias)
        if not name:
            raise ConfigError("quantize_module replaces layers inside a module; wrap a bare nn.Linear in nn.Sequential")
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, new)
    return report
