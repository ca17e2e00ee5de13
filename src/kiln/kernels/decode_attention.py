"""A decode step's attention with its RoPE and KV-cache write in the same kernel (one query a sequence).

Input: the QKV projection's rows qkv [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim], sequence s's query
in row s (a decode-only step: query_start_loc = 0, 1, ..., num_seqs). One program per (sequence, KV head,
context slice): it loads the query heads of its KV head and rotates them in registers (the rotate-half RoPE of
kiln.llm.model.Rope, rounded to qkv's type as the in-place kernel leaves them); the program whose slice holds the
sequence's new position rotates that KV head's key the same way and writes it, with the value, into the paged
cache at the token's slot (minus the key offset, as 8-bit codes for FP8/INT8 caches, exactly as
kernels/rope_cache.py does), and a barrier makes the write visible to the program's own key loop; then the online
softmax over the slice's keys as in kernels/paged_attention.py (same tiles, same arithmetic: the same bits as
rope_cache then paged_attention with this step's tile and slices). Slices are merged by paged_attention's merge
kernel.

At batch 1 this is one launch where RoPE + cache write and attention were two (a microsecond or two each in a
CUDA graph, 32 times a step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import ShapeError
from . import paged_attention as pa
from .pdl import launch_options, start_after_previous
from .rope_cache import _cache_codes

_COUNTERS: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The in-kernel merge's arrival counters of a device, one per (sequence, KV head); zeros between launches
    (the last slice resets its own), so they are allocated once, before any graph capture uses them."""
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    return c


@triton.jit
def _rotated(row, cos_ptr, sin_ptr, pos, stride_pos, d, ok, HALF: tl.constexpr, ROT: tl.constexpr, dt):
    """Features d of the heads at `row` (pointers to each head's first feature, [rows, 1]) with the first ROT
    rotated: x1 * c - x2 * s on the first half, x2 * c + x1 * s on the second (kiln.llm.fused_ops.rope_'s
    arithmetic), rounded to dt, then FP32."""
    x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
    first = d < HALF
    in_rot = d < ROT
    partner = tl.where(first, d + HALF, d - HALF)
    xp = tl.load(row + partner, mask=ok & in_rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * stride_pos + d, mask=in_rot, other=0.0)
    s = tl.load(sin_ptr + pos * stride_pos + d, mask=in_rot, other=0.0)
    rot = tl.where(first, x * c - xp * s, x * c + xp * s)
    return tl.where(in_rot, rot, x).to(dt).to(tl.float32)


