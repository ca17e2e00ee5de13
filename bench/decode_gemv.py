"""Decode-step GEMVs on Llama-3-8B's projections against cuBLAS (torch.matmul in BF16), on the GPU.

Kernels: Kiln's BF16 GEMV (kiln.kernels.bf16_gemv), the FP8 weight-only GEMV with BF16 activations
(kiln.kernels.fp8_gemv; E4M3 codes and activations go to an FP16 dot), the same launched without programmatic
dependent launch ("no pdl"), and the INT4 GEMV (kiln.llm.quantize's layout, groups of 128), each with the tile
that choose_config times on the device, at M = 1, 4, 8 rows. First every kernel's output against a torch
reference on the same operands (max error over the largest output, relative to its largest value); then times.

Each time is one call's GPU time inside a CUDA graph of calls that cycle through enough copies of the weight
(more than 2x L2 together) that every call reads its weight from HBM, as a decode step's layers do. GB/s counts
the weight's bytes alone (codes, plus INT4's scales and zero points): what a decode step is bound by.
`--sweep` also prints every candidate tile's time at M = 1 (what choose_config measured to pick from).

`--layer` times one decoder layer's four products one after another (what 32 layers of a step run).
`--precompile N` (default 12) first compiles every candidate tile in N processes into Triton's on-disk cache.

    python bench/decode_gemv.py [--rows 1,4,8] [--shapes qkv,o,gate_up,down,lm_head] [--sweep] [--layer]
                                [--budget-s S]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels import bf16_gemv as bg
from kiln.kernels import fp8_gemv as fg
from kiln.llm.quantize import dequantize_int4, quantize_int4

FP8 = fg.FP8
# (name, N out, K in) as F.linear holds them: Llama-3-8B's fused q/k/v, o, fused gate/up, down and the LM head
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
TOL = 2e-2  # max error relative to the output's largest value (BF16 outputs round at 2^-9 of each value)


def graph_us(fn_of, copies: int, calls: int = 3) -> float:
    """GPU microseconds per call of fn_of(i) (i = which weight copy), replayed in a CUDA graph."""
    for i in range(copies):
        fn_of(i)  # compile and pick tiles outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            for i in range(copies):
                fn_of(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * calls * copies)


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


KINDS = ("cublas", "bf16", "fp8", "int4")


def bench_shape(name: str, n: int, k: int, dev, l2: int, rows: list[int], sweep: bool, kinds=KINDS) -> None:
    copies = max(2, -(-(2 * l2) // (n * k)))  # FP8 copies over 2x L2 (BF16 ones twice that)
    g = torch.Generator(device=dev).manual_seed(0)
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
    scale = (w16[0].float().abs().amax(dim=1) / 448).clamp_min(1e-12)
    w8 = [(w.float() / scale[:, None]).clamp(-448, 448).to(FP8) for w in w16] if "fp8" in kinds else []
    w4 = [quantize_int4(w) for w in w16] if "int4" in kinds else []  # (packed, scale, zero), groups of 128
    if "bf16" not in kinds and "cublas" not in kinds:
        w16 = w16[:1]
    bytes16, bytes8 = 2 * n * k, n * k
    bytes4 = n * k // 2 + 5 * n * (-(-k // 128))
    t0 = time.perf_counter()
    tiles = []
    if "bf16" in kinds:
        c16 = {one: fg.choose_config(n, k, torch.bfloat16, dev, torch.bfloat16, w16[0], one) for one in (True, False)}
        rule = bg.gemv_rows(n, k, torch.bfloat16, dev, w16[0])
        tiles.append(f"bf16 {c16[True].name} / {c16[False].name} (GEMV rule: up to {rule} rows)")
    if "fp8" in kinds:
        c8 = {one: fg.choose_config(n, k, torch.bfloat16, dev, FP8, w8[0], one) for one in (True, False)}
        tiles.append(f"fp8 {c8[True].name} / {c8[False].name}")
    if "int4" in kinds:
        c4 = fg.choose_int4_config(n, k, 128, torch.bfloat16, dev, full=sweep)
        tiles.append(f"int4 {c4.name}")
    print(f"{name} [{n} x {k}]: tiles (M=1 / M>1) {', '.join(tiles)} ({time.perf_counter() - t0:.1f} s to choose)",
          flush=True)
    x = torch.randn(max(rows), k, device=dev, dtype=torch.bfloat16, generator=g)
    x1 = x[:1].contiguous()
    errs, verdict = {}, True
    if "bf16" in kinds:
        errs["bf16 gemv"] = max_rel(bg.bf16_gemv(x, w16[0]), bg.reference(x, w16[0]))
        errs["bf16 gemv M=1"] = max_rel(bg.bf16_gemv(x1, w16[0]), bg.reference(x1, w16[0]))
    if "fp8" in kinds:
        errs["fp8 gemv"] = max_rel(fg.fp8_gemv(x, w8[0], scale), fg.reference(x, w8[0], scale))
        errs["fp8 gemv M=1"] = max_rel(fg.fp8_gemv(x1, w8[0], scale), fg.reference(x1, w8[0], scale))
    extra = ""
    if "int4" in kinds:
        want4 = x.float() @ dequantize_int4(*w4[0], k).t()
        errs["int4 gemv"] = max_rel(fg.int4_gemv(x, *w4[0], None, 128, c4), want4)
        errs["int4 gemv M=1"] = max_rel(fg.int4_gemv(x1, *w4[0], None, 128, c4), want4[:1])
        # INT4's nibble unpacking in inline PTX must give the elementwise form's floats: the same output bit for bit
        plain = fg.int4_gemv(x, *w4[0], None, 128, fg.GemvConfig(64, 128, 1, 4, 4))
        prmt_same = all(torch.equal(fg.int4_gemv(x, *w4[0], None, 128, fg.GemvConfig(64, 128, 1, 4, 4, prmt=v)), plain)
                        for v in (1, 2))
        verdict = prmt_same
        extra = f"; int4 PTX unpacking equal to elementwise: {prmt_same}"
    cublas_err = max_rel(torch.matmul(x, w16[0].t()), bg.reference(x, w16[0]))
    verdict = "ok" if all(v < TOL for v in errs.values()) and verdict else "MISMATCH"
    print(f"  vs torch reference (max rel err, M={max(rows)}): " + ", ".join(f"{key} {v:.1e}" for key, v in errs.items())
          + f" (cuBLAS bf16 itself {cublas_err:.1e}){extra}: {verdict}", flush=True)
    for m in rows:
        xm = x[:m].contiguous()
        fns = {"cublas": lambda i, xm=xm: torch.matmul(xm, w16[i].t()),
               "bf16": lambda i, xm=xm: bg.bf16_gemv(xm, w16[i]),
               "fp8": lambda i, xm=xm: fg.fp8_gemv(xm, w8[i], scale),
               "fp8 no pdl": lambda i, xm=xm: fg.fp8_gemv(xm, w8[i], scale, pdl=False),
               "int4": lambda i, xm=xm: fg.int4_gemv(xm, *w4[i], None, 128, c4)}
        t = {key: graph_us(fn, copies) for key, fn in fns.items() if key.split()[0] in kinds}
        nbytes = {"cublas": bytes16, "bf16": bytes16, "fp8": bytes8, "fp8 no pdl": bytes8, "int4": bytes4}
        cells = " | ".join(f"{key} {t[key]:7.1f} us {nbytes[key] / t[key] / 1e3:5.0f} GB/s" for key in t)
        ratios = ", ".join(f"{key} {t['cublas'] / t[key]:.2f}x" for key in ("bf16", "fp8", "int4") if key in t)
        print(f"  {name:8s} M={m} | {cells}" + (f" | vs cuBLAS: {ratios}" if "cublas" in t else ""), flush=True)
        if name == "down":  # the MLP's activation inside the GEMV's input load (x = [gate | up], twice as wide)
            gu = torch.randn(m, 2 * k, device=dev, dtype=torch.bfloat16, generator=g)
            act = {"bf16": lambda i: fg.fp8_gemv(gu, w16[i], None, act="silu"),
                   "fp8": lambda i: fg.fp8_gemv(gu, w8[i], scale, act="silu"),
                   "int4": lambda i: fg.int4_gemv(gu, *w4[i], None, 128, c4, act="silu")}
            ta = {key: graph_us(fn, copies) for key, fn in act.items() if key in kinds}
            print(f"  {name:8s} M={m} with SiLU(gate) * up in the input load: "
                  + ", ".join(f"{key} {us:.1f} us (+{us - t[key]:.1f})" for key, us in ta.items()), flush=True)
    if sweep:  # what choose_config timed (M = 1, CUDA graphs over the same weight copies' size)
        for label, codes, nb in (("fp8", FP8, bytes8), ("bf16", torch.bfloat16, bytes16), ("int4", "int4", bytes4)):
            if label not in kinds:
                continue
            timed = sorted((us, c.name) for c, us in fg.tile_timings(n, k, torch.bfloat16, dev, codes).items())
            print(f"  sweep {label} {name} M=1: " + "; ".join(
                f"{nm} {us:.1f}us/{nb / us / 1e3:.0f}GB/s" for us, nm in timed), flush=True)


def bench_layer(dev, rows: list[int], kinds=KINDS, full: bool = False) -> None:
    """One decoder layer's four products (qkv, o, gate_up, down: 436 MB of BF16, more than L2) one after another
    in a CUDA graph, each kernel kind against cuBLAS's BF16 chain: 32 of these plus the LM head is the weight
    part of a decode step."""
    g = torch.Generator(device=dev).manual_seed(1)
    names = ("qkv", "o", "gate_up", "down")
    w16 = {nm: torch.randn(*SHAPES[nm], device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for nm in names}
    sc = {nm: (w.float().abs().amax(dim=1) / 448).clamp_min(1e-12) for nm, w in w16.items()}
    w8 = {nm: (w.float() / sc[nm][:, None]).clamp(-448, 448).to(FP8) for nm, w in w16.items()}
    w4 = {nm: quantize_int4(w) for nm, w in w16.items()}
    # INT4's tiles picked here from the list the shapes' sweep prints (full), not the short one
    c4 = {nm: fg.choose_int4_config(*SHAPES[nm], 128, torch.bfloat16, dev, full=full) for nm in names} \
        if "int4" in kinds else {}
    total16 = sum(2 * w.numel() for w in w16.values())
    for m in rows:
        xs = {nm: torch.randn(m, SHAPES[nm][1], device=dev, dtype=torch.bfloat16, generator=g) for nm in names}
        chains = {"cublas": lambda i, xs=xs: [torch.matmul(xs[nm], w16[nm].t()) for nm in names],
                  "bf16": lambda i, xs=xs: [bg.bf16_gemv(xs[nm], w16[nm]) for nm in names],
                  "fp8": lambda i, xs=xs: [fg.fp8_gemv(xs[nm], w8[nm], sc[nm]) for nm in names],
                  "int4": lambda i, xs=xs: [fg.int4_gemv(xs[nm], *w4[nm], None, 128, c4[nm]) for nm in names]}
        t = {key: graph_us(fn, 1, calls=4) for key, fn in chains.items() if key in kinds}  # microseconds a layer
        print(f"  layer chain M={m}: " + ", ".join(f"{key} {us:.1f} us" for key, us in t.items()) + "; x32 layers: "
              + ", ".join(f"{key} {32 * us / 1e3:.2f} ms" + (f" ({total16 / us / 1e3:.0f} GB/s)" if key in ("cublas", "bf16")
                                                           else "") for key, us in t.items()), flush=True)


def _warm(job) -> str:
    """In a worker process: launch one candidate tile once with one split and with two on a 4096 x 4096 weight,
    which compiles the kernels every projection's launch of that tile uses (Triton specializes on divisibility
    and on a split count of 1, not on sizes) into Triton's on-disk cache."""
    import dataclasses

    kind, cfg = job
    dev = torch.device("cuda")
    x = torch.zeros((1, 4096), dtype=torch.bfloat16, device=dev)
    try:
        for split in (1, 2):
            c = dataclasses.replace(cfg, split_k=split)
            if kind == "int4":
                packed = torch.zeros((4096, 2048), dtype=torch.uint8, device=dev)
                s = torch.ones((4096, 32), device=dev)
                fg.int4_gemv(x, packed, s, torch.zeros((4096, 32), dtype=torch.uint8, device=dev), None, 128, c)
            else:
                w = torch.zeros((4096, 4096), dtype=FP8 if kind == "fp8" else torch.bfloat16, device=dev)
                fg.fp8_gemv(x, w, torch.ones(4096, device=dev) if kind == "fp8" else None, c)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001 - the timing meets it again and records the tile as failed
        return f"{kind} {cfg.name}: {type(e).__name__}"


