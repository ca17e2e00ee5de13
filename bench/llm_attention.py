"""Kiln-LLM's paged attention (kiln/kernels/paged_attention.py) on the GPU: decode bandwidth and prefill
throughput, at Llama-3-8B's attention shape (32 query heads over 8 KV heads of dim 128, 16-token blocks).

Decode: batch 1..64 at context 1k..8k (BF16 cache; FP8 and INT8 at 8k), bytes the kernel must read (the K and
V of every context token, plus q and the output) over its time, against the device-to-device copy bandwidth
measured in the same run (bytes read + written by a 1 GiB copy over its time). A layer's cache was last read
one decode step earlier, with every other layer's in between, so it comes from HBM: each timed call reads
other blocks than the calls before it (enough block tables to cycle through four times L2's size). A tile and
split sweep at batch 64, 8k context follows. Prefill: packed prompts, FLOP/s of the causal attention, with
torch's SDPA on the same dense shapes as a yardstick.

Times are kiln.tactics.timer.median_ms (CUDA-graph replays, as an engine replays its steps).

`--quick`: only batch 64 at 8k context (BF16, FP8 and INT8 caches; issue 41's row: decode attention at 8k
context as a share of HBM bandwidth) and at 4k (BF16 and FP8), a short tile/split sweep of the 8-bit caches at
8k, no prefill.

    python bench/llm_attention.py --out DIR [--quick]     (writes DIR/llm-attention.md; GPU)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels import paged_attention as pa  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 4, 16, 64)
CONTEXTS = (1024, 2048, 4096, 8192)
LONG = (64, 8192)  # the batch and context of the 8-bit cases and the tile sweep
PREFILLS = ((1, 4096, 4096), (4, 2048, 2048), (8, 512, 4096))  # (sequences, query chunk, context)
CHECKED_PREFILL = (512, 4096)  # (query chunk, context) of the prefill tiles' error check
DEVICE = "cuda"
CACHE_DTYPES = {"bf16": DTYPE, "fp8": pa.FP8, "int8": torch.int8}
# (KV cache, block_n, warps, stages, splits or None for choose_num_splits) at batch 64, context 8192
SWEEP = [("bf16", 128, 4, 3, 1), ("bf16", 128, 4, 3, 4), ("bf16", 128, 4, 2, None), ("bf16", 128, 8, 3, None),
         ("bf16", 64, 4, 3, None), ("bf16", 64, 8, 4, None),
         ("fp8", 64, 4, 3, None), ("fp8", 128, 4, 4, None), ("fp8", 256, 4, 3, None), ("fp8", 256, 8, 2, None),
         ("int8", 64, 4, 3, None), ("int8", 256, 4, 3, None)]
# --quick: the 8-bit caches, where decode reads the fewest bytes per unit of work: more context slices and deeper
# pipelines against the default tile (128 keys, 4 warps, 3 stages)
QUICK_SWEEP = [("fp8", 128, 4, 4, None), ("fp8", 128, 4, 3, 4), ("fp8", 128, 4, 4, 8), ("fp8", 128, 8, 4, None),
               ("fp8", 64, 4, 4, 4), ("int8", 128, 4, 4, None), ("int8", 128, 4, 3, 4)]


def plan(quick: bool) -> tuple[list, list, tuple]:
    """(decode cases (batch, context, cache), tile sweep at LONG, prefill cases) of a run."""
    if quick:  # and BF16 against FP8 at 4k context, bench/llm.py's kvctx shape
        return [(*LONG, kv) for kv in CACHE_DTYPES] + [(64, 4096, "bf16"), (64, 4096, "fp8")], QUICK_SWEEP, ()
    cases = [(b, c, "bf16") for c in CONTEXTS for b in BATCHES] + [(*LONG, "fp8"), (*LONG, "int8")]
    return cases, SWEEP, PREFILLS


def copy_bandwidth() -> float:
    """Bytes per second a device-to-device copy moves (read + written)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=DEVICE).fill_(1)  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), runs=10)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def read_bandwidth() -> float:
    """Bytes per second torch's sum reads (2 GiB of FP32): a stream of reads, as decode attention is."""
    src = torch.ones(1 << 29, dtype=torch.float32, device=DEVICE)
    sink = torch.empty((), device=DEVICE)
    ms = median_ms(lambda: torch.sum(src, dim=0, out=sink), runs=10)
    return src.numel() * src.element_size() / (ms * 1e-3)


