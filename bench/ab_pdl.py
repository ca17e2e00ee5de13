"""Same-process A/B of programmatic dependent launch (kernels/pdl.py): one engine per model and precision, two
execution contexts, one captured with Kiln's Triton kernels launched the ordinary way and one with PDL, timed in
interleaved rounds as bench/run.py times a call. The two run the same kernels on the same tactics, so their
outputs must be equal; the script says whether they are.

    python bench/ab_pdl.py --runs bert-base:32:fp16,bert-base:32:fp8,resnet50:1:fp16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import kiln  # noqa: E402
from bench.ab_tactics import export  # noqa: E402
from bench.run import time_fn  # noqa: E402
from kiln.kernels import pdl  # noqa: E402

RUNS = "bert-base:32:fp16,bert-base:32:fp8,resnet50:32:fp16,resnet50:32:int8,bert-base:1:fp16,resnet50:1:fp16"


def engine_for(path: str, feeds: dict, precision: str):
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    quant = {}
    if precision in ("int8", "fp8"):  # speed only: calibrated on the inputs themselves
        quant = {precision: True, "calib": [{k: v.numpy() for k, v in feeds.items()}]}
    # "obey": the 8-bit engine without precision by speed's extra builds; PDL does not change which layers are 8-bit
    cfg = kiln.BuildConfig(profiles=[kiln.Profile({k: (s, s, s) for k, s in shapes.items()})], device="cuda",
                           progress=False, fp16=True, precision_constraints="obey", **quant)
    return kiln.build(path, cfg)


def contexts(engine, dev: dict) -> dict:
    """Two contexts of one engine, each captured (on its first run) with PDL off or on."""
    out = {}
    for label, enabled in (("ordinary launches", False), ("PDL", True)):
        pdl.ENABLED = enabled
        ctx = engine.create_execution_context()
        ctx.run(dev)  # captures the CUDA graph now, with this setting
        out[label] = ctx
    pdl.ENABLED = True
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=RUNS, help="model:batch:precision, comma-separated")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iterations", type=int, default=100)
    args = p.parse_args(argv)
    if not pdl.ENABLED:
        print(f"Triton {__import__('triton').__version__} has no programmatic dependent launch")
        return 1
    print(f"# Programmatic dependent launch A/B, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}\n")
    print("| model | batch | precision | ordinary us (rounds) | PDL us (rounds) | PDL / ordinary | outputs |")
    print("|---|---|---|---|---|---|---|")
    exported = {}
    for run_spec in args.runs.split(","):
        model, batch, precision = run_spec.split(":")
        if (model, batch) not in exported:
            exported[model, batch] = export(model, int(batch))
        path, feeds = exported[model, batch]
        dev = {k: v.cuda() for k, v in feeds.items()}
        ctxs = contexts(engine_for(path, feeds, precision), dev)
        outs = [ctx.run(dev) for ctx in ctxs.values()]
        equal = all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
        diff = max(float((outs[0][k].float() - outs[1][k].float()).abs().max()) for k in outs[0])
        graphs = all(c.uses_cuda_graphs and not c.capture_failures for c in ctxs.values())
        rounds = {label: [] for label in ctxs}
        for _ in range(args.rounds):  # interleaved, so drift in clocks or load hits both alike
            for label, ctx in ctxs.items():
                run = lambda f, ctx=ctx: ctx.run(f, copy_outputs=False)  # noqa: E731
                rounds[label].append(1000 * time_fn(run, [dev], args.iterations)["median_ms"])
        a, b = (statistics.median(r) for r in rounds.values())
        cells = [f"{statistics.median(r):.1f} ({', '.join(f'{x:.0f}' for x in r)})" for r in rounds.values()]
        print(f"| {model} | {batch} | {precision} | {cells[0]} | {cells[1]} | {b / a:.3f} | "
              f"{'equal' if equal else f'DIFFER (max {diff:.3g})'}{'' if graphs else ', NOT all in CUDA graphs'} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
