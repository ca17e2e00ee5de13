"""RoPE on a step's queries and keys and the write of its keys and values into the paged KV cache, in one kernel.

Input: the QKV projection's output rows qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] (q heads, then k, then
v). Each program takes one token: it rotates the first rotary_dim features of every q head in place (the
rotate-half layout of kiln.llm.model.Rope, FP32 arithmetic, rounded to qkv's type), rotates the k heads the
same way and writes them, rounded to qkv's type first, with the v heads into the cache at the token's slot (-1:
not written), as kiln.kernels.paged_attention.reshape_and_cache would from the rotated keys: minus the key offset
when there is one, 8-bit codes for FP8/INT8 caches. The rotated keys are not written back into qkv (attention
reads them from the cache).

This replaces two launches of a decode step's layer (RoPE, then the cache write) by one. The reference is the
torch path: kiln.llm.model.Rope on q and k, then paged_attention.reshape_and_cache_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _check_cache, _quant_name, _scales, _to_codes
from .pdl import launch_options, start_after_previous


@triton.jit
def _cache_codes(x, ks_ptr, rh, KVH: tl.constexpr, QUANT: tl.constexpr):
    """x [BLOCK_H, n] (FP32) as the cache stores it: codes of x / its KV head's scale for 8-bit caches."""
    if QUANT != "":
        x = _to_codes(x, tl.load(ks_ptr + rh, mask=rh < KVH, other=1.0)[:, None], QUANT)
    return x


@triton.jit
def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ko_ptr,
                       stride_t, stride_pos, skcb, skco, skch, svcb, svco, svch,
                       NQ: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr, REST: tl.constexpr, REST_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
                       HAS_OFFSET: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    t = tl.program_id(0)
    dt = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    row = qkv_ptr + t.to(tl.int64) * stride_t
    j = tl.arange(0, HALF_PAD)[None, :]
    j_ok = j < HALF
    c = tl.load(cos_ptr + pos * stride_pos + j, mask=j_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_pos + j, mask=j_ok, other=0.0)

    # q heads, in place (the same arithmetic as kiln.llm.fused_ops.rope_)
    hq = tl.arange(0, BLOCK_Q)[:, None]
    q_ok = (hq < NQ) & j_ok
    qb = row + hq * HEAD_DIM
    x1 = tl.load(qb + j, mask=q_ok, other=0.0).to(tl.float32)
    x2 = tl.load(qb + HALF + j, mask=q_ok, other=0.0).to(tl.float32)
    tl.store(qb + j, (x1 * c - x2 * s).to(dt), mask=q_ok)
    tl.store(qb + HALF + j, (x2 * c + x1 * s).to(dt), mask=q_ok)

    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        rh = tl.arange(0, BLOCK_H)
        hk = rh[:, None]
        k_ok = (hk < KVH) & j_ok
        kb = row + NQ * HEAD_DIM + hk * HEAD_DIM
        k1 = tl.load(kb + j, mask=k_ok, other=0.0).to(tl.float32)
        k2 = tl.load(kb + HALF + j, mask=k_ok, other=0.0).to(tl.float32)
        r1 = (k1 * c - k2 * s).to(dt).to(tl.float32)  # the rotated keys as qkv's type holds them
        r2 = (k2 * c + k1 * s).to(dt).to(tl.float32)
        if HAS_OFFSET:
            r1 -= tl.load(ko_ptr + hk * HEAD_DIM + j, mask=k_ok, other=0.0)
            r2 -= tl.load(ko_ptr + hk * HEAD_DIM + HALF + j, mask=k_ok, other=0.0)
        kd = kc_ptr + blk * skcb + off * skco + hk * skch
        kty = kc_ptr.dtype.element_ty
        tl.store(kd + j, _cache_codes(r1, ks_ptr, rh, KVH, QUANT).to(kty), mask=k_ok)
        tl.store(kd + HALF + j, _cache_codes(r2, ks_ptr, rh, KVH, QUANT).to(kty), mask=k_ok)
        if REST > 0:  # partial rotary: the features past rotary_dim are stored as they are
            e = 2 * HALF + tl.arange(0, REST_PAD)[None, :]
            e_ok = (hk < KVH) & (e < HEAD_DIM)
            kr = tl.load(kb + e, mask=e_ok, other=0.0).to(tl.float32)
            if HAS_OFFSET:
                kr -= tl.load(ko_ptr + hk * HEAD_DIM + e, mask=e_ok, other=0.0)
            tl.store(kd + e, _cache_codes(kr, ks_ptr, rh, KVH, QUANT).to(kty), mask=e_ok)
        d = tl.arange(0, BLOCK_D)[None, :]
        v_ok = (hk < KVH) & (d < HEAD_DIM)
        v = tl.load(row + (NQ + KVH) * HEAD_DIM + hk * HEAD_DIM + d, mask=v_ok, other=0.0)
        if QUANT != "":
            v = _cache_codes(v.to(tl.float32), vs_ptr, rh, KVH, QUANT)
        tl.store(vc_ptr + blk * svcb + off * svco + hk * svch + d, v.to(vc_ptr.dtype.element_ty), mask=v_ok)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                   num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, k_offset: torch.Tensor | None = None) -> None:
    """Rotates qkv's q heads in place and writes its rotated k heads and v heads into the cache (see above).
    qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] with unit stride along a row; cos/sin the FP32 tables
    [max_positions, rotary_dim]; positions and slot_mapping [T]."""
    T = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride() and rotary_dim % 2 == 0 and rotary_dim <= head_dim
    _check_cache(k_cache, v_cache, k_scale, v_scale, num_kv_heads, head_dim)
    if T == 0:
        return
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    quant = _quant_name(k_cache.dtype)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
    pdl = launch_options(qkv.device)
    work = (num_heads + 2 * num_kv_heads) * head_dim
    _rope_cache_kernel[(T,)](
        qkv, cos, sin, pos, slots, k_cache, v_cache, _scales(k_scale, cos), _scales(v_scale, cos),
        _scales(k_offset, cos), qkv.stride(0), cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NQ=num_heads, KVH=num_kv_heads, HEAD_DIM=head_dim, HALF=half, HALF_PAD=triton.next_power_of_2(max(half, 1)),
        REST=rest, REST_PAD=triton.next_power_of_2(max(rest, 1)), BLOCK_Q=triton.next_power_of_2(num_heads),
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], QUANT=quant, HAS_OFFSET=k_offset is not None, PDL=bool(pdl),
        num_warps=4 if work >= 2048 else 1, **pdl)
