"""Where an engine call's host time goes at batch 1: ExecutionContext.run against its parts (the input
checks' fast path, the input copy into the captured graph's buffer, the graph launch) and torch calls of
the same kind, each timed alone over many calls on the host clock (the device is kept from filling its
queue by a synchronize every 50 calls, outside the timing).

    python bench/host_overhead.py [--model resnet50]        (GPU)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kiln  # noqa: E402
from bench.models import MODELS, export_onnx  # noqa: E402


def host_us(fn, calls: int = 2000) -> float:
    """Median over 40 groups of 50 calls of the host time per call, us."""
    groups = []
    for _ in range(calls // 50):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(50):
            fn()
        groups.append((time.perf_counter_ns() - t0) / 50 / 1000)
    torch.cuda.synchronize()
    return sorted(groups)[len(groups) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    args = p.parse_args(argv)
    model, names, make = MODELS[args.model]()
    g = torch.Generator().manual_seed(0)
    feeds = {k: v.cuda() for k, v in make(1, g).items()}
    path = export_onnx(model, names, make(2, g), 1, Path(tempfile.mkdtemp()) / f"{args.model}.onnx")
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    cfg = kiln.BuildConfig(profiles=[kiln.Profile({k: (s, s, s) for k, s in shapes.items()})], device="cuda",
                           progress=False, fp16=True, optimization_level=1)  # host cost does not depend on tactics
    ctx = kiln.build(str(path), cfg).create_execution_context()
    ctx.run(feeds, copy_outputs=False)
    cap = next(c for c in ctx._captured.values() if c is not None)
    inputs, _ = ctx._normalize(feeds)
    x, buf = next(iter(feeds.values())), next(iter(cap.inputs.values()))
    rows = [
        ("ctx.run(feeds, copy_outputs=False)", lambda: ctx.run(feeds, copy_outputs=False)),
        ("ctx._normalize(feeds) (checked-signature fast path)", lambda: ctx._normalize(feeds)),
        ("ctx._replay(inputs) (copies + launch)", lambda: ctx._replay(inputs)),
        ("graph.replay()", cap.graph.replay),
        ("buffer.copy_(x, non_blocking=True)", lambda: buf.copy_(x, non_blocking=True)),
        ("buffer.copy_(x)", lambda: buf.copy_(x)),
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("x.shape, x.dtype, x.device", lambda: (x.shape, x.dtype, x.device)),
        ("empty python call", lambda: None),
    ]
    print(f"# {args.model} batch 1 FP16, {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call")
    for name, fn in rows:
        print(f"{host_us(fn):8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