def precompile(workers: int, kinds=KINDS, full: bool = False) -> None:
    """Every candidate tile of `kinds` compiled in `workers` processes side by side before anything is timed
    (full: INT4's longer list, which --sweep times)."""
    import multiprocessing as mp

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = []
    for kind, codes in (("fp8", FP8), ("bf16", torch.bfloat16)):
        if kind not in kinds:
            continue
        for c in fg.candidate_configs(4096, 4096, sms, codes) + fg.row_candidate_configs(4096, 4096, sms, codes):
            jobs.append((kind, c))
    if "int4" in kinds:
        jobs += [("int4", c) for c in fg.int4_candidate_configs(4096, 4096, sms, full)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        failed = [r for r in pool.map(_warm, jobs, chunksize=1) if r]
    print(f"precompiled {len(jobs)} candidate tiles in {workers} processes in {time.perf_counter() - t0:.1f} s"
          + (f"; failed: {failed}" if failed else ""), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--rows", default="1,4,8", help="comma-separated M values (default 1,4,8)")
    ap.add_argument("--sweep", action="store_true", help="also print every candidate tile's time at M = 1")
    ap.add_argument("--layer", action="store_true", help="also time one decoder layer's four products in a row")
    ap.add_argument("--precompile", type=int, default=12, help="processes compiling the candidates first (0: none)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the shapes left past this time")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    print("kernels: cublas = torch.matmul in BF16, bf16 = Kiln's BF16 GEMV, fp8 (and without PDL), int4; GB/s of "
          "weight bytes", flush=True)
    if a.precompile:
        try:
            precompile(a.precompile, tuple(a.kinds.split(",")), a.sweep)
        except Exception as e:  # noqa: BLE001 - the timings then compile as they go
            print(f"precompile failed ({type(e).__name__}: {e}); compiling as the timings go", flush=True)
    if a.layer:  # first: it also picks every projection's tiles, which the shapes below then reuse
        bench_layer(dev, [int(m) for m in a.rows.split(",")], tuple(a.kinds.split(",")), a.sweep)
        torch.cuda.empty_cache()
    for name in a.shapes.split(","):
        if time.perf_counter() - t0 > a.budget_s:
            print(f"{name}: skipped (budget)")
            continue
        bench_shape(name, *SHAPES[name], dev, l2, [int(m) for m in a.rows.split(",")], a.sweep,
                    tuple(a.kinds.split(",")))
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
