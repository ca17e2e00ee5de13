"""Same-process A/B of the 16-bit GEMM weights' layout: [K, N] row-major (as exported) or K-major (a [K, N] view
of [N, K] memory, as torch.nn.Linear holds them and eager PyTorch and torch.compile hand them to cuBLAS).

cuBLASLt picks its kernel per layout. For BERT-base's FFN1 at batch 32 with row-major weights it picks a kernel
that needs a memset node before it in the graph, and the FP16 engine's graph launch costs about 35 us of host time
against 7 us for the FP8 engine's larger graph without memsets (bench/results/H200-trace-bert-b32*.md).
One engine is built; its weights are then placed either way, and the two contexts are timed in interleaved rounds
as bench/run.py times a call, with each one's kernels per call.

    python bench/ab_layout.py --model bert-base --batch 32
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
from bench.models import MODELS  # noqa: E402
from bench.run import kernel_profile, time_fn  # noqa: E402
from bench.trace import device_ms, host_us  # noqa: E402

GEMMS = ("FusedGemm", "GemmSkipLayerNorm")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert-base", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=100)
    args = p.parse_args(argv)

    path, feeds = export(args.model, args.batch)
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    cfg = kiln.BuildConfig(profiles=[kiln.Profile({k: (s, s, s) for k, s in shapes.items()})], device="cuda",
                           progress=False, fp16=True)
    engines = {"row-major [K, N]": kiln.build(str(path), cfg), "K-major": kiln.build(str(path), cfg)}
    kmajor = engines["K-major"]
    names = sorted({n.inputs[1] for n in kmajor.graph.nodes if n.op_type in GEMMS and len(n.inputs) > 1
                    and n.inputs[1] in kmajor.graph.initializers and kmajor.graph.initializers[n.inputs[1]].dim() == 2})
    kmajor.column_major = sorted(set(kmajor.column_major) | set(names))
    kmajor._device_weights = None  # placed again, with the new layout, by the first context
    dev = {k: v.cuda() for k, v in feeds.items()}
    contexts = {label: e.create_execution_context() for label, e in engines.items()}
    ref = next(iter(contexts.values())).run(dev)
    for k, v in contexts["K-major"].run(dev).items():
        torch.testing.assert_close(v.float(), ref[k].float(), atol=2e-2, rtol=2e-2)
    rounds = {label: [] for label in contexts}
    for _ in range(args.rounds):  # interleaved, so drift in clocks or load hits both alike
        for label, ctx in contexts.items():
            run = lambda f, ctx=ctx: ctx.run(f, copy_outputs=False)  # noqa: E731
            rounds[label].append(1000 * time_fn(run, [dev], args.iterations)["median_ms"])

    print(f"# {args.model} batch {args.batch} FP16, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"{len(names)} GEMM weights\n")
    print("| weights | median of rounds us | rounds us | device time, host hidden us | host time of a call us |")
    print("|---|---|---|---|---|")
    for label, ctx in contexts.items():
        run = lambda f, ctx=ctx: ctx.run(f, copy_outputs=False)  # noqa: E731
        print(f"| {label} | {statistics.median(rounds[label]):.1f} | {', '.join(f'{r:.0f}' for r in rounds[label])} "
              f"| {1000 * device_ms(run, dev):.1f} | {host_us(run, dev):.1f} |")
    for label, ctx in contexts.items():
        kernels = kernel_profile(lambda f, ctx=ctx: ctx.run(f, copy_outputs=False), dev)
        print(f"\n{label} kernels per call: " + "; ".join(
            f"`{x['kernel'][:60]}` x{x['calls']} {1000 * x['ms']:.1f} us" for x in kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
