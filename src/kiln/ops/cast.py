"""Cast, CastLike and BitCast: all numeric ONNX types, float8 saturation, the narrow types.

Narrow types (int4, float4e2m1...) come back in their carrier dtype (see
kiln.ir.dtypes) holding exactly the values the ONNX type would hold.
"""

import onnx
import torch

from ..ir import dtypes
from .registry import register

TP = onnx.TensorProto

# float8: largest finite value, |x| from which round-to-nearest-even overflows it,
# whether |x| equal to that bound overflows (the max has an odd mantissa),
# mantissa bits and smallest normal exponent.
FLOAT8_FORMATS = {
    TP.FLOAT8E4M3FN: (448.0, 464.0, False, 3, -6),
    TP.FLOAT8E4M3FNUZ: (240.0, 248.0, True, 3, -7),
    TP.FLOAT8E5M2: (57344.0, 61440.0, True, 2, -14),
    TP.FLOAT8E5M2FNUZ: (57344.0, 61440.0, True, 2, -15),
}
# Small floats without Inf/NaN: mantissa bits, smallest normal exponent, largest value.
MINIFLOAT_FORMATS = {
    TP.FLOAT4E2M1: (1, 0, 6.0),
    TP.FLOAT6E2M3: (3, 0, 7.5),
    TP.FLOAT6E3M2: (2, -2, 28.0),
}
# Narrow integers: bits, signed.
_NARROW_INT = {TP.INT4: (4, True), TP.UINT4: (4, False), TP.INT2: (2, True), TP.UINT2: (2, False)}
_ROUND_MODES = ("up", "down", "nearest")