class Pool:
    """One cache of every block the largest case needs, filled with random values (8-bit codes through
    reshape_and_cache's quantization rules)."""

    def __init__(self, cache_dtype: torch.dtype, tokens: int):
        self.num_blocks = tokens // BLOCK + 1
        shape = (self.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.scales = {}
        if cache_dtype in pa.CACHE_8BIT:
            scale = torch.full((KV_HEADS,), 4.0 / (448.0 if cache_dtype == pa.FP8 else 127.0), device=DEVICE)
            self.scales = dict(k_scale=scale, v_scale=scale)
            self.k = pa.quantize_kv(torch.randn(shape, dtype=DTYPE, device=DEVICE), scale, cache_dtype)
            self.v = pa.quantize_kv(torch.randn(shape, dtype=DTYPE, device=DEVICE), scale, cache_dtype)
        else:
            self.k = torch.randn(shape, dtype=cache_dtype, device=DEVICE)
            self.v = torch.randn(shape, dtype=cache_dtype, device=DEVICE)

    def tables(self, batch: int, context: int, count: int) -> list[torch.Tensor]:
        """count block tables of batch sequences, over disjoint blocks where the pool holds them."""
        per_seq = -(-context // BLOCK)
        order = torch.randperm(self.num_blocks - 1, device=DEVICE) + 1
        out = []
        for i in range(count):
            start = (i * batch * per_seq) % max(1, self.num_blocks - 1 - batch * per_seq)
            out.append(order[start:start + batch * per_seq].view(batch, per_seq).to(torch.int32))
        return out


def time_decode(pool: Pool, batch: int, context: int, l2_bytes: int, **kw) -> tuple[float, float]:
    """(us per call, bytes a call must read and write)."""
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * pool.k.element_size()
    io_bytes = 2 * batch * HEADS * HEAD_DIM * 2
    count = max(1, min(64, -(-4 * l2_bytes // kv_bytes)))
    tables = pool.tables(batch, context, count)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    out = torch.empty_like(q)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(HEAD_DIM)

    def calls():
        for t in tables:
            pa.paged_attention(q, pool.k, pool.v, qsl, lens, t, 1, context, scale, **pool.scales, out=out, **kw)

    calls()
    torch.cuda.synchronize()
    return median_ms(calls, runs=10) * 1e3 / count, kv_bytes + io_bytes


def decode_error(pool: Pool, context: int, **kw) -> float:
    """Largest difference from paged_attention_reference over 4 sequences of this context (the tile checked)."""
    batch = 4
    table = pool.tables(batch, context, 1)[0]
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([context - context * i // 8 for i in range(batch)], dtype=torch.int32, device=DEVICE)
    args = (q, pool.k, pool.v, qsl, lens, table, 1, context, 1 / math.sqrt(HEAD_DIM))
    got = pa.paged_attention(*args, **pool.scales, **kw)
    return (got.float() - pa.paged_attention_reference(*args, **pool.scales).float()).abs().max().item()


def prefill_error(pool: Pool, **kw) -> float:
    """Largest difference from paged_attention_reference: one CHECKED_PREFILL chunk."""
    qlen, context = CHECKED_PREFILL
    table = pool.tables(1, context, 1)[0]
    q = torch.randn(qlen, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    qsl = torch.tensor([0, qlen], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    args = (q, pool.k, pool.v, qsl, lens, table, qlen, context, 1 / math.sqrt(HEAD_DIM))
    got = pa.paged_attention(*args, **kw)
    return (got.float() - pa.paged_attention_reference(*args).float()).abs().max().item()


def time_prefill(pool: Pool, seqs: int, qlen: int, context: int, **kw) -> tuple[float, float]:
    """(ms per call, FLOPs of the causal attention) for seqs chunks of qlen queries ending at context."""
    tables = pool.tables(seqs, context, 1)[0]
    q = torch.randn(seqs * qlen, HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    qsl = torch.arange(0, seqs * qlen + 1, qlen, dtype=torch.int32, device=DEVICE)
    lens = torch.full((seqs,), context, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(HEAD_DIM)
    ms = median_ms(lambda: pa.paged_attention(q, pool.k, pool.v, qsl, lens, tables, qlen, context, scale, out=out,
                                              **kw), runs=5)
    keys = sum(context - qlen + j + 1 for j in range(qlen))  # keys each query head attends, summed over queries
    return ms, 4.0 * seqs * HEADS * HEAD_DIM * keys


def time_sdpa(seqs: int, length: int) -> float:
    q = torch.randn(seqs, HEADS, length, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k = torch.randn(seqs, KV_HEADS, length, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), runs=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for llm-attention.md")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds after which no new case starts")
    ap.add_argument("--quick", action="store_true", help="batch 64 at 8k context only (see the docstring)")
    args = ap.parse_args()
    cases, sweep, prefills = plan(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    lines = [f"# Paged attention on {props.name}", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
             f"{props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB. Shape: {HEADS} query heads over "
             f"{KV_HEADS} KV heads, head dim {HEAD_DIM}, block size {BLOCK}, BF16 queries. "
             f"Command: `python bench/llm_attention.py --out DIR{' --quick' if args.quick else ''}`.", ""]

    def write():
        (args.out / "llm-attention.md").write_text("\n".join(lines) + "\n")

    def over() -> bool:
        return time.time() - t0 > args.budget

    bw, rbw = copy_bandwidth(), read_bandwidth()
    lines += [f"Device-to-device copy (1 GiB, read + written): {bw / 1e9:.0f} GB/s; read (torch.sum of 2 GiB): "
              f"{rbw / 1e9:.0f} GB/s.", ""]
    l2 = props.L2_cache_size
    pools = {name: Pool(CACHE_DTYPES[name], max(b * c for b, c, _ in cases))
             for name in dict.fromkeys([kv for *_, kv in cases] + [kv for kv, *_ in sweep])}
    print(f"setup {time.time() - t0:.1f}s, copy {bw / 1e9:.0f} GB/s, read {rbw / 1e9:.0f} GB/s", flush=True)

    lines += ["## Decode (one query per sequence, splits chosen by choose_num_splits)", "",
              "| batch | context | KV cache | splits | us | MB read | GB/s | of read BW | of copy BW |",
              "|---|---|---|---|---|---|---|---|---|"]
    for b, c, kv in cases:
        if over():
            lines.append(f"| {b} | {c} | {kv} | | skipped (time budget) | | | | |")
            continue
        splits = pa.choose_num_splits(b, KV_HEADS, 1, c, torch.device(DEVICE))
        try:
            us, nbytes = time_decode(pools[kv], b, c, l2)
            gbs = nbytes / (us * 1e-6) / 1e9
            lines.append(f"| {b} | {c} | {kv} | {splits} | {us:.1f} | {nbytes / 1e6:.1f} | {gbs:.0f} | "
                         f"{gbs * 1e9 / rbw:.0%} | {gbs * 1e9 / bw:.0%} |")
        except Exception as e:  # noqa: BLE001  (a failing case is reported, the others still run)
            lines.append(f"| {b} | {c} | {kv} | {splits} | fail {type(e).__name__}: {str(e)[:100]} | | | | |")
        print(lines[-1], flush=True)
        write()

    lines += ["", f"## Decode at batch {LONG[0]}, context {LONG[1]}: tiles and splits", "",
              "| KV cache | block_n | warps | stages | splits | us | GB/s | of read BW | max error vs reference |",
              "|---|---|---|---|---|---|---|---|---|"]
    for kv, bn, w, st, splits in sweep:
        if over():
            lines.append(f"| {kv} | {bn} | {w} | {st} | {splits or 'auto'} | skipped (time budget) | | | |")
            continue
        try:
            cfg = pa.PagedConfig(16, bn, w, st)
            us, nbytes = time_decode(pools[kv], *LONG, l2, config=cfg, num_splits=splits)
            gbs = nbytes / (us * 1e-6) / 1e9
            err = decode_error(pools[kv], LONG[1], config=cfg, num_splits=splits)
            lines.append(f"| {kv} | {bn} | {w} | {st} | {splits or 'auto'} | {us:.1f} | {gbs:.0f} | "
                         f"{gbs * 1e9 / rbw:.0%} | {err:.2g} |")
        except Exception as e:  # noqa: BLE001
            lines.append(f"| {kv} | {bn} | {w} | {st} | {splits or 'auto'} | fail {type(e).__name__}: "
                         f"{str(e)[:100]} | | | |")
        print(lines[-1], flush=True)
        write()

    if not prefills:
        lines += ["", f"Total {time.time() - t0:.0f} s."]
        write()
        return
    lines += ["", "## Prefill (BF16 cache; chunks of qlen queries ending at the context's end)", "",
              "| seqs | qlen | context | ms | TFLOP/s | tokens/s | torch SDPA (dense, same causal shape) TFLOP/s |",
              "|---|---|---|---|---|---|---|"]
    for seqs, qlen, ctx in prefills:
        if over():
            lines.append(f"| {seqs} | {qlen} | {ctx} | skipped (time budget) | | | |")
            continue
        try:
            ms, flops = time_prefill(pools["bf16"], seqs, qlen, ctx)
            sdpa = f"{flops / (time_sdpa(seqs, qlen) * 1e-3) / 1e12:.0f}" if qlen == ctx else "-"
            lines.append(f"| {seqs} | {qlen} | {ctx} | {ms:.3f} | {flops / (ms * 1e-3) / 1e12:.0f} | "
                         f"{seqs * qlen / (ms * 1e-3):.3g} | {sdpa} |")
        except Exception as e:  # noqa: BLE001
            lines.append(f"| {seqs} | {qlen} | {ctx} | fail {type(e).__name__}: {str(e)[:100]} | | | |")
        print(lines[-1], flush=True)
        write()
    seqs, qlen, ctx = PREFILLS[0]
    lines += ["", f"## Prefill tiles ({seqs} x {qlen} queries, context {ctx})", "",
              "| block_m | block_n | warps | stages | ms | TFLOP/s | max error vs reference |",
              "|---|---|---|---|---|---|---|"]
    for bm, bn, w, st in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                          (128, 32, 8, 3)]:
        if over():
            lines.append(f"| {bm} | {bn} | {w} | {st} | skipped (time budget) | | |")
            continue
        try:
            cfg = pa.PagedConfig(bm, bn, w, st)
            ms, flops = time_prefill(pools["bf16"], seqs, qlen, ctx, config=cfg)
            err = prefill_error(pools["bf16"], config=cfg)
            lines.append(f"| {bm} | {bn} | {w} | {st} | {ms:.3f} | {flops / (ms * 1e-3) / 1e12:.0f} | {err:.2g} |")
        except Exception as e:  # noqa: BLE001
            lines.append(f"| {bm} | {bn} | {w} | {st} | fail {type(e).__name__}: {str(e)[:100]} | | |")
        print(lines[-1], flush=True)
        write()
    lines += ["", f"Total {time.time() - t0:.0f} s."]
    write()


if __name__ == "__main__":
    main()
