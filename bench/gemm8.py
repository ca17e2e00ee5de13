"""8-bit GEMM candidates on BERT-base's batch-32 shapes, timed two ways, against FP16 cuBLAS.

The builder's timings of the INT8/FP8 GEMM candidates summed to within 1% of each other over BERT's
72 GEMMs (bench/results/H200-quant-bert-cublaslt-fp8.json), although cuBLASLt's FP8 GEMM ran at
~1000 TFLOP/s where it was chosen. This script times each candidate alone, outside the builder:
(a) with Kiln's own timer (kiln.tactics.timer.median_ms, CUDA-graph replays, as the selector does) and
(b) as the GPU time of its kernels per call from CUPTI (bench/run.py's kernel_profile), which involves
no graph and no events. If (a) and (b) disagree, the selector's timing is what to fix.

    python bench/gemm8.py --out bench/results        (GPU; writes gemm8.md)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench.run import kernel_profile  # noqa: E402
from kiln.ir.graph import Node  # noqa: E402
from kiln.kernels import gemm  # noqa: E402
from kiln.tactics.library import fp8_scaled_mm, int8_int_mm  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

# (name, M, K, N): BERT-base at batch 32 x seq 128
SHAPES = [("qkv", 4096, 768, 2304), ("attn_out", 4096, 768, 768), ("ffn1", 4096, 768, 3072),
          ("ffn2", 4096, 3072, 768)]


def kernel_ms(fn) -> float:
    """GPU time of fn's kernels per call (CUPTI), ms."""
    return sum(k["ms"] for k in kernel_profile(lambda _: fn(), None, runs=20))


def candidates(M, K, N, dev="cuda"):
    x16 = torch.randn(M, K, device=dev, dtype=torch.float16)
    w16 = torch.randn(K, N, device=dev, dtype=torch.float16) / K ** 0.5
    b = torch.randn(N, device=dev, dtype=torch.float16)
    sx = torch.tensor(0.05, device=dev)
    out = {"fp16 cuBLAS (addmm)": lambda: torch.addmm(b, x16, w16)}
    for qtype, wdtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        w8 = (w16.float() * 64).clamp(-127, 127).to(wdtype).t().contiguous().t()  # K-major, as engines store it
        sw = torch.full((1,), 1 / 64, device=dev)
        x8 = (x16.float() / sx).clamp(-127, 127).round().to(wdtype)  # arrives quantized (8-bit hand-off)
        node = Node("QGemm", [], [], {"qtype": qtype, "x_quantized": 1, "float_type": "float16"}, domain="kiln")
        for label, x in (("8-bit x", x8), ("fp16 x, quantized first", x16)):
            node_x = node if x is x8 else Node("QGemm", [], [], {"qtype": qtype}, domain="kiln")
            for cfg, level in gemm.QUANT_CONFIGS:
                if level <= 3:
                    out[f"{qtype} triton {cfg.name}, {label}"] = (
                        lambda x=x, w8=w8, sw=sw, cfg=cfg, qtype=qtype: gemm.gemm(
                            x, w8, b, config=cfg, qtype=qtype, x_scale=sx, w_scale=sw, out_dtype=torch.float16))
            lib = fp8_scaled_mm if qtype == "fp8" else int8_int_mm
            out[f"{qtype} cuBLASLt, {label}"] = lambda lib=lib, n=node_x, x=x, w8=w8, sw=sw: lib(n, x, w8, sx, sw, b)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    rows = [f"# 8-bit GEMMs on BERT-base batch-32 shapes ({torch.cuda.get_device_name()}, torch {torch.__version__})",
            "", "`kiln timer` is median_ms as the builder's selector calls it; `kernels` is CUPTI's GPU time per call,",
            "TFLOP/s from the latter.", "",
            "| shape | candidate | kiln timer us | kernels us | TFLOP/s |", "|---|---|---|---|---|"]
    for name, M, K, N in SHAPES:
        for label, fn in candidates(M, K, N).items():
            try:
                t_sel, t_kernels = median_ms(fn) * 1e3, kernel_ms(fn) * 1e3
            except Exception as e:  # a candidate that cannot run this shape: say so and go on
                rows.append(f"| {name} {M}x{K}x{N} | {label} | failed: {type(e).__name__} | | |")
                continue
            rows.append(f"| {name} {M}x{K}x{N} | {label} | {t_sel:.1f} | {t_kernels:.1f} | "
                        f"{2 * M * K * N / t_kernels / 1e6:.0f} |")
            print(rows[-1], flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gemm8.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
