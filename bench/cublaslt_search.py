"""cuBLASLt's configuration space on BERT-base's batch-32 GEMMs, beyond the heuristic's at most eight choices.

For each GEMM as Kiln's FP8 and FP16 engines run it, every configuration `cublaslt.search` finds (algorithm x
tile x stages x cluster shape x CTA swizzle x custom option that cublasLtMatmulAlgoCheck accepts without
scratch) is timed as the builder times tactics (CUDA-graph replay of 10 calls), within a time budget per GEMM,
against the best of the heuristic's eight choices. The fastest configurations are re-timed after an L2 reset,
named by the kernel they launch, and checked against the heuristic's output.

    python bench/cublaslt_search.py --out bench/results     (GPU; writes cublaslt-search.md)
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench.cublaslt_choices import FP8, FP16, GEMMS, operands  # noqa: E402
from bench.run import kernel_events  # noqa: E402
from kiln.kernels import cublaslt  # noqa: E402
from kiln.tactics.timer import L2Reset, median_ms  # noqa: E402

DEFAULT = "qkv, fp8 out;attn_out;ffn1;ffn2;fp16 qkv;fp16 attn_out;fp16 ffn1;fp16 ffn2"


def kernel_name(fn) -> str:
    names = {e.name[:70] for e in kernel_events(lambda _: fn(), None, runs=1)}
    return ", ".join(sorted(names))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--gemms", default=DEFAULT, help="names from bench/cublaslt_choices.py, separated by ;")
    ap.add_argument("--budget", type=float, default=25.0, help="seconds of timing per GEMM")
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    dev = torch.device("cuda")
    reset = L2Reset(dev)
    rows = [f"# cuBLASLt's configuration space on BERT-base batch-32 GEMMs ({torch.cuda.get_device_name()}, "
            f"torch {torch.__version__})", "",
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, `python bench/cublaslt_search.py "
            f"{' '.join(sys.argv[1:])}`", "",
            "us per call: CUDA-graph replay of 10 calls; after L2 reset: weights from memory, as in an engine. "
            "heuristic: the best of its first eight no-scratch choices. max diff: against the heuristic's "
            "first choice's output.", ""]
    for name in a.gemms.split(";"):
        (_, M, K, N, act, out, inputs), = [g for g in GEMMS if g[0] == name]
        x, w, s, bias = operands(M, K, N, inputs)
        spec = cublaslt.spec_of(x, w, True, act, out == FP8, FP16)

        def call(plan):
            if inputs == FP16:
                return cublaslt.gemm(x, w, bias, act, plan=plan)
            return cublaslt.fp8_gemm(x, w, s, s, bias, act, s if out == FP8 else None, FP16, plan=plan)

        heuristic = cublaslt.choices(spec, dev, 8, 0)
        reference = call(heuristic[0]).float()
        h_times = [median_ms(lambda p=p: call(p)) * 1e3 for p in heuristic]
        h_best = min(range(len(heuristic)), key=h_times.__getitem__)
        t0 = time.perf_counter()
        space = cublaslt.search(spec, dev)
        found_s = time.perf_counter() - t0
        timed, failed = [], 0
        t0 = time.perf_counter()
        for config, plan in space:
            if time.perf_counter() - t0 > a.budget:
                break
            try:
                timed.append((median_ms(lambda p=plan: call(p)) * 1e3, config, plan))
            except Exception:  # a configuration AlgoCheck accepted that does not run: count it, go on
                failed += 1
        timed.sort(key=lambda r: r[0])
        print(f"{name}: {len(space)} configurations ({found_s:.1f} s to check), {len(timed)} timed, "
              f"{failed} failed; heuristic best {h_times[h_best]:.1f} us", flush=True)
        rows += [f"## {name}: M {M} K {K} N {N} {act or 'bias'}, {str(inputs).split('.')[-1]} in, "
                 f"{str(out).split('.')[-1]} out", "",
                 f"{len(space)} configurations accepted ({found_s:.1f} s to enumerate), {len(timed)} timed in "
                 f"{a.budget:.0f} s, {failed} failed to run.", "",
                 "| choice | us | after L2 reset us | max diff | kernel |", "|---|---|---|---|---|"]
        keep = [x]
        hp = heuristic[h_best]
        rows.append(f"| heuristic #{h_best} | {h_times[h_best]:.1f} | "
                    f"{median_ms(lambda: call(hp), before=reset.keeping(keep)) * 1e3:.1f} | 0 | "
                    f"`{kernel_name(lambda: call(hp))}` |")
        for us, config, plan in timed[:a.top]:
            try:
                diff = (call(plan).float() - reference).abs().max().item()
                cold = median_ms(lambda p=plan: call(p), before=reset.keeping(keep)) * 1e3
                rows.append(f"| {config.name} | {us:.1f} | {cold:.1f} | {diff:.3g} | "
                            f"`{kernel_name(lambda p=plan: call(p))}` |")
            except Exception as e:
                rows.append(f"| {config.name} | {us:.1f} | failed: {type(e).__name__}: {e} | | |")
        rows.append("")
        print("\n".join(rows[-a.top - 3:]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "cublaslt-search.md").write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
