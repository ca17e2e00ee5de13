"""Paged attention: the torch references against plain dense attention per sequence, the Triton kernels against
the references (tiny shapes under TRITON_INTERPRET=1 without a GPU, realistic ones on the GPU)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kiln.kernels import paged_attention as pa

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def dense_causal_attention(q, k, v, softmax_scale, sliding_window=None, logits_soft_cap=None):
    """softmax(q k^T) v of one sequence whose queries are its last len(q) positions, one query and head at a
    time: q [qlen, heads, d], k, v [seq_len, heads, d] (already one per query head), FP32."""
    qlen, seq_len = q.shape[0], k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float32)
    for h in range(q.shape[1]):
        for j in range(qlen):
            p = seq_len - qlen + j
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            s = (k[lo:p + 1, h].float() @ q[j, h].float()) * softmax_scale
            if logits_soft_cap:
                s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
            out[j, h] = torch.softmax(s, dim=0) @ v[lo:p + 1, h].float()
    return out


@dataclass
class Batch:
    """One step's packed queries over a paged cache, with each sequence's dense K/V (dequantized) beside it."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    dense_k: list[torch.Tensor]
    dense_v: list[torch.Tensor]
    qlens: list[int]

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                max(self.qlens), int(self.seq_lens.max()))

    def scales(self):
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)


def poison(cache: torch.Tensor) -> torch.Tensor:
    """Every slot no test token owns holds NaN (127 for INT8): a kernel that reads one shows it."""
    return cache.fill_(127 if cache.dtype == torch.int8 else float("nan"))


