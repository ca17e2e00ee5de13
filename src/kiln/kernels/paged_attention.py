"""Paged attention for Kiln-LLM: writing K/V into a block-paged cache, and attention over it.

Cache layout (one layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] of the model's
float type, torch.float8_e4m3fn or torch.int8. A token's slot is block_id * block_size + offset_in_block; a
sequence's blocks are listed, in order, in its row of block_tables.

8-bit caches carry FP32 scales [num_kv_heads]: stored = x / scale (FP8 E4M3: saturated to +-448 then rounded
to nearest even; INT8: rounded half to even, clamped to -127..127), dequantized = stored.float() * scale.

A key offset k_offset [num_kv_heads, head_dim] FP32 (optional) is subtracted from every key before it is
stored: the cache holds k - k_offset. Attention reads the stored keys as they are, which is exact: a query's
scores all move by the same q . k_offset, and softmax does not see a shift common to all its inputs (logit
soft-capping does, so a model with it takes no offset). Centring the keys on their calibrated mean leaves FP8's
relative rounding error on the keys' spread instead of on their (often large) common part.

Tokens of all sequences of a step are packed without padding: sequence s owns query rows
query_start_loc[s] .. query_start_loc[s + 1]; its context has seq_lens[s] tokens, this step's included, so its
query j sits at absolute position p = seq_lens[s] - qlen_s + j and attends keys 0..p (with a sliding window w,
keys p - w + 1..p). Query head h reads KV head h // (num_heads // num_kv_heads).

The torch references (`*_reference`) are the ground truth and run on CPU; the Triton kernels of the same
signatures run on CUDA (and under TRITON_INTERPRET=1 on small shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import ShapeError
from .pdl import launch_options, start_after_previous

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
CACHE_8BIT = (FP8, torch.int8)


# ---------------------------------------------------------------------------------------------------------------
# Quantization of 8-bit caches
# ---------------------------------------------------------------------------------------------------------------

def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] as dtype's codes with per-KV-head scale [num_kv_heads] (x / scale, in FP32);
    float dtypes are a plain cast."""
    if dtype not in CACHE_8BIT:
        return x.to(dtype)
    v = x.float() / scale.float().to(x.device)[:, None]
    if dtype == FP8:
        return v.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.round(v).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache values [..., num_kv_heads, head_dim] in FP32 (8-bit codes times their KV head's scale)."""
    if stored.dtype not in CACHE_8BIT:
        return stored.float()
    return stored.float() * scale.float().to(stored.device)[:, None]


def kv_scales(x: torch.Tensor, dtype: torch.dtype, per_head: bool | None = None) -> torch.Tensor:
    """Scales [num_kv_heads] that map x's [..., num_kv_heads, head_dim] absolute maximum to dtype's largest code:
    per KV head for INT8, one value repeated for FP8 (the contract's convention) unless per_head says otherwise."""
    per_head = dtype == torch.int8 if per_head is None else per_head
    amax = x.float().abs().amax(dim=tuple(i for i in range(x.dim()) if i != x.dim() - 2))
    if not per_head:
        amax = amax.max().expand_as(amax)
    top = FP8_MAX if dtype == FP8 else INT8_MAX
    return (amax.clamp_min(1e-12) / top).float().contiguous()


# ---------------------------------------------------------------------------------------------------------------
# Torch references
# ---------------------------------------------------------------------------------------------------------------

def reshape_and_cache_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, k_offset=None):
    """Writes k, v [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (-1: not written),
    quantizing for 8-bit caches; keys minus k_offset when given."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    keys = k[keep] if k_offset is None else k[keep].float() - k_offset.float().to(k.device)
    k_cache[blocks, offsets] = quantize_kv(keys, k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize_kv(v[keep], v_scale, v_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                   scale: torch.Tensor | None) -> torch.Tensor:
    """One sequence's first seq_len cached tokens [seq_len, num_kv_heads, head_dim] in FP32, in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, num_kv_heads, head_dim]
    return dequantize_kv(blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len], scale)


