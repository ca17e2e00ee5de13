r"""Same-process A/B of tactic families: what a family of tactics is worth to a whole engine.

Run-to-run noise on the GPU (other tenants, clocks, torch.compile's own variance) is as large as most
single-tactic gains, so comparing two bench/run.py runs says little. This builds one engine with every
tactic and one per --without group (BuildConfig.exclude_tactics, trtexec-style --excludeTactics patterns),
then times them in interleaved rounds in one process, and reports each round.

    python bench/ab_tactics.py --model resnet50 --batch 1 --without 'triton_conv_splitk_*' --without 'triton_tma_*'
    python bench/ab_tactics.py --model resnet50 --batch 32 --precision int8 --level 4 --without 'cudnn_graph_*'
    python bench/ab_tactics.py --model resnet50 --batch 32 --precision int8 --off time_quantized_cold

--off adds a variant built with a boolean BuildConfig option off (time_quantized_cold: 8-bit layers timed warm),
the builder free to choose other tactics either way. The last column counts the layers whose tactic differs from
the first variant's.

8-bit engines are calibrated on the benchmark input itself (speed only) and built with precision constraints
`obey`, so that every variant quantizes the same layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
import kiln  # noqa: E402
from bench.models import MODELS, export_onnx  # noqa: E402
from bench.run import time_fn  # noqa: E402


def export(model_name: str, batch: int) -> tuple[str, dict]:
    """The bench model as ONNX with a dynamic batch, and one batch of its inputs."""
    model, names, make = MODELS[model_name]()
    g = torch.Generator().manual_seed(0)
    feeds = make(batch, g)
    return export_onnx(model, names, make(2, g), batch, Path(tempfile.mkdtemp()) / f"{model_name}.onnx"), feeds


def differing(first: list[str], other: list[str]) -> str:
    """How many layers' tactics differ between two builds of one model (whose layers come in the same order)."""
    if len(first) != len(other):
        return f"n/a ({len(other)} layers against {len(first)})"
    return str(sum(a != b for a, b in zip(first, other)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--without", action="append", default=[], metavar="PATTERNS",
                   help="a variant without these tactics (comma-separated names or patterns); repeatable")
    p.add_argument("--off", action="append", default=[], metavar="OPTION",
                   help="a variant built with this boolean BuildConfig option False; repeatable")
    p.add_argument("--precision", default="fp16", choices=["fp16", "int8", "fp8"])
    p.add_argument("--level", type=int, default=3, help="the builder's optimization level")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=100)
    args = p.parse_args(argv)

    path, feeds = export(args.model, args.batch)
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    variants = {"all tactics": ()} | {f"without {w}": tuple(x.strip() for x in w.split(",")) for w in args.without}
    booleans = {f.name for f in dataclasses.fields(kiln.BuildConfig) if f.type in (bool, "bool")}
    for option in args.off:
        if option not in booleans:
            p.error(f"--off {option}: not a boolean BuildConfig option ({', '.join(sorted(booleans))})")
    variants |= {f"{option} off": () for option in args.off}
    contexts, chosen = {}, {}
    quant = {}
    if args.precision != "fp16":
        quant = {args.precision: True, "calib": [{k: v.numpy() for k, v in feeds.items()}],
                 "precision_constraints": "obey"}
    dev = {k: v.cuda() for k, v in feeds.items()}
    for label, exclude in variants.items():
        off = {label.removesuffix(" off"): False} if label.removesuffix(" off") in args.off else {}
        cfg = kiln.BuildConfig(profiles=[kiln.Profile({k: (s, s, s) for k, s in shapes.items()})], device="cuda",
                               progress=False, fp16=True, exclude_tactics=exclude,
                               optimization_level=args.level, **quant, **off)
        engine = kiln.build(str(path), cfg)
        contexts[label] = engine.create_execution_context()
        contexts[label].run(dev, copy_outputs=False)  # the CUDA graph is captured here
        chosen[label] = [t["chosen"] for t in engine.tactics]
    rounds = {label: [] for label in contexts}
    for _ in range(args.rounds):  # interleaved, so drift in clocks or load hits every variant alike
        for label, ctx in contexts.items():
            run = lambda f, ctx=ctx: ctx.run(f, copy_outputs=False)  # noqa: E731
            rounds[label].append(1000 * time_fn(run, [dev], args.iterations)["median_ms"])

    print(f"# {args.model} batch {args.batch} {args.precision.upper()} level {args.level}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| variant | median of rounds us | rounds us | layers using the excluded tactics in 'all tactics' "
          "| layers choosing otherwise |")
    print("|---|---|---|---|---|")
    for label, exclude in variants.items():
        used = [c for c in chosen["all tactics"] if any(fnmatch.fnmatchcase(c, x) for x in exclude)]
        counts = {c: used.count(c) for c in sorted(set(used))}
        print(f"| {label} | {statistics.median(rounds[label]):.1f} | {', '.join(f'{r:.0f}' for r in rounds[label])} "
              f"| {', '.join(f'{c} x{n}' for c, n in counts.items()) or '-'} "
              f"| {differing(chosen['all tactics'], chosen[label])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