@triton.jit
def _decode_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ko_ptr,
                             o_ptr, seq_lens_ptr, bt_ptr, po_ptr, pml_ptr, count_ptr, softmax_scale, soft_cap, window,
                             stride_t, stride_pos, skb, sko, skh, svb, svo, svh, sbt, sot, soh, spt, sph, sps, smt,
                             smh, NQ: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                             ROT: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
                             HAS_OFFSET: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
                             SPLIT: tl.constexpr, CDT: tl.constexpr, CLAMP_Q: tl.constexpr, PREC: tl.constexpr,
                             MERGE: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr):
    start_after_previous(PDL)  # first, before any program may return (see paged_attention's kernel)
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    dt = qkv_ptr.dtype.element_ty
    seq_len = tl.load(seq_lens_ptr + s)
    pos = tl.load(pos_ptr + s).to(tl.int64)
    row = qkv_ptr + s.to(tl.int64) * stride_t
    rd = tl.arange(0, BLOCK_D)
    d = rd[None, :]
    d_ok = rd < HEAD_DIM

    k_lo = 0
    k_hi = seq_len
    if HAS_WINDOW:
        k_lo = tl.maximum(seq_len - window, 0)
    if SPLIT:  # this sequence's context in equal slices of whole key tiles (paged_attention's rule)
        split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        k_lo = tl.maximum(k_lo, split * split_len)
        k_hi = tl.minimum(k_hi, (split + 1) * split_len)
    k_lo = (k_lo // BLOCK_N) * BLOCK_N

    # this step's key and value, written by the program whose slice holds the new position
    slot = tl.load(slot_ptr + s)
    if (slot >= 0) & (seq_len - 1 >= k_lo) & (seq_len - 1 < k_hi):
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        kvh_v = kvh + tl.zeros((1,), dtype=tl.int32)
        k = _rotated(row + (NQ + kvh) * HEAD_DIM + tl.zeros((1, 1), dtype=tl.int32), cos_ptr, sin_ptr, pos,
                     stride_pos, d, d_ok[None, :], HALF, ROT, dt)
        if HAS_OFFSET:
            k -= tl.load(ko_ptr + kvh * HEAD_DIM + d, mask=d_ok[None, :], other=0.0)
        tl.store(kc_ptr + blk * skb + off * sko + kvh * skh + d,
                 _cache_codes(k, ks_ptr, kvh_v, KVH, QUANT).to(kc_ptr.dtype.element_ty), mask=d_ok[None, :])
        v = tl.load(row + (NQ + KVH + kvh) * HEAD_DIM + d, mask=d_ok[None, :], other=0.0)
        if QUANT != "":
            v = _cache_codes(v.to(tl.float32), vs_ptr, kvh_v, KVH, QUANT)
        tl.store(vc_ptr + blk * svb + off * svo + kvh * svh + d, v.to(vc_ptr.dtype.element_ty), mask=d_ok[None, :])
    tl.debug_barrier()  # the key loop below reads that slot

    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < G
    head = kvh * G + rm
    q = _rotated(row + head[:, None] * HEAD_DIM, cos_ptr, sin_ptr, pos, stride_pos, d,
                 row_ok[:, None] & d_ok[None, :], HALF, ROT, dt)
    if CLAMP_Q:  # BF16 queries computed in FP16 (8-bit caches): kept finite
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0)
    q = q.to(CDT)

    if QUANT != "":
        k_scale = tl.load(ks_ptr + kvh)
        v_scale = tl.load(vs_ptr + kvh)
    else:
        k_scale = 1.0
        v_scale = 1.0
    if HAS_CAP:
        qk_scale = softmax_scale * k_scale
    else:
        qk_scale = softmax_scale * k_scale * 1.4426950408889634
    qpos = (seq_len - 1) + tl.zeros((BLOCK_M,), dtype=tl.int32)
    bt_row = bt_ptr + s.to(tl.int64) * sbt
    k_head = kc_ptr + kvh * skh + rd[:, None]
    v_head = vc_ptr + kvh * svh + rd[None, :]
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if HAS_WINDOW:
        mid = k_lo
    else:  # every key before the new one is seen: tiles below it need no mask (paged_attention's split point)
        mid = tl.minimum(tl.maximum(seq_len // BLOCK_N * BLOCK_N, k_lo), k_hi)
        m_i, l_i, acc = pa._attend_tiles(q, m_i, l_i, acc, k_lo, mid, k_hi, qpos, bt_row, k_head, v_head, skb, sko,
                                         svb, svo, qk_scale, soft_cap, window, d_ok, False, False, HAS_CAP, BLOCK_N,
                                         BLOCK_SIZE, CDT, PREC)
    m_i, l_i, acc = pa._attend_tiles(q, m_i, l_i, acc, mid, k_hi, k_hi, qpos, bt_row, k_head, v_head, skb, sko, svb,
                                     svo, qk_scale, soft_cap, window, d_ok, True, HAS_WINDOW, HAS_CAP, BLOCK_N,
                                     BLOCK_SIZE, CDT, PREC)

    seen = l_i > 0.0
    out = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    ok = row_ok[:, None] & d_ok[None, :]
    t = s.to(tl.int64)
    if SPLIT:
        part = t * spt + head[:, None] * sph + split * sps
        tl.store(po_ptr + part + rd[None, :], tl.where(seen[:, None], out, 0.0), mask=ok)
        ml = t * smt + head * smh + split * 2
        tl.store(pml_ptr + ml, m_i, mask=row_ok)
        tl.store(pml_ptr + ml + 1, l_i, mask=row_ok)
        if MERGE:  # the slice that counts itself last merges them all (paged_attention's merge, head by head)
            tl.debug_barrier()  # every thread's partials are written before the count says so
            slices = tl.num_programs(2)
            arrived = tl.atomic_add(count_ptr + s * KVH + kvh, 1, sem="acq_rel", scope="gpu")
            if arrived == slices - 1:
                rs = tl.arange(0, S_PAD)
                s_ok = rs < slices
                for gi in tl.static_range(G):
                    h = kvh * G + gi
                    mlh = t * smt + h * smh + rs * 2
                    m = tl.load(pml_ptr + mlh, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                    lsum = tl.load(pml_ptr + mlh + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
                    m_all = tl.max(m, 0)
                    w = tl.where(lsum > 0.0, lsum * tl.math.exp2(m - m_all), 0.0)
                    parts = tl.load(po_ptr + t * spt + h * sph + rs[:, None] * sps + rd[None, :],
                                    mask=s_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
                    merged = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
                    tl.store(o_ptr + t * sot + h * soh + rd, merged.to(o_ptr.dtype.element_ty), mask=d_ok)
                tl.atomic_xchg(count_ptr + s * KVH + kvh, 0)  # ready for the next launch (and graph replay)
    else:
        tl.store(o_ptr + t * sot + head[:, None] * soh + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=ok)


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rotary_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int, softmax_scale: float, k_scale=None, v_scale=None,
                     k_offset=None, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                     *, num_splits: int | None = None, merge_in_kernel: bool = False) -> torch.Tensor:
    """RoPE on the step's q and k, the k/v cache write and attention, one query a sequence (see above): returns
    the attention output [num_seqs, num_heads, head_dim] in qkv's type. query_start_loc is 0, 1, ..., num_seqs
    (read only by the slices' merge). num_splits: context slices (None: paged_attention.choose_num_splits for a
    decode step of max_seq_len). merge_in_kernel: the last slice of each sequence and KV head to finish merges the
    slices (no second launch; counters as kernels/fp8_gemv.py's split-K has) instead of the merge kernel."""
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ShapeError(f"decode attention: qkv {list(qkv.shape)} must be [tokens, (num_heads + 2 * num_kv_heads) "
                         f"* head_dim = {(num_heads + 2 * num_kv_heads) * head_dim}] with unit stride along a row.")
    if num_heads % num_kv_heads or seq_lens.shape[0] != T:
        raise ShapeError(f"decode attention: {num_heads} query heads over {num_kv_heads} KV heads, {T} tokens for "
                         f"{seq_lens.shape[0]} sequences (one query a sequence).")
    pa._check_cache(k_cache, v_cache, k_scale, v_scale, num_kv_heads, head_dim)
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride() and rotary_dim % 2 == 0 and rotary_dim <= head_dim
    o = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return o
    group = num_heads // num_kv_heads
    cfg = pa.choose_config(1, group, head_dim)
    g_pad = triton.next_power_of_2(group)
    block_m = max(cfg.block_m, g_pad)
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = num_splits or pa.choose_num_splits(T, num_kv_heads, 1, max_seq_len, qkv.device)
    splits = max(1, min(splits, -(-max_seq_len // cfg.block_n)))
    if splits > 1:
        partial = torch.empty((T, num_heads, splits, block_d), dtype=torch.float32, device=qkv.device)
        max_sum = torch.empty((T, num_heads, splits, 2), dtype=torch.float32, device=qkv.device)
    else:
        partial = max_sum = o
    quant = pa._quant_name(k_cache.dtype)
    cdt = pa.compute_dtype(qkv.dtype, k_cache.dtype)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
    pdl = launch_options(qkv.device)
    merge = merge_in_kernel and splits > 1
    counts = _counters(qkv.device) if merge else lens
    if merge and T * num_kv_heads > counts.numel():
        raise ShapeError(f"decode attention: {T} sequences x {num_kv_heads} KV heads exceed the merge counters "
                         f"({counts.numel()}).")
    _decode_attention_kernel[(T, num_kv_heads, splits)](
        qkv, cos, sin, pos, slots, k_cache, v_cache, pa._scales(k_scale, cos), pa._scales(v_scale, cos),
        pa._scales(k_offset, cos), o, lens, tables, partial, max_sum, counts, float(softmax_scale),
        float(logits_soft_cap or 0.0), int(sliding_window or 0), qkv.stride(0), cos.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], tables.stride(0), o.stride(0), o.stride(1),
        *(partial.stride()[:3] if splits > 1 else (0, 0, 0)), *(max_sum.stride()[:2] if splits > 1 else (0, 0)),
        NQ=num_heads, KVH=num_kv_heads, HEAD_DIM=head_dim, HALF=rotary_dim // 2, ROT=rotary_dim, G=group,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1], QUANT=quant,
        HAS_OFFSET=k_offset is not None, HAS_WINDOW=bool(sliding_window), HAS_CAP=bool(logits_soft_cap),
        SPLIT=splits > 1, CDT=pa._TL[cdt], CLAMP_Q=qkv.dtype == torch.bfloat16 and cdt == torch.float16,
        PREC="ieee" if cdt == torch.float32 else "tf32", MERGE=merge, S_PAD=triton.next_power_of_2(splits),
        PDL=bool(pdl), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if splits > 1 and not merge:
        qsl = query_start_loc if query_start_loc.dtype == torch.int32 else query_start_loc.to(torch.int32)
        pa._merge_splits_kernel[(T, num_heads)](
            partial, max_sum, o, qsl, T, splits, *partial.stride()[:3], *max_sum.stride()[:2], o.stride(0),
            o.stride(1), HEAD_DIM=head_dim, S_PAD=triton.next_power_of_2(splits), BLOCK_D=block_d, PDL=bool(pdl),
            num_warps=1 if block_d <= 64 else 2, **pdl)
    return o
