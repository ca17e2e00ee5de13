"""kiln.kernels.rope_cache (RoPE on q and k and the paged KV-cache write in one kernel) against the torch path it
replaces: kiln.llm.model.Rope on q and k, then paged_attention.reshape_and_cache_reference. Tiny shapes under
TRITON_INTERPRET=1 without a GPU: every cache type, a key offset, partial rotary, tokens spread over shuffled
blocks and padding rows of slot -1."""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.kernels import paged_attention as pa
from kiln.kernels.rope_cache import rope_and_cache
from kiln.llm import fused_ops
from kiln.llm.model import Rope

FP8 = torch.float8_e4m3fn


def poison(cache: torch.Tensor) -> torch.Tensor:
    """Slots nothing writes hold NaN (127 for INT8)."""
    return cache.fill_(127 if cache.dtype == torch.int8 else float("nan"))


def reference(qkv, positions, rope, nh, nkv, d, k_cache, v_cache, slots, ks, vs, ko):
    """The unfused path: q and k rotated by Rope (in qkv's type), then the torch cache write."""
    q = qkv[:, :nh * d].view(-1, nh, d)
    k = qkv[:, nh * d:(nh + nkv) * d].view(-1, nkv, d)
    v = qkv[:, (nh + nkv) * d:].view(-1, nkv, d)
    q, k = rope(q, positions), rope(k, positions)
    pa.reshape_and_cache_reference(k, v, k_cache, v_cache, slots, ks, vs, ko)
    return q


@pytest.mark.parametrize("cache_dtype,offset,rotary,nh,nkv", [
    (torch.float16, False, 16, 4, 2),  # the model's type, full rotary, GQA group 2
    (torch.float32, True, 16, 3, 3),  # an FP32 cache with a key offset, MHA with a non-power-of-two head count
    (FP8, True, 8, 6, 2),  # FP8 codes with an offset, partial rotary (half the head)
    (torch.int8, False, 12, 9, 3),  # INT8 codes per KV head, rotary 12 of 16, 9 heads over 3
])
def test_matches_unfused_path(cache_dtype, offset, rotary, nh, nkv):
    d, block_size, num_blocks, T = 16, 4, 7, 6
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(T, (nh + 2 * nkv) * d, generator=g) * 2).to(torch.float16).to(DEV)
    positions = torch.tensor([0, 5, 9, 3, 17, 2], device=DEV)
    # tokens in shuffled blocks and offsets; two padding rows (slot -1) that must write nothing
    slots = torch.tensor([4 * 5 + 1, -1, 4 * 2 + 3, 4 * 6 + 0, -1, 4 * 1 + 2], device=DEV)
    rope = Rope(rotary, 32, 10000.0, None, DEV)
    ks = vs = ko = None
    if cache_dtype in (FP8, torch.int8):
        top = 448.0 if cache_dtype == FP8 else 127.0
        ks = (torch.rand(nkv, generator=g) * 4 / top + 1e-3).to(DEV)
        vs = (torch.rand(nkv, generator=g) * 4 / top + 1e-3).to(DEV)
    if offset:
        ko = (torch.randn(nkv, d, generator=g) * 0.5).to(DEV)
    shape = (num_blocks, block_size, nkv, d)
    want_k, want_v = (poison(torch.empty(shape, dtype=cache_dtype, device=DEV)) for _ in range(2))
    got_k, got_v = want_k.clone(), want_v.clone()
    want_q = reference(qkv.clone(), positions, rope, nh, nkv, d, want_k, want_v, slots, ks, vs, ko)
    got_qkv = qkv.clone()
    rope_and_cache(got_qkv, positions, rope.cos, rope.sin, rope.dim, nh, nkv, d, got_k, got_v, slots, ks, vs, ko)
    assert torch.equal(got_qkv[:, :nh * d].view(-1, nh, d), want_q)
    assert torch.equal(got_qkv[:, nh * d:], qkv[:, nh * d:])  # k and v rows of qkv are left as they were
    # The two Triton kernels it replaces (RoPE in place on q and k, then the cache write): the same bits.
    two_qkv, two_k, two_v = qkv.clone(), poison(want_k.clone()), poison(want_v.clone())
    fused_ops.rope_(two_qkv[:, :(nh + nkv) * d].view(-1, nh + nkv, d), positions, rope.cos, rope.sin, rope.dim)
    pa.reshape_and_cache(two_qkv[:, nh * d:(nh + nkv) * d].view(-1, nkv, d), two_qkv[:, (nh + nkv) * d:].view(-1, nkv, d),
                         two_k, two_v, slots, ks, vs, ko)
    for got, want, two in ((got_k, want_k, two_k), (got_v, want_v, two_v)):
        assert same(got, two)
        if cache_dtype == FP8 and DEV == "cpu":
            # Triton's interpreter rounds an E4M3 value just under a power of two down across the exponent (125.2
            # to 64, not 128), in both kernels alike: the torch reference differs there alone
            assert (~same_elements(got, want)).sum() <= 0.01 * got.numel()
        else:
            assert same(got, want)


def same_elements(a, b):
    return a.float().nan_to_num(123.0) == b.float().nan_to_num(123.0)  # NaN where nothing was written, in both


def same(a, b):
    return bool(same_elements(a, b).all())


def test_no_tokens_is_a_no_op():
    qkv = torch.zeros(0, 4 * 16, dtype=torch.float16, device=DEV)
    cache = torch.zeros(2, 4, 1, 16, dtype=torch.float16, device=DEV)
    rope = Rope(16, 8, 10000.0, None, DEV)
    rope_and_cache(qkv, torch.zeros(0, dtype=torch.int64, device=DEV), rope.cos, rope.sin, 16, 2, 1, 16, cache,
                   cache.clone(), torch.zeros(0, dtype=torch.int64, device=DEV))
    assert not cache.any()
