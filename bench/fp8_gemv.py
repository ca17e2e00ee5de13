"""The weight-only FP8 GEMV (kiln.kernels.fp8_gemv) against BF16 torch.matmul and FP8 torch._scaled_mm on
Llama-3-8B's decode shapes, M = 1, 4, 16, 64 rows, on the GPU.

Each figure is one call's GPU time inside a CUDA graph of calls that cycle through enough copies of the weight
(more than 2x L2 together) that every call reads its weight from HBM, as a decode step's layers do. GB/s counts
the bytes a call must move: weight + activations in + outputs. `+ quant` is _scaled_mm with the per-token FP8
quantization of the activations that kiln.llm.quantize runs before it (kiln.kernels.fp8_rows, one kernel). `fp16 x` is the
GEMV with FP16 activations (the FP8 codes then convert to FP16 alone, without the BF16 step); `int8 w` the same
GEMV over INT8 weight-only codes (kiln.llm.quantize's int8); `bf16 w gemv` the same kernel over the BF16 weights
(half the K tile), against cuBLAS's BF16 matmul in the first column; `int4 gemv` kiln.kernels.fp8_gemv.int4_gemv
over kiln.llm.quantize's INT4 layout (groups of 128) of the same weights.

    python bench/fp8_gemv.py [--shapes all|small] [--rows 1,4,16,64] [--sweep]     (GPU)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kiln.kernels import fp8_gemv as fg
from kiln.kernels import fp8_rows
from kiln.llm.quantize import dequantize_int4, quantize_int4

FP8 = torch.float8_e4m3fn
# (name, N out, K in) as F.linear holds them: Llama-3-8B's o, down, fused gate+up, fused qkv, the LM head and
# gate (unfused), in the order they are measured
SHAPES = [("o", 4096, 4096), ("down", 4096, 14336), ("gate_up", 28672, 4096), ("qkv", 6144, 4096),
          ("lm_head", 128256, 4096), ("gate", 14336, 4096)]
SWEPT = ("o", "down", "gate_up", "qkv")  # --sweep times every candidate tile of these at M = 1
ROWS = (1, 4, 16, 64)


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


def quant_rows(x):
    sx = (x.abs().amax(dim=-1, keepdim=True).float() / 448.0).clamp_min(1e-12)
    return (x.float() / sx).clamp(-448, 448).to(FP8), sx


def bench_shape(name: str, n: int, k: int, dev, l2: int, sms: int, sweep: bool, rows=ROWS) -> None:
    copies = max(2, -(-(2 * l2) // (n * k)))
    g = torch.Generator(device=dev).manual_seed(0)
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(copies)]
    scale = (w16[0].float().abs().amax(dim=1) / 448).clamp_min(1e-12)
    w8 = [(w.float() / scale[:, None]).clamp(-448, 448).to(FP8) for w in w16]
    w_int8 = [c.float().round().clamp(-127, 127).to(torch.int8) for c in w8]  # INT8 codes of the same size
    w_int4 = [quantize_int4(w) for w in w16]  # (packed, scale, zero), groups of 128
    cfg = fg.choose_config(n, k, torch.bfloat16, dev)
    cfg16 = fg.GemvConfig(cfg.block_n, cfg.block_k // 2, cfg.split_k, cfg.num_warps, cfg.num_stages)
    ones = torch.ones(n, device=dev)
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        xq, sx = quant_rows(x)
        bytes8 = n * k + 2 * m * k + 2 * m * n
        bytes16 = 2 * n * k + 2 * m * k + 2 * m * n
        bytes4 = n * k // 2 + 5 * n * (k // 128) + 2 * m * k + 2 * m * n  # codes, FP32 scales and 1-byte zeros
        t_bf16 = graph_us(lambda i, x=x: torch.matmul(x, w16[i].t()), copies)
        try:
            t_smm = graph_us(lambda i, xq=xq, sx=sx: torch._scaled_mm(
                xq, w8[i].t(), scale_a=sx, scale_b=scale[None, :], out_dtype=torch.bfloat16), copies)

            def smm_quant(i, x=x):
                q, s = fp8_rows.quantize_rows(x)
                return torch._scaled_mm(q, w8[i].t(), scale_a=s, scale_b=scale[None, :], out_dtype=torch.bfloat16)

            t_smmq = graph_us(smm_quant, copies)
        except Exception as e:  # noqa: BLE001
            print(f"  _scaled_mm failed: {type(e).__name__}: {e}")
            t_smm = t_smmq = float("nan")
        if m <= fg.MAX_M:
            t_gemv = graph_us(lambda i, x=x: fg.fp8_gemv(x, w8[i], scale, cfg), copies)
            xh = x.half()  # FP16 activations: the codes convert to FP16 alone (no BF16 step)
            t_half = graph_us(lambda i, xh=xh: fg.fp8_gemv(xh, w8[i], scale, cfg), copies)
            t_int8 = graph_us(lambda i, x=x: fg.fp8_gemv(x, w_int8[i], scale, cfg), copies)
            t_g16 = graph_us(lambda i, x=x: fg.fp8_gemv(x, w16[i], ones, cfg16), copies)
            t_int4 = graph_us(lambda i, x=x: fg.int4_gemv(x, *w_int4[i]), copies)
            w4 = dequantize_int4(*w_int4[0], k).to(torch.bfloat16)
            err4 = ((fg.int4_gemv(x, *w_int4[0]).float() - x.float() @ w4.float().t()).abs().max()
                    / (x.float() @ w4.float().t()).abs().max()).item()
            want = fg.reference(x, w8[0], scale).float()
            err = ((fg.fp8_gemv(x, w8[0], scale, cfg).float() - want).abs().max() / want.abs().max()).item()
        else:
            t_gemv = t_half = t_int8 = t_g16 = t_int4 = err = err4 = float("nan")
        print(f"{name:8s} {n:6d} {k:6d} {m:3d} | {t_bf16:6.1f}us {bytes16 / t_bf16 / 1e3:5.0f}GB/s | "
              f"{t_smm:6.1f}us {bytes8 / t_smm / 1e3:5.0f}GB/s | {t_smmq:7.1f}us | "
              f"{t_gemv:6.1f}us {bytes8 / t_gemv / 1e3:5.0f}GB/s | {t_bf16 / t_gemv:11.2f}x | {t_half:6.1f}us | {t_int8:6.1f}us | "
              f"{t_g16:6.1f}us {bytes16 / t_g16 / 1e3:5.0f}GB/s | "
              f"{t_int4:6.1f}us {bytes4 / t_int4 / 1e3:5.0f}GB/s | {cfg.name}, {err:.1e}, int4 {err4:.1e}", flush=True)
    if sweep:
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        row = []
        for c in fg.candidate_configs(n, k, sms):
            try:
                t = graph_us(lambda i, c=c: fg.fp8_gemv(x, w8[i], scale, c), copies)
                row.append(f"{c.name}={t:.1f}us/{(n * k) / t / 1e3:.0f}GB/s")
            except Exception as e:  # noqa: BLE001
                row.append(f"{c.name}=failed({type(e).__name__})")
        print(f"  sweep {name} M=1: " + "; ".join(row), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all", choices=["all", "small"])
    ap.add_argument("--sweep", action="store_true", help="also time every candidate tile at M = 1")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values (default 1,4,16,64)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    shapes = SHAPES if a.shapes == "all" else SHAPES[:2]
    print(f"{'shape':8s} {'N':>6s} {'K':>6s} {'M':>3s} | {'bf16 mm':>14s} | {'_scaled_mm':>14s} | "
          f"{'+ quant':>9s} | {'fp8_gemv':>14s} | {'gemv vs bf16':>12s} | {'fp16 x':>8s} | {'int8 w':>8s} | {'bf16 w gemv':>14s} | {'int4 gemv':>14s} | tile, max rel err")
    for name, n, k in shapes:
        bench_shape(name, n, k, dev, l2, props.multi_processor_count, a.sweep and name in SWEPT,
                    [int(m) for m in a.rows.split(",")])
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
