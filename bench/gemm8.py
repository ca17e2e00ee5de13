"""8-bit GEMM candidates on BERT-base's batch-32 shapes, timed two ways, against FP16 cuBLAS.

Each candidate is timed alone, outside the builder: (a) with Kiln's own timer
(kiln.tactics.timer.median_ms, CUDA-graph replays, as the selector does) and (b) as the GPU time of
its kernels per call from CUPTI (bench/run.py's kernel_profile), which involves no graph and no events.
If (a) and (b) disagree, the selector's timing is what to fix (on the H200 they agree within about
15%, (a) mostly the higher: it includes the gaps between calls, as an engine does).

The operands look like what a calibrated model feeds the kernels: INT8 weights per output channel and FP8
weights per tensor at the top of their range, activations spread over it ("realistic"). Tensor Core
power depends on how many bits toggle, so a sustained-load probe runs the FP16 GEMM and the best 8-bit
candidates for half a second each, on these and on narrow data (weights of a few int8 steps), and reads
the SM clock and board power (nvidia-smi) meanwhile: a power-bound GEMM shows a clock below the maximum.
(On the H200 these GEMMs were not power-bound: both kinds of data ran at the same speed.)

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
from kiln.kernels import cublaslt, gemm  # noqa: E402
from kiln.kernels.rescale import to_8bit  # noqa: E402
from kiln.tactics.library import fp8_scaled_mm, int8_int_mm  # noqa: E402
from kiln.tactics.timer import median_ms  # noqa: E402

# (name, M, K, N): BERT-base at batch 32 x seq 128
SHAPES = [("qkv", 4096, 768, 2304), ("attn_out", 4096, 768, 768), ("ffn1", 4096, 768, 3072),
          ("ffn2", 4096, 3072, 768)]


def kernel_ms(fn) -> float:
    """GPU time of fn's kernels per call (CUPTI), ms."""
    return sum(k["ms"] for k in kernel_profile(lambda _: fn(), None, runs=20))


def operands(M, K, N, dev="cuda"):
    """x16 [M, K] ~ N(0, 1), w16 [K, N] ~ N(0, 1/K), bias [N]."""
    g = torch.Generator(device=dev).manual_seed(0)
    x16 = torch.randn(M, K, device=dev, dtype=torch.float16, generator=g)
    w16 = torch.randn(K, N, device=dev, dtype=torch.float16, generator=g) / K ** 0.5
    return x16, w16, torch.randn(N, device=dev, dtype=torch.float16, generator=g)


def quantized(x16, w16, qtype: str, data: str):
    """(x8, sx, w8 K-major, sw) as a calibrated engine holds them ("realistic": x over +-4 sigma, INT8 weights
    per output channel and FP8 weights per tensor at the top of the range) or as the first run had them
    ("narrow": one weight scale of 1/64, so |w8| is mostly below 8)."""
    wdtype, qmax = (torch.int8, 127.0) if qtype == "int8" else (torch.float8_e4m3fn, 448.0)
    if data == "narrow":
        sw = torch.full((1,), 1 / 64, device=w16.device)
    else:
        sw = (w16.float().abs().amax(dim=0) if qtype == "int8" else w16.float().abs().amax().reshape(1)) / qmax
    sx = torch.tensor(4.0 / qmax if data == "realistic" else 0.05, device=x16.device)

    def q(t):
        t = t.clamp(-qmax, qmax)
        return (t.round() if qtype == "int8" else t).to(wdtype)

    return q(x16.float() / sx), sx, q(w16.float() / sw).t().contiguous().t(), sw


