"""The INT4 weight format of kiln::Int4Gemm, and its reference product.

A weight [K, N] (x @ W) is stored as
  packed [ceil(K/2), N] uint8: row r holds k = 2r in its low nibble and k = 2r+1 in its high nibble,
      each an unsigned code u in 0..15;
  scales [G, N] (G = ceil(K / group_size)): one scale per group of group_size consecutive k per column;
  zeros [G, N] (optional, asymmetric): the code of 0.0 per group; without it the code of 0.0 is 8
      (symmetric, q = u - 8 in -8..7);
  in_scale [K] (optional): a per-input-channel multiplier of x (AWQ's 1/s).
  dequant(Wq)[k, n] = (u[k, n] - zero[k // group_size, n]) * scales[k // group_size, n].
kernels/int4_gemm.py computes the same product without materializing the float weight.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError


def pack(u: torch.Tensor) -> torch.Tensor:
    """Codes u (0..15) [K, N] -> uint8 [ceil(K/2), N]: row r = u[2r] | u[2r+1] << 4 (odd K padded with 0)."""
    if u.dim() != 2:
        raise ConfigError(f"pack expects a 2-D [K, N] tensor, got {list(u.shape)}")
    u = u.to(torch.int16)
    if int(u.min()) < 0 or int(u.max()) > 15:
        raise ConfigError("int4 codes must lie in 0..15 (add 8 to signed values)")
    if u.shape[0] % 2:
        u = torch.cat([u, u.new_zeros(1, u.shape[1])])
    return (u[0::2] | (u[1::2] << 4)).to(torch.uint8)


def check_operands(x, packed, scales, zeros, group_size, in_scale, bias):
    K = x.shape[-1]
    G = -(-K // group_size)
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be even, not {group_size}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[0] != (K + 1) // 2:
        raise ValueError(f"packed must be uint8 [ceil(K/2), N] = [{(K + 1) // 2}, N], got {packed.dtype} "
                         f"{list(packed.shape)}")
    N = packed.shape[1]
    if tuple(scales.shape) != (G, N):
        raise ValueError(f"scales must be [G, N] = [{G}, {N}], got {list(scales.shape)}")
    if zeros is not None and tuple(zeros.shape) != (G, N):
        raise ValueError(f"zeros must be [G, N] = [{G}, {N}], got {list(zeros.shape)}")
    if in_scale is not None and in_scale.numel() != K:
        raise ValueError(f"in_scale must have K = {K} elements, got {in_scale.numel()}")
    if bias is not None and bias.numel() != N:
        raise ValueError(f"bias must have N = {N} elements, got {bias.numel()}")
    return K, N



def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The codes u (0..15, int16) [k, N] of packed [ceil(k/2), N] uint8."""
    p = packed.to(torch.int16)
    u = torch.stack([p & 15, (p >> 4) & 15], dim=1).reshape(-1, packed.shape[1])
    return u[:k]


def dequantize(packed, scales, zeros, group_size: int, k: int) -> torch.Tensor:
    """The FP32 weight [k, N]."""
    u = unpack(packed, k).float()
    z = zeros.float() if zeros is not None else torch.full_like(scales, 8.0, dtype=torch.float32)
    rep = lambda v: v.repeat_interleave(group_size, dim=0)[:k]
    return (u - rep(z)) * rep(scales.float())


def reference(x, packed, scales, zeros, group_size, bias=None, in_scale=None):
    """The same product in torch: unpack, dequantize, FP32 matmul; x's dtype out."""
    K = x.shape[-1]
    check_operands(x, packed, scales, zeros, group_size, in_scale, bias)
    xf = x.float() if in_scale is None else x.float() * in_scale.float().reshape(-1)
    y = torch.matmul(xf, dequantize(packed, scales, zeros, group_size, K))
    if bias is not None:
        y = y + bias.float().reshape(-1)
    return y.to(x.dtype)
