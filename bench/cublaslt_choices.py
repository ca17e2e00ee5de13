"""cuBLASLt's heuristic choices on BERT-base's batch-32 GEMMs, each as Kiln's engine would run it.

For every GEMM and epilogue the FP8 engine asks cuBLASLt for (QKV, attention output, FFN1 with GELU and an
FP8 output, FFN2), and the FP16 engine's same four (beside torch's addmm, which FP16 engines also time),
up to eight of the heuristic's choices, with a 32 MiB workspace and with none: the
kernels each choice launches per call (a `Memset` among them is a cudaMemsetAsync cuBLASLt issues itself;
in a CUDA graph it delays the kernel after it: docs/design/cublaslt.md), the time per call in a
CUDA-graph replay (Kiln's timer, as the builder's selector times tactics) and the same after an L2 reset
(weights from memory, as in an engine).

    python bench/cublaslt_choices.py --out bench/results     (GPU; writes cublaslt-choices.md)
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench.run import kernel_events  # noqa: E402
from kiln.kernels import cublaslt  # noqa: E402
from kiln.tactics.timer import L2Reset, median_ms  # noqa: E402

FP8, FP16 = torch.float8_e4m3fn, torch.float16
# (name, M, K, N, activation, output type, inputs type): BERT-base at batch 32 x seq 128
GEMMS = [("qkv", 4096, 768, 2304, "", FP16, FP8), ("qkv, fp8 out", 4096, 768, 2304, "", FP8, FP8),
         ("attn_out", 4096, 768, 768, "", FP16, FP8), ("ffn1", 4096, 768, 3072, "GeluTanh", FP8, FP8),
         ("ffn1, fp16 out", 4096, 768, 3072, "GeluTanh", FP16, FP8), ("ffn1, no gelu", 4096, 768, 3072, "", FP8, FP8),
         ("ffn2", 4096, 3072, 768, "", FP16, FP8),
         ("fp16 qkv", 4096, 768, 2304, "", FP16, FP16), ("fp16 attn_out", 4096, 768, 768, "", FP16, FP16),
         ("fp16 ffn1", 4096, 768, 3072, "GeluTanh", FP16, FP16), ("fp16 ffn2", 4096, 3072, 768, "", FP16, FP16)]


def operands(M, K, N, inputs, dev="cuda"):
    """x, w, a scale and a bias; FP8 weights K-major, FP16 ones row-major (each engine's layout)."""
    g = torch.Generator(device=dev).manual_seed(0)
    bias = torch.randn(N, device=dev, dtype=FP16, generator=g)
    if inputs == FP16:
        x = torch.randn(M, K, device=dev, generator=g).half()
        return x, (torch.randn(K, N, device=dev, generator=g) / K ** 0.5).half(), None, bias
    x8 = (torch.randn(M, K, device=dev, generator=g) * 100).clamp(-448, 448).to(FP8)
    w8 = (torch.randn(N, K, device=dev, generator=g) * 100).clamp(-448, 448).to(FP8).t()  # K-major
    return x8, w8, torch.tensor(1e-2, device=dev), bias


def timed_row(name, cap, choice, workspace, fn, keep, reset):
    """One table row: the kernels `fn` launches per call, its graph-replay time, and the same after an L2 reset."""
    try:
        events = kernel_events(lambda _: fn(), None, runs=3)
        names: dict[str, int] = {}
        for e in events:
            names[e.name[:60]] = names.get(e.name[:60], 0) + 1
        kernels = ", ".join(f"`{k}` x{v // 3}" for k, v in names.items())
        graph = median_ms(fn) * 1e3
        cold = median_ms(fn, before=reset.keeping(keep)) * 1e3
        return f"| {name} | {cap} | {choice} | {workspace} | {kernels} | {graph:.1f} | {cold:.1f} |"
    except Exception as e:  # a choice that fails to run: say so and go on
        return f"| {name} | {cap} | {choice} | {workspace} | failed: {type(e).__name__}: {e} | | |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--choices", type=int, default=8)
    ap.add_argument("--gemms", default="", help="comma-separated GEMM names to run (default: all)")
    a = ap.parse_args()
    wanted = set(a.gemms.split(",")) if a.gemms else None
    dev = torch.device("cuda")
    reset = L2Reset(dev)
    rows = [f"# cuBLASLt choices on BERT-base batch-32 GEMMs ({torch.cuda.get_device_name()}, "
            f"torch {torch.__version__})", "",
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"`python bench/cublaslt_choices.py {' '.join(sys.argv[1:])}`",
            "",
            "graph us: Kiln's timer (CUDA-graph replay of 10 calls); after L2 reset: the same with an L2 reset "
            "before each call, its own time subtracted (the builder's timing of quantized layers).", "",
            "| GEMM | workspace cap | choice | workspace KiB | kernels per call | graph us | after L2 reset us |",
            "|---|---|---|---|---|---|---|"]
    for name, M, K, N, act, out, inputs in GEMMS:
        if wanted and name not in wanted:
            continue
        x, w, s, bias = operands(M, K, N, inputs)
        spec = cublaslt.spec_of(x, w, True, act, out == FP8, FP16)
        if inputs == FP16:  # the FP16 engine's other tactic: torch's addmm, with its own workspace
            rows.append(timed_row(name, "torch", "addmm", "", lambda: torch._addmm_activation(
                bias, x, w, use_gelu=True) if act else torch.addmm(bias, x, w), [x], reset))
            print(rows[-1], flush=True)
        for cap in (cublaslt.MAX_WORKSPACE, 0):
            for i, plan in enumerate(cublaslt.choices(spec, dev, a.choices, cap)):
                if inputs == FP16:
                    def fn(plan=plan):
                        return cublaslt.gemm(x, w, bias, act, plan=plan)
                else:
                    def fn(plan=plan):
                        return cublaslt.fp8_gemm(x, w, s, s, bias, act, s if out == FP8 else None, FP16, plan=plan)

                rows.append(timed_row(name, f"{cap >> 20} MiB", i, plan.workspace >> 10, fn, [x], reset))
                print(rows[-1], flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "cublaslt-choices.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
