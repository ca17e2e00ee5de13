"""Fused elementwise steps of the decoder on CUDA: RoPE applied in place to q and k, act(gate) * up (alone, or
inside the down projection's decode GEMV: act_and_down), and the residual add + RMSNorm (kiln.kernels.layernorm's
kernel); RoPE with the KV-cache write is kiln.kernels.rope_cache. At batch 1 a decode step is a few hundred
kernels of a microsecond or two each; each of these replaces several torch kernels (casts, slices,
concatenations) or a launch of its own, and they are launched as programmatic dependents (kernels/pdl.py). The
torch forms in model.py are the references (and the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.gated_act import act_mul
from kiln.kernels.pdl import launch_options, start_after_previous


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_h, n_heads, stride_pos,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < n_heads) & (j < HALF)
    base = x_ptr + t.to(tl.int64) * stride_t + h * stride_h
    x1 = tl.load(base + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * stride_pos + j, mask=j < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * stride_pos + j, mask=j < HALF, other=0.0)
    tl.store(base + j, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF + j, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None:
    """Rotates, in place, the first rotary_dim features of every head of x [T, heads, head_dim] (any strides
    with a contiguous last dim) by the FP32 tables cos/sin [max_positions, rotary_dim] (rotate-half layout)."""
    T, H, _ = x.shape
    if T == 0:
        return
    assert x.stride(-1) == 1 and cos.stride(-1) == 1
    half = rotary_dim // 2
    block_h = min(16, triton.next_power_of_2(H))
    pdl = launch_options(x.device)
    _rope_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, positions, x.stride(0), x.stride(1), H, cos.stride(0),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h, PDL=bool(pdl),
        num_warps=1 if H * half <= 1024 else 4, **pdl)


@triton.jit
def _act_and_mul_kernel(x_ptr, y_ptr, n, stride_x, stride_y, ACT: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    start_after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + t * stride_x + n + cols, mask=mask, other=0.0)
    tl.store(y_ptr + t * stride_y + cols, act_mul(g, u, ACT).to(y_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """gate_up [T, 2n] (gate then up) -> act(gate) * up [T, n]; act = SiLU, or tanh-GELU."""
    T, two_n = gate_up.shape
    n = two_n // 2
    y = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return y
    block = min(1024, triton.next_power_of_2(n))
    pdl = launch_options(gate_up.device)
    _act_and_mul_kernel[(T, triton.cdiv(n, block))](gate_up, y, n, gate_up.stride(0), y.stride(0),
                                                   ACT="gelu_tanh" if gelu else "silu", BLOCK=block, PDL=bool(pdl),
                                                   num_warps=4 if block >= 512 else 1, **pdl)
    return y


def act_and_down(gate_up: torch.Tensor, down, hidden_act: str) -> torch.Tensor | None:
    """down(act(gate) * up) for one row gate_up [1, 2n], with the activation applied inside the down
    projection's decode GEMV as it loads its input (one launch instead of two; the same bits as act_and_mul, then
    the GEMV, for FP8/INT8 and INT4 weights). None for more rows (the GEMV's tile would compute the activation
    for every one of its activation columns) and where that GEMV does not run for this weight
    (kiln.llm.quantize's rules: cuBLAS's matrix, another format) or the activation has no fused form: the caller
    then runs both."""
    from kiln.kernels import fp8_gemv as fg
    from kiln.kernels.gated_act import kernel_act
    from kiln.llm.quantize import GEMV_MAX_M, DecodeWeight, QuantizedWeight

    act = kernel_act(hidden_act)
    rows = gate_up.shape[0]
    if act is None or gate_up.dtype not in (torch.bfloat16, torch.float16) or rows != 1:
        return None
    if isinstance(down, QuantizedWeight):
        if rows > GEMV_MAX_M:
            return None
        if down.method == "int4-awq":
            from kiln.llm.quantize import INT4_GROUP

            return fg.int4_gemv(gate_up, down.codes, down.scale, down.zero, down.input_scale, INT4_GROUP, act=act)
        if down.method in ("fp8", "int8"):
            return fg.fp8_gemv(gate_up, down.codes, down.scale, act=act)
        return None
    if isinstance(down, DecodeWeight) and rows <= down.gemv_rows and gate_up.dtype == down.dtype:
        return fg.fp8_gemv(gate_up, down, None, act=act)
    return None


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(residual + delta) * weight, residual + delta) in one pass."""
    from kiln.kernels.layernorm import skip_layernorm

    y, s = skip_layernorm(delta, residual, weight, None, eps, write_sum=True, rms=True)
    return y, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from kiln.kernels.layernorm import skip_layernorm

    return skip_layernorm(x, None, weight, None, eps, write_sum=False, rms=True)[0]