def paged_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len,
                              max_seq_len, softmax_scale, k_scale=None, v_scale=None, sliding_window=None,
                              logits_soft_cap=None, out=None):
    """Causal attention of the packed queries q [num_tokens, num_heads, head_dim] over each sequence's paged
    context, in FP32; returns [num_tokens, num_heads, head_dim] in q's dtype (written into `out` when given)."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    result = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        keys = gather_context(k_cache, block_tables[s], seq_len, k_scale).repeat_interleave(group, dim=1)
        values = gather_context(v_cache, block_tables[s], seq_len, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * softmax_scale
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        pos = torch.arange(seq_len - (q1 - q0), seq_len, device=q.device)[:, None]  # absolute query positions
        key = torch.arange(seq_len, device=q.device)[None, :]
        allowed = key <= pos
        if sliding_window:
            allowed &= key > pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        result[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------
#
# paged_attention: one program per (block of BLOCK_Q queries of one sequence, KV head[, context split]). Its
# tile has BLOCK_M = BLOCK_Q * G_PAD rows: every query head of that KV head (the group, padded to a power of
# two) for each of its queries, so each K/V tile is read once per KV head and serves the whole group. Query
# blocks of all sequences are numbered one after another (sequence s's first block is
# query_start_loc[s] // BLOCK_Q + s, an upper bound that needs no host sync); a program finds its sequence by
# binary search over query_start_loc. It walks the keys its queries may see BLOCK_N at a time, gathering them
# through the block table, with the online softmax in base 2 and FP32 accumulators. Tiles below the block's
# first query are seen by every query and skip the mask. 8-bit codes convert exactly to the dot's type
# (compute_dtype); their KV head's scales are one number per program, folded into the softmax scale (k) and
# the final normalization (v).
#
# Split-K (decode with long contexts and too few programs to fill the GPU): each program covers one slice of
# the context and writes its normalized partial output with its row max and sum; a second kernel merges the
# slices.

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
MAX_HEAD_DIM = 256


@triton.jit
def _to_codes(x, scale, QUANT: tl.constexpr):
    """x / scale as 8-bit codes (QUANT "fp8": saturated to +-448, round to nearest even; "int8": round half to
    even, clamped to +-127), FP32 in. The quotient is rounded to nearest (div_rn), as torch's: Triton's `/`
    is the GPU's approximate division, which would move values next to a rounding tie to the other code."""
    v = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    if QUANT == "fp8":
        codes = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv)
    else:
        # clamping first rounds the same (integer bounds); adding 1.5 * 2**23 makes the FP32 adder round to
        # nearest even and leaves the integer in the low mantissa bits (libdevice.rint: not in the interpreter)
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        codes = (v + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
    return codes


@triton.jit
def _reshape_and_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, ko_ptr,
                              skt, skh, svt, svh, skcb, skco, skch, svcb, svco, svch,
                              KVH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              QUANT: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        rh = tl.arange(0, BLOCK_H)
        rd = tl.arange(0, BLOCK_D)
        ok = (rh < KVH)[:, None] & (rd < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + t.to(tl.int64) * skt + rh[:, None] * skh + rd[None, :], mask=ok)
        v = tl.load(v_ptr + t.to(tl.int64) * svt + rh[:, None] * svh + rd[None, :], mask=ok)
        if HAS_OFFSET:
            k = k.to(tl.float32) - tl.load(ko_ptr + rh[:, None] * HEAD_DIM + rd[None, :], mask=ok, other=0.0)
        if QUANT != "":
            k = _to_codes(k.to(tl.float32), tl.load(ks_ptr + rh, mask=rh < KVH, other=1.0)[:, None], QUANT)
            v = _to_codes(v.to(tl.float32), tl.load(vs_ptr + rh, mask=rh < KVH, other=1.0)[:, None], QUANT)
        tl.store(kc_ptr + blk * skcb + off * skco + rh[:, None] * skch + rd[None, :],
                 k.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_ptr + blk * svcb + off * svco + rh[:, None] * svch + rd[None, :],
                 v.to(vc_ptr.dtype.element_ty), mask=ok)


def _quant_name(dtype: torch.dtype) -> str:
    return {FP8: "fp8", torch.int8: "int8"}.get(dtype, "")


def _check_cache(k_cache, v_cache, k_scale, v_scale, num_kv_heads: int, head_dim: int):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ShapeError(f"paged KV cache: k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} must both be [num_blocks, block_size, "
                         "num_kv_heads, head_dim] of one dtype.")
    if k_cache.shape[2] != num_kv_heads or k_cache.shape[3] != head_dim:
        raise ShapeError(f"paged KV cache: k_cache {tuple(k_cache.shape)} holds {k_cache.shape[2]} KV heads of "
                         f"dim {k_cache.shape[3]}, the inputs have {num_kv_heads} of dim {head_dim}.")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ShapeError("paged KV cache: the head dim of k_cache and v_cache must be contiguous (stride 1).")
    if k_cache.dtype in CACHE_8BIT and (k_scale is None or v_scale is None):
        raise ShapeError(f"paged KV cache: a {k_cache.dtype} cache needs k_scale and v_scale "
                         "(float32 [num_kv_heads]).")
    if head_dim > MAX_HEAD_DIM:
        raise ShapeError(f"paged attention: head_dim {head_dim} is above the kernels' {MAX_HEAD_DIM}.")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scales(scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return scale.float().contiguous() if scale is not None else like


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, k_offset=None):
    """Triton version of reshape_and_cache_reference: one program per token."""
    num_tokens, kvh, d = k.shape
    _check_cache(k_cache, v_cache, k_scale, v_scale, kvh, d)
    if k_offset is not None and tuple(k_offset.shape) != (kvh, d):
        raise ShapeError(f"paged KV cache: k_offset is {list(k_offset.shape)}, the keys need [{kvh}, {d}].")
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    quant = _quant_name(k_cache.dtype)
    slots = slot_mapping.to(torch.int64).contiguous()
    pdl = launch_options(k.device)
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots, _scales(k_scale, slots), _scales(v_scale, slots),
        _scales(k_offset, slots), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], KVH=kvh, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1], QUANT=quant,
        HAS_OFFSET=k_offset is not None, BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d), PDL=bool(pdl), num_warps=4 if kvh * d >= 1024 else 1, **pdl)