def make_batch(qlens, seq_lens, heads, kv_heads, d, block_size=4, dtype=torch.float32, cache_dtype=None,
               seed=0, device="cpu", reshape=pa.reshape_and_cache_reference) -> Batch:
    """Sequences of context seq_lens whose last qlens tokens are this step's queries. Their blocks are scattered
    over the cache in a shuffled order, with spare blocks; block_tables' padding points at a poisoned block. The
    cache is written through `reshape` (tokens in a shuffled order, plus tokens of slot -1 that must not land)."""
    cache_dtype = cache_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 stays poisoned
    width = max(per_seq) + 2
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    ks, vs, slots = [], [], []
    for s, n in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(per_seq[s])]
        tables[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        ks.append(torch.randn(n, kv_heads, d, generator=g).to(dtype))
        vs.append(torch.randn(n, kv_heads, d, generator=g).to(dtype))
        pos = torch.arange(n)
        slots.append(torch.tensor(blocks, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size)
    k_all, v_all, slot_all = torch.cat(ks), torch.cat(vs), torch.cat(slots)
    junk = 5  # tokens that must not be written (slot -1): padding of a captured step
    k_all = torch.cat([k_all, torch.full((junk, kv_heads, d), 1e4).to(dtype)])
    v_all = torch.cat([v_all, torch.full((junk, kv_heads, d), 1e4).to(dtype)])
    slot_all = torch.cat([slot_all, torch.full((junk,), -1, dtype=torch.int64)])
    shuffle = torch.randperm(len(slot_all), generator=g)
    k_all, v_all, slot_all = k_all[shuffle], v_all[shuffle], slot_all[shuffle]

    k_scale = v_scale = None
    if cache_dtype in pa.CACHE_8BIT:
        k_scale = pa.kv_scales(torch.cat(ks), cache_dtype)
        v_scale = pa.kv_scales(torch.cat(vs), cache_dtype) * 1.1  # some headroom: codes below the top
    shape = (num_blocks, block_size, kv_heads, d)
    k_cache = poison(torch.empty(shape, dtype=cache_dtype))
    v_cache = poison(torch.empty(shape, dtype=cache_dtype))
    to = (lambda t: t.to(device) if t is not None else None)
    k_cache, v_cache = to(k_cache), to(v_cache)
    reshape(to(k_all), to(v_all), k_cache, v_cache, to(slot_all), to(k_scale), to(v_scale))

    def dense(x, scale):
        return pa.dequantize_kv(pa.quantize_kv(x, scale, cache_dtype), scale)

    q = torch.randn(sum(qlens), heads, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(to(q), k_cache, v_cache, to(k_scale), to(v_scale), to(qsl),
                 to(torch.tensor(seq_lens, dtype=torch.int32)), to(tables),
                 [dense(x, k_scale) for x in ks], [dense(x, v_scale) for x in vs], list(qlens))


def dense_result(b: Batch, softmax_scale, sliding_window=None, logits_soft_cap=None) -> torch.Tensor:
    group = b.q.shape[1] // b.k_cache.shape[2]
    outs, start = [], 0
    for s, qlen in enumerate(b.qlens):
        outs.append(dense_causal_attention(b.q[start:start + qlen].cpu(), b.dense_k[s].repeat_interleave(group, 1),
                                           b.dense_v[s].repeat_interleave(group, 1), softmax_scale,
                                           sliding_window, logits_soft_cap))
        start += qlen
    return torch.cat(outs)


# a mixed step: two decodes, a first prefill chunk, a later chunk, a decode at a block edge (TINY reads the long
# ones through unmasked key tiles below their first query, then masked ones)
MIXED_QLENS = [1, 1, 7, 5, 1]
MIXED_SEQ_LENS = [35, 1, 7, 37, 8]


# --------------------------------------------------------------------------------------------------------------
# The references against dense attention
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (4, 1)])
def test_reference_matches_dense_attention_on_a_mixed_batch(heads, kv_heads):
    b = make_batch(MIXED_QLENS, MIXED_SEQ_LENS, heads, kv_heads, 8)
    got = pa.paged_attention_reference(*b.args(), 0.3)
    torch.testing.assert_close(got, dense_result(b, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,cap", [(3, None), (None, 2.0), (4, 1.5)])
def test_reference_sliding_window_and_soft_cap(window, cap):
    b = make_batch(MIXED_QLENS, MIXED_SEQ_LENS, 9, 3, 8)
    got = pa.paged_attention_reference(*b.args(), 0.5, sliding_window=window, logits_soft_cap=cap)
    torch.testing.assert_close(got, dense_result(b, 0.5, window, cap), atol=1e-5, rtol=1e-5)
    if window:  # a window changes long sequences' results
        assert not torch.allclose(got, pa.paged_attention_reference(*b.args(), 0.5, logits_soft_cap=cap))


@pytest.mark.parametrize("cache_dtype", [FP8, torch.int8])
def test_reference_with_8_bit_caches_matches_dense_attention_of_the_dequantized_values(cache_dtype):
    b = make_batch(MIXED_QLENS, MIXED_SEQ_LENS, 9, 3, 8, cache_dtype=cache_dtype)
    got = pa.paged_attention_reference(*b.args(), 0.3, **b.scales())
    torch.testing.assert_close(got, dense_result(b, 0.3), atol=1e-5, rtol=1e-5)
    # and close to the float values it quantized (the codes are not thrown away)
    f = make_batch(MIXED_QLENS, MIXED_SEQ_LENS, 9, 3, 8)
    err = (got - pa.paged_attention_reference(*f.args(), 0.3)).abs().max().item()
    assert err < (0.15 if cache_dtype == FP8 else 0.05), err


def test_reference_output_dtype_and_out():
    b = make_batch([1, 3], [5, 3], 4, 2, 8, dtype=torch.bfloat16)
    got = pa.paged_attention_reference(*b.args(), 0.3)
    assert got.dtype == torch.bfloat16 and got.shape == b.q.shape
    out = torch.full(b.q.shape, float("nan"), dtype=torch.bfloat16)
    assert pa.paged_attention_reference(*b.args(), 0.3, out=out) is out
    torch.testing.assert_close(out, got)


def test_quantize_rules():
    scale = torch.tensor([0.5, 2.0])
    x = torch.tensor([[[0.25, 1000.0, -1000.0, 0.3]], [[3.0, 1.0, 300.0, -255.0]]]).transpose(0, 1)  # [1, 2, 4]
    i8 = pa.quantize_kv(x, scale, torch.int8)
    # x / scale, round half to even, clamp to +-127
    assert i8.tolist() == [[[0, 127, -127, 1], [2, 0, 127, -127]]]
    f8 = pa.quantize_kv(x, scale, FP8)
    # saturating at +-448 (no inf/nan), rounded to nearest
    assert f8.float().tolist() == [[[0.5, 448.0, -448.0, 0.625], [1.5, 0.5, 144.0, -128.0]]]
    torch.testing.assert_close(pa.dequantize_kv(i8, scale), i8.float() * scale[:, None])
    assert pa.kv_scales(x, torch.int8).tolist() == pytest.approx([1000 / 127, 300 / 127])
    assert pa.kv_scales(x, FP8).tolist() == pytest.approx([1000 / 448, 1000 / 448])


def test_reshape_and_cache_reference_writes_only_mapped_slots():
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    k_cache = poison(torch.empty(2, 4, 2, 4))
    v_cache = poison(torch.empty(2, 4, 2, 4))
    pa.reshape_and_cache_reference(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 0], v[2])
    assert int(torch.isnan(k_cache).flatten(2).all(-1).sum()) == 2 * 4 - 2  # the other slots untouched


# --------------------------------------------------------------------------------------------------------------
# The Triton kernels against the references (tiny shapes: under TRITON_INTERPRET=1 without a GPU)
# --------------------------------------------------------------------------------------------------------------

INTERPRETED = DEV == "cpu"
TINY = pa.PagedConfig(16, 16, 4, 1)  # several key steps per sequence; 16 rows hold 4 queries x a group of 3


def _check_kernel(b: Batch, scale=0.3, tol=2e-5, **kw):
    want = pa.paged_attention_reference(*b.args(), scale, **b.scales(), **kw)
    for splits in (1, 3):
        got = pa.paged_attention(*b.args(), scale, **b.scales(), **kw, num_splits=splits, config=TINY)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"num_splits={splits}: {m}")
    return want


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1)])
def test_kernel_on_a_mixed_prefill_and_decode_batch(heads, kv_heads):
    """Packed decodes and prefill chunks, GQA 9 over 3 (a group padded to 4) and MQA, single pass and split-K."""
    _check_kernel(make_batch(MIXED_QLENS, MIXED_SEQ_LENS, heads, kv_heads, 16, device=DEV))


