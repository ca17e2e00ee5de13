"""Attention over the paged KV cache: one step's metadata, and the dispatch to the kernels.

On CUDA the Triton kernels of kiln.kernels.paged_attention run; elsewhere their torch references (same
signatures, same cache layout), so the CPU target exercises the very block tables the GPU reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import ConfigError
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


class KVScales(tuple):
    """One layer's calibrated (k_scale, v_scale) for an 8-bit cache, FP32 [num_kv_heads] each, and the key offset
    its cache subtracts before quantizing (FP32 [num_kv_heads, head_dim], or None; see
    kiln.kernels.paged_attention). It unpacks as the pair: code that knows only the scales keeps working, and
    without the offset the same scales hold the uncentred keys as well (they are taken from the keys' own
    range, not the centred one)."""

    k_offset: torch.Tensor | None

    def __new__(cls, k_scale: torch.Tensor, v_scale: torch.Tensor, k_offset: torch.Tensor | None = None):
        pair = super().__new__(cls, (k_scale, v_scale))
        pair.k_offset = k_offset
        return pair


def key_offset(scales, device=None) -> torch.Tensor | None:
    """The key offset a layer's scales carry (a KVScales; FP32, on `device` when given), else None."""
    offset = getattr(scales, "k_offset", None)
    return offset if offset is None or device is None else offset.to(device, torch.float32)


@dataclass
class LayerCache:
    """One layer's paged K/V ([num_blocks, block_size, num_kv_heads, head_dim]), their 8-bit scales and the key
    offset subtracted before storing."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None


def _kernels(device: torch.device):
    if device.type == "cuda" and hasattr(pa, "paged_attention") and hasattr(pa, "reshape_and_cache"):
        return pa.reshape_and_cache, pa.paged_attention
    return pa.reshape_and_cache_reference, pa.paged_attention_reference


def paged_attention(q, k, v, cache: LayerCache, md: AttentionMetadata, softmax_scale: float,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Writes this step's k, v [num_tokens, num_kv_heads, head_dim] into the cache, then attends the packed
    queries q [num_tokens, num_heads, head_dim] over each sequence's cached context."""
    write, _ = _kernels(q.device)
    check_key_offset(cache, logits_soft_cap)
    write(k, v, cache.k, cache.v, md.slot_mapping, cache.k_scale, cache.v_scale, cache.k_offset)
    return attend(q, cache, md, softmax_scale, sliding_window, logits_soft_cap)


def attend(q, cache: LayerCache, md: AttentionMetadata, softmax_scale: float, sliding_window: int | None = None,
           logits_soft_cap: float | None = None) -> torch.Tensor:
    """The packed queries q over each sequence's cached context, this step's keys and values already written
    (paged_attention without the write: kiln.kernels.rope_cache writes them with RoPE)."""
    _, attend_kernel = _kernels(q.device)
    check_key_offset(cache, logits_soft_cap)
    return attend_kernel(q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len,
                         md.max_seq_len, softmax_scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
                         sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


def check_key_offset(cache: LayerCache, logits_soft_cap: float | None) -> None:
    if cache.k_offset is not None and logits_soft_cap:
        raise ConfigError("a key offset in the KV cache cannot be used with logit soft-capping (the scores' "
                          "common shift then changes the result); calibrate this model's cache without it.")
