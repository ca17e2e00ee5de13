"""Attention over the paged KV cache: one step's metadata, and the dispatch to the kernels.

On CUDA the Triton kernels of kiln.kernels.paged_attention run; elsewhere their torch references (same
signatures, same cache layout), so the CPU target exercises the very block tables the GPU reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels import paged_attention as pa


@dataclass
class AttentionMetadata:
    """One scheduler step, tokens of all sequences packed (the contract's layout)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset; -1 = not written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including this step's tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    max_query_len: int
    max_seq_len: int


@dataclass
class LayerCache:
    """One layer's paged K/V ([num_blocks, block_size, num_kv_heads, head_dim]) and their 8-bit scales."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def _kernels(device: torch.device):
    if device.type == "cuda" and hasattr(pa, "paged_attention") and hasattr(pa, "reshape_and_cache"):
        return pa.reshape_and_cache, pa.paged_attention
    return pa.reshape_and_cache_reference, pa.paged_attention_reference


def paged_attention(q, k, v, cache: LayerCache, md: AttentionMetadata, softmax_scale: float,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Writes this step's k, v [num_tokens, num_kv_heads, head_dim] into the cache, then attends the packed
    queries q [num_tokens, num_heads, head_dim] over each sequence's cached context."""
    write, attend = _kernels(q.device)
    write(k, v, cache.k, cache.v, md.slot_mapping, cache.k_scale, cache.v_scale)
    return attend(q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len,
                  md.max_seq_len, softmax_scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
