"""BERT's FFN1 (x @ w1 + b, then GELU) on every kind of kernel Kiln has for it, at batch 32 (M = 4096) and 1.

Times are kiln.tactics.timer.median_ms (CUDA-graph replays), us: alone, and in a graph right after a
neighbouring GEMM (as in an engine), with the kernels CUPTI sees per call (cuBLASLt's epilogue kernels come
with a memset). Written to decide whether a Triton GEMM with the GELU in its epilogue could replace
cuBLASLt's GELU epilogue plus its memset (it could not: 53 us against 37).

    python bench/ffn1_gelu.py        (GPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench.run import kernel_profile  # noqa: E402
from kiln.kernels import gemm, layernorm  # noqa: E402
from kiln.kernels.gemm import TileConfig  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

CONFIGS = [TileConfig(128, 256, 64, 8, 3), TileConfig(128, 128, 64, 8, 4)]  # the 10:26 run swept ten


def main() -> int:
    for M in (4096, 128):
        h = torch.float16
        x = torch.randn(M, 768, device="cuda", dtype=h)
        w0, b0 = torch.randn(768, 768, device="cuda", dtype=h) / 28, torch.randn(768, device="cuda", dtype=h)
        w1, b1 = torch.randn(768, 3072, device="cuda", dtype=h) / 28, torch.randn(3072, device="cuda", dtype=h)
        neighbour = lambda: torch.addmm(b0, x, w0)  # noqa: E731
        g0 = torch.ones(768, device="cuda", dtype=h)
        after_ln = lambda fn: (layernorm.skip_layernorm(x, x, g0, b0, write_sum=False), fn())  # noqa: E731

        def halves(parts):  # the GEMM as `parts` row blocks: does cuBLASLt then pick a kernel without a memset?
            y = torch.empty(M, 3072, device="cuda", dtype=h)
            for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
                torch._addmm_activation(b1, xs, w1, use_gelu=True, out=ys)
            return y

        cands = {"cublaslt gelu epilogue": lambda: torch._addmm_activation(b1, x, w1, use_gelu=True),
                 "cublaslt gelu epilogue, M in 2 blocks": lambda: halves(2),
                 "cublaslt gelu epilogue, M in 4 blocks": lambda: halves(4),
                 "cublaslt bias only (no gelu)": lambda: torch.addmm(b1, x, w1),
                 "cublaslt bias then F.gelu": lambda: F.gelu(torch.addmm(b1, x, w1))}
        for c in CONFIGS:
            cands[f"triton {c.name} GeluErf"] = (
                lambda c=c: gemm.gemm(x, w1, b1, "GeluErf", config=c, precision="float16"))
        ref = F.gelu(x.float() @ w1.float() + b1.float())
        base = median_ms(neighbour, runs=20) * 1000
        print(f"\n## M={M}: neighbour addmm 768x768 alone {base:.1f} us")
        for name, fn in cands.items():
            err = (fn().float() - ref).abs().max().item()
            alone = median_ms(fn, runs=20) * 1000
            after = median_ms(lambda: (neighbour(), fn()), runs=20) * 1000 - base
            ln_base = median_ms(lambda: after_ln(lambda: None), runs=20) * 1000
            ln_after = median_ms(lambda: after_ln(fn), runs=20) * 1000 - ln_base
            kernels = "; ".join(f"{k['kernel'][:50]} x{k['calls']} {k['ms'] * 1000:.1f}us"
                                for k in kernel_profile(lambda _: fn(), None, runs=10))
            print(f"| {name} | alone {alone:.1f} | after neighbour {after:.1f} | after a Triton skip-LayerNorm "
                  f"{ln_after:.1f} | err {err:.2e} | {kernels}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