def candidates(M, K, N, data="realistic"):
    x16, w16, b = operands(M, K, N)
    out = {"fp16 cuBLAS (addmm)": lambda: torch.addmm(b, x16, w16)}
    for qtype in ("int8", "fp8"):
        x8, sx, w8, sw = quantized(x16, w16, qtype, data)
        node = Node("QGemm", [], [], {"qtype": qtype, "x_quantized": 1, "float_type": "float16"}, domain="kiln")
        for label, x in (("8-bit x", x8), ("fp16 x, quantized first", x16)):
            node_x = node if x is x8 else Node("QGemm", [], [], {"qtype": qtype}, domain="kiln")
            for cfg, level in gemm.QUANT_CONFIGS:
                if level <= 3:
                    out[f"{qtype} triton {cfg.name}, {label}"] = (
                        lambda x=x, w8=w8, sx=sx, sw=sw, cfg=cfg, qtype=qtype: gemm.gemm(
                            x, w8, b, config=cfg, qtype=qtype, x_scale=sx, w_scale=sw, out_dtype=torch.float16))
            if qtype == "int8" or sw.numel() == 1:  # cuBLASLt FP8 takes one weight scale
                lib = fp8_scaled_mm if qtype == "fp8" else int8_int_mm
                out[f"{qtype} cuBLASLt, {label}"] = (
                    lambda lib=lib, n=node_x, x=x, w8=w8, sx=sx, sw=sw: lib(n, x, w8, sx, sw, b))
            if qtype == "fp8" and sw.numel() == 1:  # the same GEMM called directly, bias in its epilogue
                out[f"fp8 cuBLASLt epilogue, {label}"] = (
                    lambda x=x, w8=w8, sx=sx, sw=sw: cublaslt.fp8_gemm(to_8bit(x, sx, "fp8"), w8, sx, sw, b))
    return out


def under_load(fn, seconds: float = 0.5) -> tuple[float, float]:
    """(median SM clock MHz, median board power W) while fn runs back to back for `seconds`."""
    import subprocess
    import threading
    import time

    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    samples, done = [], threading.Event()

    def poll():
        while not done.is_set():
            r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-i", str(torch.cuda.current_device())], capture_output=True, text=True)
            try:
                samples.append([float(v) for v in r.stdout.split(",")])
            except ValueError:
                pass

    t = threading.Thread(target=poll)
    end = time.perf_counter() + seconds
    t.start()
    while time.perf_counter() < end:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    done.set()
    t.join()
    if not samples:
        return float("nan"), float("nan")
    samples.sort()
    mhz = samples[len(samples) // 2][0]
    watts = sorted(s[1] for s in samples)[len(samples) // 2]
    return mhz, watts


# Run back to back under the probe, on both kinds of data
LOAD_PROBE = ("fp16 cuBLAS (addmm)", "int8 triton 128x128x64_w8_s3, 8-bit x", "fp8 triton 128x128x64_w8_s3, 8-bit x",
              "fp8 cuBLASLt, 8-bit x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    rows = [f"# 8-bit GEMMs on BERT-base batch-32 shapes ({torch.cuda.get_device_name()}, torch {torch.__version__})",
            "", "Realistic data (see the script's docstring). `kiln timer` is median_ms as the builder's selector",
            "calls it; `kernels` is CUPTI's GPU time per call, TFLOP/s from the latter.", "",
            "| shape | candidate | kiln timer us | kernels us | TFLOP/s |", "|---|---|---|---|---|"]
    load = ["", "## Under sustained load: SM clock and board power", "",
            "| shape | candidate | data | kernels us | SM MHz | W |", "|---|---|---|---|---|---|"]
    for name, M, K, N in SHAPES:
        for data in ("realistic", "narrow"):
            for label, fn in candidates(M, K, N, data).items():
                if data == "narrow" and label not in LOAD_PROBE:
                    continue
                try:
                    t_kernels = kernel_ms(fn) * 1e3
                    if data == "realistic":
                        rows.append(f"| {name} {M}x{K}x{N} | {label} | {median_ms(fn) * 1e3:.1f} | {t_kernels:.1f} | "
                                    f"{2 * M * K * N / t_kernels / 1e6:.0f} |")
                        print(rows[-1], flush=True)
                    if label in LOAD_PROBE:
                        mhz, watts = under_load(fn)
                        load.append(f"| {name} | {label} | {data} | {t_kernels:.1f} | {mhz:.0f} | {watts:.0f} |")
                        print(load[-1], flush=True)
                except Exception as e:  # a candidate that cannot run this shape: say so and go on
                    rows.append(f"| {name} {M}x{K}x{N} | {label} ({data}) | failed: {type(e).__name__} | | |")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gemm8.md").write_text("\n".join(rows + load) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
