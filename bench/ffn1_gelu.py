"""BERT's FFN1 (x @ w1 + b, then GELU) on every kind of kernel Kiln has for it, at batch 32 (M = 4096) and 1.

Times are kiln.tactics.timer.median_ms (CUDA-graph replays), us: alone, and in a graph right after a
neighbouring GEMM (as in an engine), with the kernels CUPTI sees per call (cuBLASLt's epilogue kernels come
with a memset). Written to decide whether a Triton GEMM with the GELU in its epilogue could replace
cuBLASLt's GELU epilogue plus its memset (2026-11-30, H200: no, 53 us against 37).

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
from kiln.kernels import gemm  # noqa: E402
from kiln.kernels.gemm import TileConfig  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

CONFIGS = [TileConfig(128, 256, 64, 8, 3), TileConfig(128, 256, 64, 8, 4), TileConfig(128, 128, 64, 4, 3),
           TileConfig(128, 128, 64, 8, 4), TileConfig(256, 128, 64, 8, 3), TileConfig(128, 256, 32, 8, 4),
           TileConfig(64, 256, 64, 4, 4), TileConfig(128, 128, 128, 8, 3), TileConfig(64, 128, 64, 4, 4),
           TileConfig(128, 64, 64, 4, 4)]


def main() -> int:
    for M in (4096, 128):
        h = torch.float16
        x = torch.randn(M, 768, device="cuda", dtype=h)
        w0, b0 = torch.randn(768, 768, device="cuda", dtype=h) / 28, torch.randn(768, device="cuda", dtype=h)
        w1, b1 = torch.randn(768, 3072, device="cuda", dtype=h) / 28, torch.randn(3072, device="cuda", dtype=h)
        neighbour = lambda: torch.addmm(b0, x, w0)  # noqa: E731
        cands = {"cublaslt gelu epilogue": lambda: torch._addmm_activation(b1, x, w1, use_gelu=True),
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
            kernels = "; ".join(f"{k['kernel'][:50]} x{k['calls']} {k['ms'] * 1000:.1f}us"
                                for k in kernel_profile(lambda _: fn(), None, runs=10))
            print(f"| {name} | alone {alone:.1f} | after neighbour {after:.1f} | err {err:.2e} | {kernels}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
