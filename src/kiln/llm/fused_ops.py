"""Fused elementwise steps of the decoder on CUDA: RoPE applied in place to q and k, SiLU(gate) * up, and the
residual add + RMSNorm (kiln.kernels.layernorm's kernel). At batch 1 a decode step is a few hundred kernels;
each of these replaces several torch kernels (casts, slices, concatenations), which is launch time saved on
every layer. The torch forms in model.py are the references (and the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_h, n_heads, stride_pos,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
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
    _rope_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, positions, x.stride(0), x.stride(1), H, cos.stride(0),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h, num_warps=1 if H * half <= 1024 else 4)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, n, stride_x, stride_y, GELU: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation (Gemma's gelu_pytorch_tanh)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))
    tl.store(y_ptr + t * stride_y + cols, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """gate_up [T, 2n] (gate then up) -> act(gate) * up [T, n]; act = SiLU, or tanh-GELU."""
    T, two_n = gate_up.shape
    n = two_n // 2
    y = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return y
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(T, triton.cdiv(n, block))](gate_up, y, n, gate_up.stride(0), y.stride(0), GELU=gelu,
                                                    BLOCK=block, num_warps=4 if block >= 512 else 1)
    return y


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(residual + delta) * weight, residual + delta) in one pass."""
    from kiln.kernels.layernorm import skip_layernorm

    y, s = skip_layernorm(delta, residual, weight, None, eps, write_sum=True, rms=True)
    return y, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from kiln.kernels.layernorm import skip_layernorm

    return skip_layernorm(x, None, weight, None, eps, write_sum=False, rms=True)[0]