@triton.jit
def _attend_tiles(q, m_i, l_i, acc, lo, hi, k_hi, pos, bt_row, k_head, v_head, skb, sko, svb, svo, qk_scale,
                  soft_cap, window, d_ok, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr):
    """The online softmax over keys lo..hi (hi a multiple of BLOCK_N unless it is k_hi), gathered through the
    block table. MASKED: apply the causal (and window) mask and the end of the context; off, every key is seen."""
    rn = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        kn = start + rn
        n_ok = kn < k_hi
        blk = tl.load(bt_row + kn // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = kn % BLOCK_SIZE
        kt = tl.load(k_head + (blk * skb + off * sko)[None, :], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        sc = tl.dot(q, kt.to(CDT), input_precision=PREC) * qk_scale
        if HAS_CAP:  # cap * tanh(x / cap), tanh through exp2 (saturates cleanly at +-1)
            sc = soft_cap * (1.0 - 2.0 / (tl.math.exp2(sc * (2.0 * 1.4426950408889634 / soft_cap)) + 1.0))
            sc = sc * 1.4426950408889634
        if MASKED:
            see = n_ok[None, :] & (kn[None, :] <= pos[:, None])
            if HAS_WINDOW:
                see = see & (kn[None, :] > pos[:, None] - window)
            sc = tl.where(see, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: nothing to subtract
        else:
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_ref = m_new
        p = tl.math.exp2(sc - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_head + (blk * svb + off * svo)[:, None], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(CDT), vt.to(CDT), acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, ks_ptr, vs_ptr,
                            po_ptr, pml_ptr, num_seqs, seq_steps, softmax_scale, soft_cap, window,
                            sqt, sqh, sot, soh, skb, sko, skh, svb, svo, svh, sbt, spt, sph, sps, smt, smh,
                            HEAD_DIM: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, KV_SCALED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                            HAS_CAP: tl.constexpr, SPLIT: tl.constexpr, CDT: tl.constexpr, CLAMP_Q: tl.constexpr,
                            PREC: tl.constexpr, PDL: tl.constexpr):
    # first, before any program may return: this kernel then cannot end before the one it follows, which the
    # next kernel's wait (on this one) relies on when it reads what that one wrote
    start_after_previous(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # this program's sequence: the last s with query_start_loc[s] // BLOCK_Q + s <= pid (a fixed-step search)
    s = pid * 0  # a tensor (num_seqs may be specialized to a constant)
    for i in range(seq_steps):
        cand = s + (1 << (seq_steps - 1 - i))
        first = tl.load(qsl_ptr + cand, mask=cand < num_seqs, other=0) // BLOCK_Q + cand
        s = tl.where((cand < num_seqs) & (first <= pid), cand, s)
    q_start = tl.load(qsl_ptr + s)
    qlen = tl.load(qsl_ptr + s + 1) - q_start
    qb = pid - (q_start // BLOCK_Q + s)
    if qb * BLOCK_Q >= qlen:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - qlen  # absolute position of the sequence's first query

    rm = tl.arange(0, BLOCK_M)
    qi = qb * BLOCK_Q + rm // G_PAD  # query index within the sequence
    g = rm % G_PAD
    row_ok = (qi < qlen) & (g < G)
    head = kvh * G + g
    pos = ctx + qi
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < HEAD_DIM  # a constant where HEAD_DIM == BLOCK_D
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * sqt + head[:, None] * sqh + rd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if CLAMP_Q:  # BF16 queries computed in FP16 (8-bit caches): kept finite
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
    q = q.to(CDT)

    # keys any of the block's queries may see, within this program's split of the context
    k_hi = tl.minimum(ctx + (qb + 1) * BLOCK_Q, seq_len)
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(ctx + qb * BLOCK_Q - window + 1, 0)
    if SPLIT:
        # this sequence's context in equal slices of whole key tiles: sized by its own length, not by
        # max_seq_len (a CUDA graph captured at max_model_len still spreads a short context over the splits)
        split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        k_lo = tl.maximum(k_lo, split * split_len)
        k_hi = tl.minimum(k_hi, (split + 1) * split_len)
    k_lo = (k_lo // BLOCK_N) * BLOCK_N

    if KV_SCALED:
        k_scale = tl.load(ks_ptr + kvh)
        v_scale = tl.load(vs_ptr + kvh)
    else:
        k_scale = 1.0
        v_scale = 1.0
    if HAS_CAP:  # the cap applies to the logits in natural units; base 2 after it
        qk_scale = softmax_scale * k_scale
    else:
        qk_scale = softmax_scale * k_scale * 1.4426950408889634

    bt_row = bt_ptr + s.to(tl.int64) * sbt
    k_head = kc_ptr + kvh * skh + rd[:, None]  # k^T tile [BLOCK_D, BLOCK_N]
    v_head = vc_ptr + kvh * svh + rd[None, :]  # v tile [BLOCK_N, BLOCK_D]
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if HAS_WINDOW:
        mid = k_lo
    else:  # keys below the block's first query are seen by all its queries: those tiles need no mask
        mid = tl.minimum(tl.maximum((ctx + qb * BLOCK_Q + 1) // BLOCK_N * BLOCK_N, k_lo), k_hi)
        m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, k_lo, mid, k_hi, pos, bt_row, k_head, v_head, skb, sko,
                                      svb, svo, qk_scale, soft_cap, window, d_ok, False, False, HAS_CAP,
                                      BLOCK_N, BLOCK_SIZE, CDT, PREC)
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, mid, k_hi, k_hi, pos, bt_row, k_head, v_head, skb, sko, svb,
                                  svo, qk_scale, soft_cap, window, d_ok, True, HAS_WINDOW, HAS_CAP, BLOCK_N,
                                  BLOCK_SIZE, CDT, PREC)

    seen = l_i > 0.0  # false only for a split that holds none of a query's keys
    out = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = q_rows[:, None] * spt + head[:, None] * sph + split * sps
        tl.store(po_ptr + part + rd[None, :], tl.where(seen[:, None], out, 0.0), mask=ok)
        ml = q_rows * smt + head * smh + split * 2  # (row max, row sum) pairs
        tl.store(pml_ptr + ml, m_i, mask=row_ok)
        tl.store(pml_ptr + ml + 1, l_i, mask=row_ok)
    else:
        tl.store(o_ptr + q_rows[:, None] * sot + head[:, None] * soh + rd[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _merge_splits_kernel(po_ptr, pml_ptr, o_ptr, qsl_ptr, num_seqs, num_splits, spt, sph, sps, smt, smh, sot,
                         soh, HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr):
    start_after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if t >= tl.load(qsl_ptr + num_seqs):  # padding rows: no partials were written for them
        return
    rs = tl.arange(0, S_PAD)
    rd = tl.arange(0, BLOCK_D)
    s_ok = rs < num_splits
    ml = t * smt + h * smh + rs * 2
    m = tl.load(pml_ptr + ml, mask=s_ok, other=float("-inf"))
    lsum = tl.load(pml_ptr + ml + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(lsum > 0.0, lsum * tl.math.exp2(m - m_all), 0.0)
    parts = tl.load(po_ptr + t * spt + h * sph + rs[:, None] * sps + rd[None, :],
                    mask=s_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + t * sot + h * soh + rd, out.to(o_ptr.dtype.element_ty), mask=rd < HEAD_DIM)


@dataclass(frozen=True)
class PagedConfig:
    """Tile of the attention kernel: block_m rows (queries x the KV head's query heads), block_n keys a step."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_config(max_query_len: int, group: int, head_dim: int) -> PagedConfig:
    """Decode (one query a sequence): the fewest rows tl.dot takes, holding the query heads of one KV head, and
    128 keys a step (64 above head dim 128); prefill chunks: 128 rows, 64 keys, 8 warps (64 rows, 32 keys, 4
    warps above head dim 128, to stay in registers)."""
    g_pad = triton.next_power_of_2(group)
    if max_query_len == 1:
        return PagedConfig(max(16, g_pad), 128 if head_dim <= 128 else 64, 4, 3)
    if head_dim <= 128:
        return PagedConfig(max(128, g_pad), 64, 8, 3)
    return PagedConfig(max(64, g_pad), 32, 4, 2)


def compute_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The type of the tiles fed to tl.dot: q's, but FP16 for 8-bit caches under 16-bit queries (FP8 E4M3 and
    INT8 codes convert to FP16 exactly, FP8 in one instruction per pair where BF16 takes several; BF16
    queries are clamped to FP16's range)."""
    if cache_dtype in CACHE_8BIT and q_dtype != torch.float32:
        return torch.float16
    return q_dtype


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      device: torch.device, min_split_len: int = 128) -> int:
    """Slices of the context per (sequence, KV head) for decode: enough programs for four a multiprocessor,
    each slice at least min_split_len keys; 1 (single pass) for prefill or when the batch fills the GPU."""
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    want = -(-4 * _num_sms(device) // programs)
    return max(1, min(want, max_seq_len // min_split_len))


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len,
                    softmax_scale, k_scale=None, v_scale=None, sliding_window=None, logits_soft_cap=None, out=None,
                    *, num_splits: int | None = None, config: PagedConfig | None = None):
    """Triton version of paged_attention_reference. num_splits: context slices for the split-K path (None:
    choose_num_splits; 1: single pass); config: the tile (None: choose_config). max_query_len and max_seq_len
    only steer those choices: the kernel reads each sequence's lengths from query_start_loc and seq_lens. Rows
    of q past query_start_loc[-1] (padding) are left as they are in `out`."""
    num_tokens, num_heads, d = q.shape
    kvh = k_cache.shape[2]
    if num_heads % kvh:
        raise ShapeError(f"paged attention: {num_heads} query heads are not a multiple of {kvh} KV heads.")
    _check_cache(k_cache, v_cache, k_scale, v_scale, kvh, d)
    if q.dtype not in _TL:
        raise ShapeError(f"paged attention: q is {q.dtype}; the kernel takes float16, bfloat16 or float32 queries.")
    q = _last_dim_contiguous(q)
    o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if o.shape != q.shape or o.stride(-1) != 1:
        raise ShapeError(f"paged attention: out {tuple(o.shape)} must be q's shape {tuple(q.shape)} with a "
                         "contiguous head dim.")
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return o
    group = num_heads // kvh
    cfg = config or choose_config(max_query_len, group, d)
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, cfg.block_m // g_pad)
    block_m = block_q * g_pad
    block_d = max(16, triton.next_power_of_2(d))
    splits = num_splits or choose_num_splits(num_seqs, kvh, max_query_len, max_seq_len, q.device)
    splits = max(1, min(splits, -(-max_seq_len // cfg.block_n)))  # no more slices than key tiles
    if splits > 1:
        partial = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
        max_sum = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        partial = max_sum = o
    scaled = k_cache.dtype in CACHE_8BIT
    cdt = compute_dtype(q.dtype, k_cache.dtype)
    qsl = query_start_loc if query_start_loc.dtype == torch.int32 else query_start_loc.to(torch.int32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    grid = (num_tokens // block_q + num_seqs, kvh, splits)
    pdl = launch_options(q.device)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, o, qsl, lens, tables, _scales(k_scale, q) if scaled else q,
        _scales(v_scale, q) if scaled else q, partial, max_sum, num_seqs,
        max(1, (num_seqs - 1).bit_length()), float(softmax_scale),
        float(logits_soft_cap or 0.0), int(sliding_window or 0),
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        tables.stride(0), *(partial.stride()[:3] if splits > 1 else (0, 0, 0)),
        *(max_sum.stride()[:2] if splits > 1 else (0, 0)),
        HEAD_DIM=d, G=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], KV_SCALED=scaled,
        HAS_WINDOW=bool(sliding_window), HAS_CAP=bool(logits_soft_cap), SPLIT=splits > 1, CDT=_TL[cdt],
        CLAMP_Q=q.dtype == torch.bfloat16 and cdt == torch.float16,
        PREC="ieee" if cdt == torch.float32 else "tf32", PDL=bool(pdl), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl)
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            partial, max_sum, o, qsl, num_seqs, splits, *partial.stride()[:3], *max_sum.stride()[:2], o.stride(0),
            o.stride(1),
            HEAD_DIM=d, S_PAD=triton.next_power_of_2(splits), BLOCK_D=block_d, PDL=bool(pdl),
            num_warps=1 if block_d <= 64 else 2, **pdl)
    return o