def _floating(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in dtypes.FLOAT_TYPES else x.float()


def _round_to_grid(a: torch.Tensor, mantissa_bits: int, min_exp: int) -> torch.Tensor:
    """a (>= 0) rounded to nearest even on the grid of a float format without range limits."""
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    step = torch.exp2((e - 1).clamp(min=min_exp).to(a.dtype) - mantissa_bits)
    return torch.round(a / step) * step  # torch.round: half to even


def _to_float8(x: torch.Tensor, to: int, saturate: bool) -> torch.Tensor:
    big, bound, tie_overflows, mantissa_bits, min_exp = FLOAT8_FORMATS[to]
    x = _floating(x)
    y = x.clamp(-big, big)  # NaN stays NaN; the saturating rule
    if x.dtype == torch.float64:  # torch narrows float64 through float32: round once, here
        y = torch.copysign(_round_to_grid(y.abs(), mantissa_bits, min_exp), y)
    if not saturate:
        a = x.abs()
        over = a >= bound if tie_overflows else a > bound
        special = float("inf") if to == TP.FLOAT8E5M2 else float("nan")  # E5M2 alone has an infinity
        y = torch.where(over, torch.copysign(torch.full_like(x, special), x), y)
    return y.to(dtypes.onnx_to_torch(to))


def round_minifloat(x: torch.Tensor, to: int) -> torch.Tensor:
    """x rounded (nearest even, saturating) to a FLOAT4/FLOAT6 type, in its float8 carrier.
    These types have no NaN; NaN becomes 0."""
    mantissa_bits, min_exp, big = MINIFLOAT_FORMATS[to]
    x = x.float() if x.dtype != torch.float64 else x
    q = _round_to_grid(x.abs().clamp(max=big), mantissa_bits, min_exp).clamp(max=big)
    q = torch.where(torch.isnan(x), 0.0, q)
    return torch.copysign(q, x).to(torch.float8_e4m3fn)


def _to_e8m0(x: torch.Tensor, saturate: bool, round_mode: str) -> torch.Tensor:
    """FLOAT8E8M0 keeps only a float32's exponent; rounding decides from the mantissa."""
    bits = x.float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    if round_mode == "up":
        up = mant > 0
    elif round_mode == "nearest":  # guard bit set and (round or sticky or exponent > 0)
        up = ((mant & 0x400000) != 0) & (((mant & 0x3FFFFF) != 0) | (exp > 0))
    else:
        up = torch.zeros_like(mant, dtype=torch.bool)
    if saturate:
        up &= exp != 0xFE
    special = exp == 0xFF
    exp = torch.where(special, 0xFF, exp + up.to(exp.dtype))
    if saturate:  # Inf saturates to the largest exponent; NaN stays NaN
        exp = torch.where(special & (mant == 0), 0xFE, exp)
    return exp.to(torch.uint8).view(torch.float8_e8m0fnu)


def _to_narrow_int(x: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    """Integers keep their low `bits` bits (two's complement), like any integer narrowing. Floats
    truncate toward zero; one out of range (undefined in the spec) becomes 0, as in ONNX's reference."""
    carrier = torch.int8 if signed else torch.uint8
    if x.is_floating_point():
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        t = x.trunc()
        return torch.where((t >= lo) & (t <= hi), t, 0).to(carrier)  # NaN compares false: 0
    v = x.to(torch.int64) & ((1 << bits) - 1)
    if signed:
        v = v - ((v >> (bits - 1)) << bits)
    return v.to(carrier)


def cast_to(x: torch.Tensor, to: int, saturate: bool = True, round_mode: str = "up") -> torch.Tensor:
    """x converted to ONNX element type `to` following the Cast spec."""
    if x.dtype in dtypes.FLOAT8_TYPES:
        x = x.float()  # exact, and every conversion below is defined from float32
    if to in FLOAT8_FORMATS:
        return _to_float8(x, to, saturate)
    if to == TP.FLOAT8E8M0:
        return _to_e8m0(x, saturate, round_mode)
    if to in MINIFLOAT_FORMATS:
        return round_minifloat(x, to)
    if to in _NARROW_INT:
        return _to_narrow_int(x, *_NARROW_INT[to])
    return x.to(dtypes.onnx_to_torch(to))


def _target(node) -> int | None:
    to = node.attr("to")
    if isinstance(to, str):  # Cast-1 named the type
        return TP.DataType.Value(to.upper()) if to.upper() in TP.DataType.keys() else None
    return to


def _check_round_mode(node) -> str | None:
    mode = node.attr("round_mode", "up")
    if mode not in _ROUND_MODES:
        return f"round_mode '{mode}' is not one of {_ROUND_MODES}"
    return None


def _check_cast(node) -> str | None:
    to = _target(node)
    if to is None:
        return f"Cast target '{node.attr('to')}' is not an ONNX element type"
    if to == TP.STRING:
        return "casting to string is not supported (Kiln has numeric tensors only)"
    try:
        dtypes.onnx_to_torch(to)
    except KeyError:
        return f"casting to {dtypes.onnx_type_name(to)} is not supported"
    return _check_round_mode(node)


@register("Cast", keeps_input_types=True, check=_check_cast)
def cast(node, x):
    return cast_to(x, _target(node), bool(node.attr("saturate", 1)), node.attr("round_mode", "up"))


@register("CastLike", keeps_input_types=True, check=_check_round_mode, since=15)
def cast_like(node, x, like):
    # A narrow `like` arrives as its carrier; dtypes.pin_narrow_types turns such
    # CastLikes into Casts at import, so the carrier's own type is right here.
    to = dtypes.torch_to_onnx(like.dtype)
    return cast_to(x, to, bool(node.attr("saturate", 1)), node.attr("round_mode", "up"))


def _check_bitcast(node) -> str | None:
    to = node.attr("to")
    if to in dtypes.NARROW:  # held in 8-bit carriers: their bits are not the ONNX type's
        return f"BitCast to the sub-byte type {dtypes.onnx_type_name(to)} is not supported"
    try:
        dtypes.onnx_to_torch(to)
    except KeyError:
        return f"BitCast to {dtypes.onnx_type_name(to)} is not supported"
    return None


@register("BitCast", keeps_input_types=True, check=_check_bitcast, since=26)
def bitcast(node, x):
    """The same bytes read as type `to` (little endian, as every target Kiln builds for)."""
    to = dtypes.onnx_to_torch(node.attr("to"))
    if x.element_size() != to.itemsize:
        raise ValueError(f"BitCast from {x.dtype} ({8 * x.element_size()} bits) to {to} ({8 * to.itemsize} bits): "
                         "the widths must match")
    return x.contiguous().view(to)
