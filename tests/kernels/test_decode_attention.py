"""kiln.kernels.decode_attention (a decode step's RoPE, KV-cache write and attention in one kernel) against the
two kernels it replaces (rope_cache, then paged_attention: the same bits) and the torch path (Rope,
reshape_and_cache_reference, paged_attention_reference). Tiny shapes under TRITON_INTERPRET=1 without a GPU:
several sequences over shuffled blocks, a padding row of slot -1, context slices, 8-bit caches with a key offset,
a sliding window, logit soft-capping, partial rotary, 9 query heads over 3 KV heads."""

from __future__ import annotations

import math
import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.kernels import paged_attention as pa  # noqa: E402
from kiln.kernels.decode_attention import decode_attention  # noqa: E402
from kiln.kernels.rope_cache import rope_and_cache  # noqa: E402
from kiln.llm.model import Rope  # noqa: E402

FP8 = torch.float8_e4m3fn
BS = 4


def _case(nh, nkv, d, cache_dtype, offset, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [13, 1, 29, 6]  # contexts including this step's token; the last row is padding (slot -1)
    n = len(seq_lens)
    per = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(per) + 2
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(per)
    tables = torch.zeros(n, width, dtype=torch.int32)
    slots = []
    for i, s in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(per[i])]
        tables[i, :per[i]] = torch.tensor(blocks)
        slots.append(blocks[(s - 1) // BS] * BS + (s - 1) % BS)
    slots[-1] = -1
    shape = (num_blocks, BS, nkv, d)
    k_cache = (torch.randn(shape, generator=g) * 2).to(cache_dtype)
    v_cache = (torch.randn(shape, generator=g) * 2).to(cache_dtype)
    ks = vs = ko = None
    if cache_dtype in (FP8, torch.int8):
        k_cache = (torch.randn(shape, generator=g) * 40).clamp(-100, 100).to(cache_dtype)
        v_cache = (torch.randn(shape, generator=g) * 40).clamp(-100, 100).to(cache_dtype)
        ks = (torch.rand(nkv, generator=g) * 0.05 + 0.02)
        vs = (torch.rand(nkv, generator=g) * 0.05 + 0.02)
    if offset:
        ko = torch.randn(nkv, d, generator=g) * 0.3
    qkv = (torch.randn(n, (nh + 2 * nkv) * d, generator=g) * 2).to(torch.float16)
    positions = torch.tensor([s - 1 for s in seq_lens])
    t = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    return dict(qkv=t(qkv), positions=t(positions), k_cache=t(k_cache), v_cache=t(v_cache), ks=t(ks), vs=t(vs),
                ko=t(ko), slots=t(torch.tensor(slots)), qsl=t(torch.arange(n + 1, dtype=torch.int32)),
                seq_lens=t(torch.tensor(seq_lens, dtype=torch.int32)), tables=t(tables), max_seq_len=32)


@pytest.mark.parametrize("nh,nkv,d,rotary,cache_dtype,offset,splits,window,cap", [
    (4, 2, 16, 16, torch.float16, False, 1, None, None),  # GQA 2, single pass
    (4, 2, 16, 16, torch.float16, False, 3, None, None),  # context slices and the merge
    (9, 3, 8, 8, torch.float32, True, 2, None, None),  # 9 over 3 heads, FP32 cache with a key offset
    (4, 1, 16, 8, FP8, True, 1, 5, None),  # FP8 codes, centred keys, partial rotary, a sliding window
    (4, 2, 16, 16, torch.int8, False, 2, None, 30.0),  # INT8 codes, soft-capped logits
])
def test_matches_the_two_kernels_and_torch(nh, nkv, d, rotary, cache_dtype, offset, splits, window, cap):
    c = _case(nh, nkv, d, cache_dtype, offset)
    rope = Rope(rotary, 64, 10000.0, None, DEV)
    scale = 1 / math.sqrt(d)
    kw = dict(k_scale=c["ks"], v_scale=c["vs"], sliding_window=window, logits_soft_cap=cap)
    n = c["qkv"].shape[0]

    def caches():
        return c["k_cache"].clone(), c["v_cache"].clone()

    got_k, got_v = caches()
    got = decode_attention(c["qkv"].clone(), c["positions"], rope.cos, rope.sin, rotary, nh, nkv, d, got_k, got_v,
                           c["slots"], c["qsl"], c["seq_lens"], c["tables"], c["max_seq_len"], scale, c["ks"],
                           c["vs"], c["ko"], window, cap, num_splits=splits)
    # the two kernels it replaces
    two_qkv, two_k, two_v = c["qkv"].clone(), *caches()
    rope_and_cache(two_qkv, c["positions"], rope.cos, rope.sin, rotary, nh, nkv, d, two_k, two_v, c["slots"],
                   c["ks"], c["vs"], c["ko"])
    args = (c["qsl"], c["seq_lens"], c["tables"], 1, c["max_seq_len"], scale)
    two = pa.paged_attention(two_qkv[:, :nh * d].view(n, nh, d), two_k, two_v, *args, **kw, num_splits=splits)
    assert torch.equal(got_k.float(), two_k.float()) and torch.equal(got_v.float(), two_v.float())
    assert torch.equal(got[:-1], two[:-1])  # the padding row's output is not looked at
    # the torch path
    ref_qkv, ref_k, ref_v = c["qkv"].clone(), *caches()
    q = rope(ref_qkv[:, :nh * d].view(n, nh, d), c["positions"])
    k = rope(ref_qkv[:, nh * d:(nh + nkv) * d].view(n, nkv, d), c["positions"])
    v = ref_qkv[:, (nh + nkv) * d:].view(n, nkv, d)
    pa.reshape_and_cache_reference(k, v, ref_k, ref_v, c["slots"], c["ks"], c["vs"], c["ko"])
    if cache_dtype == FP8 and DEV == "cpu":
        # Triton's interpreter rounds an E4M3 value just under a power of two down across the exponent (both
        # kernels alike, see test_rope_cache): attend over the cache the kernels wrote
        ref_k, ref_v = got_k, got_v
    want = pa.paged_attention_reference(q, ref_k, ref_v, *args, **kw)
    torch.testing.assert_close(got[:-1].float(), want[:-1].float(), atol=2e-3, rtol=2e-3)