def test_kernel_sliding_window_and_soft_cap():
    b = make_batch(MIXED_QLENS, [9, 1, 7, 40, 8], 9, 3, 16, device=DEV)
    want = _check_kernel(b, 0.5, sliding_window=6, logits_soft_cap=1.5)
    assert not torch.allclose(want, pa.paged_attention_reference(*b.args(), 0.5, logits_soft_cap=1.5))


@pytest.mark.parametrize("cache_dtype", [FP8, torch.int8])
def test_kernel_dequantizes_8_bit_caches(cache_dtype):
    _check_kernel(make_batch(MIXED_QLENS, MIXED_SEQ_LENS, 9, 3, 16, cache_dtype=cache_dtype, device=DEV))


def test_kernel_pads_a_head_dim_that_is_not_a_power_of_two_in_fp16():
    """(BF16 is a GPU test: Triton's interpreter multiplies bf16 operands as raw uint16.)"""
    b = make_batch([1, 6], [21, 6], 4, 2, 20, dtype=torch.float16, device=DEV)
    _check_kernel(b, tol=2e-2)


def test_kernel_writes_out_and_leaves_padding_rows():
    """With `out`, the result lands there; rows past query_start_loc[-1] (a padded step) keep their values."""
    b = make_batch([1, 1, 1], [30, 5, 17], 4, 2, 16, device=DEV)
    want = pa.paged_attention_reference(*b.args(), 0.3)
    q = torch.cat([b.q, torch.randn(2, 4, 16, device=DEV)])
    for splits in (1, 2):
        out = torch.full(q.shape, 7.0, device=DEV)
        got = pa.paged_attention(q, *b.args()[1:], 0.3, out=out, num_splits=splits, config=TINY)
        assert got is out
        torch.testing.assert_close(out[:3], want, atol=2e-5, rtol=2e-5)
        assert bool((out[3:] == 7.0).all())


