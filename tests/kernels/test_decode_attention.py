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

from kiln.kernels import paged_attention as pa
from kiln.kernels.decode_attention import decode_attention
from kiln.kernels.rope_cache import rope_and_cache
from kiln.llm.model import Rope

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
    t = lambda x: None if x is None else x.to(DEV)
    return dict(qkv=t(qkv), positions=t(positions), k_cache=t(k_cache), v_cache=t(v_cache), ks=t(ks), vs=t(vs),
                ko=t(ko), slots=t(torch.tensor(slots)), qsl=t(torch.arange(n + 1, dtype=torch.int32)),
                seq_lens=t(torch.tensor(seq_lens, dtype=torch.int32)), tables=t(tables), max_seq_len=32)


@pytest.mark.parametrize("nh,nkv,d,rotary,cache_dtype,offset,splits,window,cap", [
    (4, 2, 16, 16, torch.float16, False, 1, None, None),  # GQA 2, single pass
    (4, 2, 16, 16, torch.float16, False, 3, None, None),  # context slices and the merge
    (4, 2, 16, 16, torch.float16, False, -3, None, None),  # 3 slices merged by the last to finish
    (9, 3, 8, 8, torch.float32, True, 2, None, None),  # 9 over 3 heads, FP32 cache with a key offset
    (4, 1, 16, 8, FP8, True, 1, 5, None),  # FP8 codes, centred keys, partial rotary, a sliding window
    (4, 2, 16, 16, torch.int8, False, 2, None, 30.0),  # INT8 codes, soft-capped logits
])
def test_matches_the_two_kernels_and_torch(nh, nkv, d, rotary, cache_dtype, offset, splits, window, cap):
    merged, splits = splits < 0, abs(splits)
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
                           c["vs"], c["ko"], window, cap, num_splits=splits, merge_in_kernel=merged)
    # the two kernels it replaces
    two_qkv, two_k, two_v = c["qkv"].clone(), *caches()
    rope_and_cache(two_qkv, c["positions"], rope.cos, rope.sin, rotary, nh, nkv, d, two_k, two_v, c["slots"],
                   c["ks"], c["vs"], c["ko"])
    args = (c["qsl"], c["seq_lens"], c["tables"], 1, c["max_seq_len"], scale)
    two = pa.paged_attention(two_qkv[:, :nh * d].view(n, nh, d), two_k, two_v, *args, **kw, num_splits=splits)
    assert torch.equal(got_k.float(), two_k.float()) and torch.equal(got_v.float(), two_v.float())
    if merged:  # the merge's sums in the kernel's own layout: to FP16 rounding of the merge kernel's
        torch.testing.assert_close(got[:-1], two[:-1], atol=1e-3, rtol=1e-3)
        from kiln.kernels import decode_attention as da
        assert not da._counters(torch.device(DEV)).any()  # every counter reset for the next launch
    else:
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


# The compiler's view without a GPU: sm_90 code of the decode step's fused kernels from Triton's bundled ptxas, in a
# fresh process (kernels defined under TRITON_INTERPRET cannot be compiled)
_SM90_COMPILE = r"""
import inspect, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import argmax as am, decode_attention as da, l2_prefetch as lp, rope_cache as rc
from kiln.llm import fused_ops as fo

def source(kernel, types, cx):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in cx else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in cx and (n.endswith("_ptr") or n.startswith("stride") or n[0] == "s" and len(n) == 3)}
    return ASTSource(fn=kernel, signature=sig, constexprs=cx, attrs=attrs)

ROPE = dict(cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64", ks_ptr="*fp32", vs_ptr="*fp32",
            ko_ptr="*fp32")

def rope_cache(kv, quant, offset, rest=0):
    half = (128 - rest) // 2
    cx = dict(NQ=32, KVH=8, HEAD_DIM=128, HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
              REST_PAD=triton.next_power_of_2(max(rest, 1)), BLOCK_Q=32, BLOCK_H=8, BLOCK_D=128, BLOCK_SIZE=16,
              QUANT=quant, HAS_OFFSET=offset, PDL=True)
    return source(rc._rope_cache_kernel, dict(ROPE, qkv_ptr="*bf16", kc_ptr=kv, vc_ptr=kv), cx)

def decode(kv, quant, split, offset=False, window=False, cap=False, merge=False):
    types = dict(ROPE, qkv_ptr="*bf16", kc_ptr=kv, vc_ptr=kv, o_ptr="*bf16", seq_lens_ptr="*i32", bt_ptr="*i32",
                 po_ptr="*fp32", pml_ptr="*fp32", count_ptr="*i32", softmax_scale="fp32", soft_cap="fp32")
    cx = dict(NQ=32, KVH=8, HEAD_DIM=128, HALF=64, ROT=128, G=4, BLOCK_M=16, BLOCK_N=128, BLOCK_D=128,
              BLOCK_SIZE=16, QUANT=quant, HAS_OFFSET=offset, HAS_WINDOW=window, HAS_CAP=cap, SPLIT=split,
              CDT=tl.bfloat16 if quant == "" else tl.float16, CLAMP_Q=quant != "", PREC="tf32", MERGE=merge,
              S_PAD=4, PDL=True)
    return source(da._decode_attention_kernel, types, cx)

cases = [("rope+cache bf16", rope_cache("*bf16", "", False), 1),
         ("rope+cache fp8 centred", rope_cache("*fp8e4nv", "fp8", True), 1),
         ("rope+cache int8 partial rotary", rope_cache("*i8", "int8", False, 64), 1),
         ("act_and_mul", source(fo._act_and_mul_kernel, dict(x_ptr="*bf16", y_ptr="*bf16"),
                                dict(ACT="silu", BLOCK=1024, PDL=True)), 1),
         ("decode bf16", decode("*bf16", "", False), 3), ("decode fp8 split centred", decode("*fp8e4nv", "fp8", True, True), 3),
         ("decode int8 window cap", decode("*i8", "int8", False, False, True, True), 3),
         ("decode bf16 split merged in the kernel", decode("*bf16", "", True, merge=True), 3),
         ("l2 prefetch", source(lp._prefetch_kernel, dict(p_ptr="*bf16", nbytes="i64"),
                                dict(CHUNK=lp.CHUNK, THREADS=128, PDL=True)), 1),
         ("argmax", source(am._argmax_kernel, dict(x_ptr="*fp32", out_ptr="*i64", pv_ptr="*fp32", pi_ptr="*i32",
                                                    count_ptr="*i32"), dict(BLOCK=am.BLOCK, C_PAD=32, PDL=True)), 1)]
for name, src, stages in cases:
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=stages)).asm["ptx"]
    mma = len(re.findall(r"\bmma\.", ptx))
    cp = len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10", ptx))
    print(f"{name}: pdl {ptx.count('griddepcontrol')}, mma {mma}, 16-byte cp.async {cp}, "
          f"L2 prefetch {ptx.count('cp.async.bulk.prefetch.L2')}")
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the GPU runs compile the kernels")
def test_decode_kernels_compile_for_hopper():
    """What only the compiler refuses; the PDL wait and trigger in every kernel, the decode kernel's key loop
    on the tensor cores with its gathered K/V tiles loaded ahead through 16-byte cp.async, the L2 prefetch's bulk
    instruction."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert len(rows) == 10, run.stdout
    for name, info in rows.items():
        pdl, mma, cp, prefetch = (int(part.split()[-1]) for part in info.split(", "))
        assert prefetch == (name == "l2 prefetch"), run.stdout
        assert pdl == 2, run.stdout  # griddepcontrol.wait and .launch_dependents
        if name.startswith("decode"):
            assert mma > 0 and cp > 0, run.stdout


