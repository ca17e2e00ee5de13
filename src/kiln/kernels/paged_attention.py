"""Paged attention for Kiln-LLM: writing K/V into a block-paged cache, and attention over it.

Cache layout (one layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] of the model's
float type, torch.float8_e4m3fn or torch.int8. A token's slot is block_id * block_size + offset_in_block; a
sequence's blocks are listed, in order, in its row of block_tables.

8-bit caches carry FP32 scales [num_kv_heads]: stored = x / scale (FP8 E4M3: saturated to +-448 then rounded
to nearest even; INT8: rounded half to even, clamped to -127..127), dequantized = stored.float() * scale.

Tokens of all sequences of a step are packed without padding: sequence s owns query rows
query_start_loc[s] .. query_start_loc[s + 1]; its context has seq_lens[s] tokens, this step's included, so its
query j sits at absolute position p = seq_lens[s] - qlen_s + j and attends keys 0..p (with a sliding window w,
keys p - w + 1..p). Query head h reads KV head h // (num_heads // num_kv_heads).

The torch references (`*_reference`) are the ground truth and run on CPU; the Triton kernels of the same
signatures run on CUDA (and under TRITON_INTERPRET=1 on small shapes).
"""

from __future__ import annotations

import math

import torch

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

def reshape_and_cache_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Writes k, v [num_tokens, num_kv_heads, head_dim] into the caches at slot_mapping (-1: not written),
    quantizing for 8-bit caches."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize_kv(k[keep], k_scale, k_cache.dtype)
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