def test_split_k_slices_each_context_by_its_own_length():
    """max_seq_len only bounds the number of slices (no more than its key tiles); each sequence's context is
    sliced by its own length, so one longer than max_seq_len is still read whole."""
    b = make_batch([1, 3], [100, 60], 4, 2, 16, device=DEV)
    args = list(b.args())
    args[7] = 48  # three splits of 16 keys under TINY
    got = pa.paged_attention(*args, 0.3, num_splits=3, config=TINY)
    torch.testing.assert_close(got, pa.paged_attention_reference(*b.args(), 0.3), atol=2e-5, rtol=2e-5)


def test_kernel_default_choices_on_a_decode_batch():
    b = make_batch([1] * 3, [3, 40, 11], 8, 2, 16, block_size=8, device=DEV)
    torch.testing.assert_close(pa.paged_attention(*b.args(), 0.3), pa.paged_attention_reference(*b.args(), 0.3),
                               atol=2e-5, rtol=2e-5)


def _kv_for_cache(cache_dtype, tokens, kv_heads, d, scale, seed=0):
    """Random K or V, some far above the scale's range (to saturate). Without a GPU, FP8 values are made exact
    codes times power-of-two scales: Triton's interpreter loses the carry into the exponent when it rounds FP32
    to FP8 (just under 32 becomes 16), where the GPU's cvt.rn.satfinite rounds to nearest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, kv_heads, d, generator=g) * scale[:, None] * 200
    if cache_dtype == FP8 and INTERPRETED:
        code = x / scale[:, None]
        x = torch.where(code.abs() <= 448, code.to(FP8).float(), code) * scale[:, None]
    return x


GPU_ONLY_BF16 = pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter converts bf16 from raw uint16")


@pytest.mark.parametrize("cache_dtype,dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (FP8, torch.float32), (torch.int8, torch.float16),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=GPU_ONLY_BF16),
    pytest.param(FP8, torch.bfloat16, marks=GPU_ONLY_BF16)])
def test_reshape_and_cache_kernel_writes_what_the_reference_writes(cache_dtype, dtype):
    """Bit for bit, the poison of unwritten slots included; 8-bit codes saturate (some values are far above
    the scale's range)."""
    kv_heads, d, bs = 3, 20, 4
    scale = torch.tensor([0.5, 1.0, 2.0**-5 if INTERPRETED else 0.03])
    k = _kv_for_cache(cache_dtype, 11, kv_heads, d, scale, 1).to(dtype)
    v = _kv_for_cache(cache_dtype, 11, kv_heads, d, scale, 2).to(dtype)
    slots = torch.tensor([9, -1, 0, 3, 4, 22, -1, 13, 14, 15, 2])
    caches = []
    for fn in (pa.reshape_and_cache_reference, pa.reshape_and_cache):
        kc = poison(torch.empty(6, bs, kv_heads, d, dtype=cache_dtype)).to(DEV)
        vc = poison(torch.empty(6, bs, kv_heads, d, dtype=cache_dtype)).to(DEV)
        scales = dict(k_scale=scale.to(DEV), v_scale=scale.to(DEV)) if cache_dtype in pa.CACHE_8BIT else {}
        fn(k.to(DEV), v.to(DEV), kc, vc, slots.to(DEV), **scales)
        caches.append((kc.cpu(), vc.cpu()))
    for want, got in zip(caches[0], caches[1]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_key_offset_is_subtracted_before_storing_and_attention_does_not_see_it(cache_dtype):
    """Both writers store k - k_offset (the same codes); attention over the centred keys of a float cache equals
    attention over the keys themselves (softmax ignores the scores' common shift q . k_offset)."""
    kv_heads, d, bs, n = 2, 16, 4, 9
    g = torch.Generator().manual_seed(3)
    offset = torch.randn(kv_heads, d, generator=g) * 4
    scale = torch.tensor([2.0**-4, 2.0**-3])
    k = (_kv_for_cache(cache_dtype, n, kv_heads, d, scale, 4) / 50 if cache_dtype == FP8
         else torch.randn(n, kv_heads, d, generator=g)) + offset
    v = torch.randn(n, kv_heads, d, generator=g)
    slots = torch.arange(n)
    stored = []
    for fn in (pa.reshape_and_cache_reference, pa.reshape_and_cache):
        kc = torch.zeros(3, bs, kv_heads, d, dtype=cache_dtype, device=DEV)
        vc = torch.zeros_like(kc)
        scales = dict(k_scale=scale.to(DEV), v_scale=scale.to(DEV)) if cache_dtype == FP8 else {}
        fn(k.to(DEV), v.to(DEV), kc, vc, slots.to(DEV), k_offset=offset.to(DEV), **scales)
        stored.append((kc.cpu(), vc.cpu()))
    assert torch.equal(stored[0][0].view(torch.uint8), stored[1][0].view(torch.uint8))
    centred = pa.dequantize_kv(stored[0][0], scale if cache_dtype == FP8 else None).reshape(-1, kv_heads, d)[:n]
    if cache_dtype == FP8:
        return
    torch.testing.assert_close(centred, k - offset)
    q = torch.randn(3, 4, d, generator=g)
    meta = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
            torch.tensor([[0, 1, 2]], dtype=torch.int32), 3, n)
    plain_k = torch.zeros_like(stored[0][0])
    pa.reshape_and_cache_reference(k, v, plain_k, torch.zeros_like(plain_k), slots)
    got = pa.paged_attention_reference(q, stored[0][0], stored[0][1], *meta, 0.25)
    want = pa.paged_attention_reference(q, plain_k, stored[0][1], *meta, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# The compiler's view without a GPU: sm_90 code from Triton's bundled ptxas, in a fresh process (kernels defined
# under TRITON_INTERPRET cannot be compiled)
# --------------------------------------------------------------------------------------------------------------

_SM90_COMPILE = r"""
import inspect, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import paged_attention as pa

STRIDE_LIKE = set("sqt sqh sot soh skb sko skh svb svo svh sbt spt sph sps smt smh skt svt skcb skco skch svcb svco "
                  "svch".split())

def source(kernel, types, cx):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in cx else types.get(n, "i32") for n in names}
    # what a launch specializes: pointers and strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in cx and (n.endswith("_ptr") or n in STRIDE_LIKE)}
    return ASTSource(fn=kernel, signature=sig, constexprs=cx, attrs=attrs)

def attention(kv, split, block_m, g, window=False, cap=False):
    g_pad = triton.next_power_of_2(g)
    types = dict(q_ptr="*bf16", kc_ptr=kv, vc_ptr=kv, o_ptr="*bf16", qsl_ptr="*i32", seq_lens_ptr="*i32",
                 bt_ptr="*i32", ks_ptr="*fp32", vs_ptr="*fp32", po_ptr="*fp32", pml_ptr="*fp32",
                 softmax_scale="fp32", soft_cap="fp32")
    cx = dict(HEAD_DIM=128, G=g, G_PAD=g_pad, BLOCK_Q=block_m // g_pad, BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=128,
              BLOCK_SIZE=16, KV_SCALED=kv != "*bf16", HAS_WINDOW=window, HAS_CAP=cap, SPLIT=split,
              CDT=tl.bfloat16 if kv == "*bf16" else tl.float16, CLAMP_Q=kv != "*bf16", PREC="tf32", PDL=True)
    return source(pa._paged_attention_kernel, types, cx)

def cache(quant, ptr, offset=False):
    types = dict(k_ptr="*bf16", v_ptr="*bf16", kc_ptr=ptr, vc_ptr=ptr, slot_ptr="*i64", ks_ptr="*fp32",
                 vs_ptr="*fp32", ko_ptr="*fp32")
    cx = dict(KVH=8, HEAD_DIM=128, BLOCK_SIZE=16, QUANT=quant, HAS_OFFSET=offset, BLOCK_H=8, BLOCK_D=128, PDL=True)
    return source(pa._reshape_and_cache_kernel, types, cx)

merge = source(pa._merge_splits_kernel, dict(po_ptr="*fp32", pml_ptr="*fp32", o_ptr="*bf16", qsl_ptr="*i32"),
               dict(HEAD_DIM=128, S_PAD=4, BLOCK_D=128, PDL=True))
cases = [("decode bf16", attention("*bf16", False, 16, 4), 3),
         ("decode fp8 split", attention("*fp8e4nv", True, 16, 4), 3),
         ("decode int8 window cap", attention("*i8", False, 16, 4, True, True), 3),
         ("prefill bf16 gqa 3", attention("*bf16", False, 64, 3), 2), ("merge", merge, 1),
         ("cache fp8", cache("fp8", "*fp8e4nv"), 1), ("cache fp8 centred keys", cache("fp8", "*fp8e4nv", True), 1),
         ("cache int8", cache("int8", "*i8"), 1),
         ("cache bf16", cache("", "*bf16"), 1)]
for name, src, stages in cases:
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=stages)).asm["ptx"]
    print(name, "16-byte cp.async:", len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", ptx)))
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the GPU tests compile and run the kernels")
def test_kernels_compile_for_hopper_with_pipelined_16_byte_loads():
    """Catches what only the compiler refuses (the interpreter runs it all), and checks that the key loop's
    gathered K/V tiles are loaded ahead through 16-byte cp.async (what decode bandwidth rests on)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    counts = dict(line.rsplit(" 16-byte cp.async: ", 1) for line in run.stdout.splitlines())
    assert len(counts) == 9, run.stdout
    for name in ("decode bf16", "decode fp8 split", "decode int8 window cap", "prefill bf16 gqa 3"):
        assert int(counts[name]) > 0, run.stdout


# --------------------------------------------------------------------------------------------------------------
# On the GPU, at model shapes (Llama-style 32 query heads over 8 KV heads of dim 128, 16-token blocks)
# --------------------------------------------------------------------------------------------------------------

def _gpu_check(b: Batch, tol=2e-2, splits=(None, 1, 4), **kw):
    want = pa.paged_attention_reference(*b.args(), 1 / math.sqrt(b.q.shape[-1]), **b.scales(), **kw)
    for n in splits:
        got = pa.paged_attention(*b.args(), 1 / math.sqrt(b.q.shape[-1]), **b.scales(), **kw, num_splits=n)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"num_splits={n}: {m}")


GPU_MIXED_QLENS = [1, 1, 1, 1, 300, 77, 1, 129]
GPU_MIXED_SEQ_LENS = [1000, 2047, 17, 1, 813, 4000, 300, 129]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mixed_batch(dtype):
    _gpu_check(make_batch(GPU_MIXED_QLENS, GPU_MIXED_SEQ_LENS, 32, 8, 128, 16, dtype=dtype, device="cuda"))


@pytest.mark.gpu
def test_gpu_mixed_batch_sliding_window_soft_cap_gqa_9_over_3():
    b = make_batch(GPU_MIXED_QLENS, GPU_MIXED_SEQ_LENS, 9, 3, 128, 16, dtype=torch.bfloat16, device="cuda")
    _gpu_check(b, sliding_window=256, logits_soft_cap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80, 96, 256])
def test_gpu_head_dims(d):
    _gpu_check(make_batch([1, 1, 50], [700, 33, 260], 16, 4, d, 16, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [FP8, torch.int8])
def test_gpu_long_context_decode_with_8_bit_caches(cache_dtype):
    b = make_batch([1] * 6, [4096, 3000, 1, 4095, 17, 2500], 32, 8, 128, 16, dtype=torch.bfloat16,
                   cache_dtype=cache_dtype, device="cuda", reshape=pa.reshape_and_cache)
    _gpu_check(b)
    # the Triton-written cache holds the reference's codes
    r = make_batch([1] * 6, [4096, 3000, 1, 4095, 17, 2500], 32, 8, 128, 16, dtype=torch.bfloat16,
                   cache_dtype=cache_dtype, device="cuda")
    assert torch.equal(b.k_cache.view(torch.uint8), r.k_cache.view(torch.uint8))
    assert torch.equal(b.v_cache.view(torch.uint8), r.v_cache.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_float32_queries_and_a_large_decode_batch():
    b = make_batch([1] * 64, [257 + 61 * i for i in range(64)], 8, 2, 64, 32, dtype=torch.float32, device="cuda")
    _gpu_check(b, tol=1e-4, splits=(None, 1, 3))
