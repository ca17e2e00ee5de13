"""BERT's residual add in the GEMM's epilogue (cuBLASLt's C, beta 1) instead of in the LayerNorm kernel.

A BERT block's attention-output and FFN2 GEMMs feed add + LayerNorm: the norm kernel reads the GEMM's output
and the residual, and writes the normalized rows (plus an 8-bit copy in FP8 engines). With the residual added
in the GEMM's epilogue the norm reads one tensor instead of two: 6.3 MB less at batch 32, the GEMM's epilogue
reading it instead. This times both at BERT-base batch 32 (FP16 and FP8 engines' forms), each pair in one
CUDA graph, taking the best of cuBLASLt's first four no-scratch choices and of every norm launch for each.

    python bench/residual_epilogue.py      (GPU)
"""

from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench.cublaslt_choices import FP8, FP16, operands  # noqa: E402
from kiln.kernels import cublaslt, layernorm  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

SHAPES = [("attn_out", 4096, 768, 768), ("ffn2", 4096, 3072, 768)]


def main() -> int:
    dev = torch.device("cuda")
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}: python bench/residual_epilogue.py")
    print("us per GEMM + norm pair (CUDA graph of 10 pairs); best of 4 cuBLASLt choices x every norm launch")
    for name, M, K, N in SHAPES:
        for inputs in (FP16, FP8):
            x, w, s, bias = operands(M, K, N, inputs)
            g = torch.Generator(device=dev).manual_seed(1)
            skip = torch.randn(M, N, device=dev, generator=g).half()
            gamma, beta = torch.rand(N, device=dev, generator=g).half() + 0.5, torch.randn(N, device=dev).half()
            q = torch.tensor(0.05, device=dev) if inputs == FP8 else None  # the FP8 engine's 8-bit copy
            qtype = "fp8" if inputs == FP8 else ""
            spec = cublaslt.spec_of(x, w, True, "", False, FP16)

            def gemm(plan, residual=None):
                if inputs == FP16:
                    return cublaslt.gemm(x, w, bias, plan=plan, residual=residual)
                return cublaslt.fp8_gemm(x, w, s, s, bias, plan=plan, residual=residual)

            def pair(plan, launch, fused):
                y = gemm(plan, skip if fused else None)
                return layernorm.skip_layernorm(y, None if fused else skip, gamma, beta, write_sum=False,
                                                q_scale=q, qtype=qtype, launch=launch)

            plans = cublaslt.choices(spec, dev, 4, 0)
            ref = pair(plans[0], layernorm.LAUNCHES[0], False)[0].float()
            out = pair(plans[0], layernorm.LAUNCHES[0], True)[0].float()
            diff = (out - ref).abs().max().item()
            best = {}
            for fused in (False, True):
                times = [(median_ms(lambda p=p, la=la: pair(p, la, fused)) * 1e3, i, la.name)
                         for i, p in enumerate(plans) for la in layernorm.LAUNCHES]
                gemm_only = min(median_ms(lambda p=p: gemm(p, skip if fused else None)) * 1e3 for p in plans)
                best[fused] = (min(times), gemm_only)
            (t0, i0, l0), g0 = best[False]
            (t1, i1, l1), g1 = best[True]
            print(f"{name} {str(inputs).split('.')[-1]}: norm adds the residual {t0:.1f} us (GEMM {g0:.1f}, choice "
                  f"{i0}, {l0}) | GEMM adds it {t1:.1f} us (GEMM {g1:.1f}, choice {i1}, {l1}) | "
                  f"{t1 - t0:+.1f} us; max diff {diff:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
