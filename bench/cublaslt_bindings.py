"""cuBLASLt through ctypes against nvmath-python's bindings (kiln[nvmath]), on BERT-base's GEMMs as Kiln's FP8 and
FP16 engines run them.

Both bindings call the same C functions with the same arguments, so the kernels are the same; what may differ is
the host's time per call (argument conversion) and each plan's set-up. Per GEMM and bindings: the heuristic's
choices (they must agree), the host's time per call over 200 calls launched back to back, the device's time per
call in a CUDA-graph replay (Kiln's timer), and whether the outputs are bit-for-bit equal.

    python bench/cublaslt_bindings.py [--batch 32]      (GPU, nvmath-python importable)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench.cublaslt_choices import FP8, FP16, operands
from kiln.kernels import cublaslt
from kiln.tactics.timer import median_ms

# (name, K, N, activation, output type, inputs type): BERT-base's four GEMMs in its FP8 and FP16 engines
GEMMS = [("fp8 qkv", 768, 2304, "", FP16, FP8), ("fp8 attn_out", 768, 768, "", FP16, FP8),
         ("fp8 ffn1 gelu->fp8", 768, 3072, "GeluTanh", FP8, FP8), ("fp8 ffn2", 3072, 768, "", FP16, FP8),
         ("fp16 qkv", 768, 2304, "", FP16, FP16), ("fp16 attn_out", 768, 768, "", FP16, FP16),
         ("fp16 ffn1 gelu", 768, 3072, "GeluTanh", FP16, FP16), ("fp16 ffn2", 3072, 768, "", FP16, FP16)]
BINDINGS = ("ctypes", "nvmath")


def caller(M, K, N, act, out, inputs):
    """(the GEMM's Spec, a function plan -> output) with the engine's operands."""
    x, w, scale, bias = operands(M, K, N, inputs)
    if inputs == FP16:
        return cublaslt.spec_of(x, w, True, act, False, FP16), lambda plan: cublaslt.gemm(x, w, bias, act, plan=plan)
    y_scale = scale if out == FP8 else None
    spec = cublaslt.spec_of(x, w, True, act, y_scale is not None, FP16)
    return spec, lambda plan: cublaslt.fp8_gemm(x, w, scale, scale, bias, act, y_scale, FP16, plan=plan)


def host_us(fn, plan, calls=200) -> float:
    """The host's time per call, the calls launched back to back (the device runs behind)."""
    fn(plan)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(plan)
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * t / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, action="append", help="BERT batch (x128 tokens); repeatable; default 1, 32")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the host timing")
    args = p.parse_args()
    import nvmath

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, nvmath-python {nvmath.__version__}", flush=True)
    device = torch.device("cuda")
    apis = {name: cublaslt.bindings(name) for name in BINDINGS}
    print("| GEMM | M | choices agree | host us/call ctypes | host us/call nvmath | graph us ctypes | graph us nvmath "
          "| equal |", flush=True)
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for batch in args.batch or [1, 32]:
        M = batch * 128
        for name, K, N, act, out, inputs in GEMMS:
            spec, fn = caller(M, K, N, act, out, inputs)
            cap = cublaslt.MAX_WORKSPACE if inputs == FP8 else 0  # each engine's default scratch for the tactic
            plans = {b: cublaslt.choices(spec, device, cublaslt.ALGOS, cap, apis[b]) for b in BINDINGS}
            agree = ([p.workspace for p in plans["ctypes"]] == [p.workspace for p in plans["nvmath"]]
                     and len(plans["ctypes"]) > 0)
            first = {b: plans[b][0] for b in BINDINGS}
            equal = torch.equal(fn(first["ctypes"]).view(torch.uint8), fn(first["nvmath"]).view(torch.uint8))
            host = {b: [] for b in BINDINGS}
            for _ in range(args.rounds):
                for b in BINDINGS:  # alternated: both see the same clocks
                    host[b].append(host_us(fn, first[b]))
            graph = {b: median_ms(lambda f=fn, plan=first[b]: f(plan)) * 1e3 for b in BINDINGS}
            h = {b: statistics.median(host[b]) for b in BINDINGS}
            ratios.append(h["nvmath"] / h["ctypes"])
            print(f"| {name} | {M} | {agree} ({len(plans['ctypes'])}) | {h['ctypes']:.1f} | {h['nvmath']:.1f} | "
                  f"{graph['ctypes']:.1f} | {graph['nvmath']:.1f} | {equal} |", flush=True)
    print(f"host time per call, nvmath / ctypes: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} GEMMs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