# On the GPU at Llama-3-8B's attention shape (32 query heads over 8 KV heads of 128, 16-token blocks)

def _gpu_case(cache_dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nh, nkv, d, bs = 32, 8, 128, 16
    seq_lens = [1000, 17, 257, 1, 4000]
    per = [-(-s // bs) for s in seq_lens]
    blocks = torch.randperm(sum(per) + 4, device="cuda", generator=g).int()
    tables = torch.zeros(len(seq_lens), max(per), dtype=torch.int32, device="cuda")
    start, slots = 0, []
    for i, s in enumerate(seq_lens):
        tables[i, :per[i]] = blocks[start:start + per[i]]
        start += per[i]
        slots.append(int(tables[i, (s - 1) // bs]) * bs + (s - 1) % bs)
    shape = (sum(per) + 4, bs, nkv, d)
    kc = (torch.randn(shape, device="cuda", generator=g) * (30 if cache_dtype == FP8 else 1)).to(cache_dtype)
    vc = (torch.randn(shape, device="cuda", generator=g) * (30 if cache_dtype == FP8 else 1)).to(cache_dtype)
    scales = {}
    if cache_dtype == FP8:
        scales = dict(ks=torch.full((nkv,), 0.03, device="cuda"), vs=torch.full((nkv,), 0.05, device="cuda"),
                      ko=torch.randn(nkv, d, device="cuda", generator=g) * 0.2)
    qkv = torch.randn(len(seq_lens), (nh + 2 * nkv) * d, device="cuda", generator=g).to(torch.bfloat16)
    return dict(qkv=qkv, kc=kc, vc=vc, slots=torch.tensor(slots, device="cuda"),
                pos=torch.tensor([s - 1 for s in seq_lens], device="cuda"),
                qsl=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda"),
                lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), tables=tables, **scales)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("splits", [None, 1, 4, -4])  # -4: 4 slices merged by the last to finish
def test_gpu_matches_the_two_kernels(cache_dtype, splits):
    c = _gpu_case(cache_dtype)
    nh, nkv, d = 32, 8, 128
    rope = Rope(d, 8192, 500000.0, None, "cuda")
    ks, vs, ko = c.get("ks"), c.get("vs"), c.get("ko")
    merged, n = splits is not None and splits < 0, None if splits is None else abs(splits)
    got_k, got_v = c["kc"].clone(), c["vc"].clone()
    got = decode_attention(c["qkv"].clone(), c["pos"], rope.cos, rope.sin, d, nh, nkv, d, got_k, got_v, c["slots"],
                           c["qsl"], c["lens"], c["tables"], 4096, 1 / math.sqrt(d), ks, vs, ko, num_splits=n,
                           merge_in_kernel=merged)
    two_qkv, two_k, two_v = c["qkv"].clone(), c["kc"].clone(), c["vc"].clone()
    rope_and_cache(two_qkv, c["pos"], rope.cos, rope.sin, d, nh, nkv, d, two_k, two_v, c["slots"], ks, vs, ko)
    two = pa.paged_attention(two_qkv[:, :nh * d].view(-1, nh, d), two_k, two_v, c["qsl"], c["lens"], c["tables"], 1,
                             4096, 1 / math.sqrt(d), k_scale=ks, v_scale=vs, num_splits=n)
    assert torch.equal(got_k.float(), two_k.float()) and torch.equal(got_v.float(), two_v.float())
    if merged:
        torch.testing.assert_close(got, two, atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(got, two)
