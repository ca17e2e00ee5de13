"""The kernel timeline of one CUDA-graph replay: every kernel in launch order, its time and the idle
gap before it. Where a per-kernel-name profile (bench/run.py --kernel-profile) says what runs, this says
where the device waits between kernels, which dominates at batch 1, and how long each call's device
work waits for the host (checks, input copies, graph launch).

--layers adds each layer's kernels in the replay against the builder's timing of its tactic: where the
selector's prediction and the engine part. Kernels are given to layers by name, in order: an eager run
launches a marker kernel (torch.cuda._sleep) before each device layer, and each layer's kernel names are
then found, in order, in the replay's timeline. Branches on the auxiliary stream interleave there, so a
model with them may map only up to its first branch (the table says where mapping stopped).

    python bench/trace.py --model bert-base --batch 1 --precision fp16 [--level 4] [--layers] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kiln  # noqa: E402
from bench.models import MODELS, export_onnx  # noqa: E402
from bench.run import device_ms, kernel_events, time_fn  # noqa: E402


def timeline(fn, feeds: dict, runs: int = 5) -> list[dict]:
    """Kernels of the last of `runs` calls, in start order: name, duration and the gap before it (us)."""
    events = sorted(kernel_events(fn, feeds, runs), key=lambda e: e.time_range.start)
    last = events[-(len(events) // runs):]  # every call launches the same kernels
    rows, prev_end = [], None
    for e in last:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        rows.append({"kernel": e.name[:100], "us": e.time_range.elapsed_us(), "gap_us": gap})
        prev_end = e.time_range.end
    return rows


def layer_kernels(ctx, feeds: dict) -> list[tuple[str, list[str]]]:
    """(layer name, the names of the kernels it launches) per device layer, from one eager run with a marker
    kernel before each layer (after kernel_events' warm-up run: weight uploads and compiles happen there)."""
    names = []

    def mark(node, args):
        names.append(node.name or node.label)
        torch.cuda._sleep(1)

    events = sorted(kernel_events(lambda f: ctx.run_with_inputs_hook(f, mark), feeds, runs=1),
                    key=lambda e: e.time_range.start)
    names = names[len(names) // 2:]  # the warm-up run marked its layers too
    groups: list[list[str]] = []
    for e in events:
        if "spin_kernel" in e.name:
            groups.append([])
        elif groups:
            groups[-1].append(e.name[:100])
    return list(zip(names, groups))


def per_layer(layers: list[tuple[str, list[str]]], rows: list[dict]) -> tuple[list[dict], str]:
    """Each layer's kernel time in the replay (rows: timeline()), its kernels found by name in order; and
    where mapping stopped, if it did."""
    out, j = [], 0
    for name, kernels in layers:
        us = 0.0
        for k in kernels:
            start = j
            while j < len(rows) and rows[j]["kernel"] != k:
                j += 1
            if j == len(rows) and k.startswith(("Memcpy", "Memset")):
                j = start  # an eager run's copy the replay does not make (an embedding's host-side index)
                continue
            if j == len(rows):
                return out, f"mapping stopped at {name}: its kernel `{k}` is not in the replay after those mapped"
            us += rows[j]["us"]
            j += 1
        out.append({"layer": name, "kernels": len(kernels), "us": us})
    return out, ""


def layer_table(engine, layers: list[dict], stopped: str) -> list[str]:
    """Builder's timing of each layer's chosen tactic against its kernels' time in the replay."""
    timed = {r["layer"]: (r["chosen"], 1000 * r["timings"].get(r["chosen"], float("nan"))) for r in engine.tactics}
    rows = [(x, *timed[x["layer"]]) for x in layers if x["layer"] in timed]
    built, ran = sum(b for _, _, b in rows), sum(x["us"] for x, _, _ in rows)
    lines = ["", f"## Builder's timing against the replay, per layer ({len(rows)} timed layers: builder "
             f"{built:.1f} us, replay {ran:.1f} us, {ran / built:.2f}x)" if rows else "## No timed layers mapped",
             "", stopped or f"all {len(layers)} device layers mapped", "",
             "| layer | tactic | builder us | replay us | replay / builder |", "|---|---|---|---|---|"]
    rows.sort(key=lambda r: -r[0]["us"])
    lines += [f"| {x['layer'][:60]} | {t} | {b:.1f} | {x['us']:.1f} | {x['us'] / b:.2f} |" for x, t, b in rows]
    # the same by tactic family: a family the builder times slower than the replay runs it loses choices it
    # should win (docs/design/timing.md)
    families: dict[str, list[float]] = {}
    for x, t, b in rows:
        f = families.setdefault(tactic_family(t), [0, 0.0, 0.0])
        f[0] += 1
        f[1] += b
        f[2] += x["us"]
    lines += ["", "| tactic family | layers | builder us | replay us | replay / builder |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {n} | {b:.1f} | {r:.1f} | {r / b:.2f} |"
              for name, (n, b, r) in sorted(families.items(), key=lambda kv: -kv[1][2])]
    return lines


def tactic_family(tactic: str) -> str:
    """A tactic's name without its configuration: triton_tma_qconv1x1_128x128x64_w4_s3 -> triton_tma_qconv1x1,
    cudnn_graph_plan1 -> cudnn_graph, cublaslt_fp8_epilogue_algo3_no_workspace -> cublaslt_fp8_epilogue."""
    return re.sub(r"_(\d+x\d+|plan\d|algo\d|s\d+_).*$", "", tactic)


def host_us(fn, feeds: dict, iterations: int = 100) -> float:
    """Median host time of one call, from entering fn to its return, with the GPU idle at the start of each:
    what the host spends enqueueing (checks, input copies, graph launch), not the device work."""
    times = []
    for _ in range(iterations):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(feeds)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert-base", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--precision", default="fp16", choices=["fp16", "int8", "fp8"])
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--layers", action="store_true", help="each layer's replay time against the builder's timing")
    p.add_argument("--out", default=None, help="folder for <model>-b<batch>-<precision>-trace.md")
    args = p.parse_args(argv)

    model, names, make = MODELS[args.model]()
    g = torch.Generator().manual_seed(0)
    feeds = make(args.batch, g)
    path = export_onnx(model, names, make(2, g), args.batch, Path(tempfile.mkdtemp()) / f"{args.model}.onnx")
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    quant = {}
    if args.precision != "fp16":  # speed only: calibrated on random inputs
        quant = {args.precision: True, "calib": [{k: v.numpy() for k, v in make(args.batch, g).items()}]}
    cfg = kiln.BuildConfig(profiles=[kiln.Profile({k: (s, s, s) for k, s in shapes.items()})], device="cuda",
                           progress=False, fp16=True, optimization_level=args.level, **quant)
    engine = kiln.build(str(path), cfg)
    ctx = engine.create_execution_context()
    dev_feeds = {k: v.cuda() for k, v in feeds.items()}
    run = lambda f: ctx.run(f, copy_outputs=False)  # noqa: E731
    # Timed before the profiler runs: once it has attached, every launch costs more host time.
    per_call, device = 1000 * time_fn(run, [dev_feeds], 100)["median_ms"], 1000 * device_ms(run, dev_feeds)
    host = host_us(run, dev_feeds)
    # The same split for the graph's replay alone (no input checks or copies): what the launch itself costs.
    graph = next(c for c in ctx._captured.values() if c is not None).graph
    replay = lambda f: graph.replay()  # noqa: E731
    replay_call, replay_host = 1000 * time_fn(replay, [dev_feeds], 100)["median_ms"], host_us(replay, dev_feeds)
    rows = timeline(run, dev_feeds)
    busy, idle = sum(r["us"] for r in rows), sum(r["gap_us"] for r in rows)
    lines = [f"# {args.model} batch {args.batch} {args.precision} level {args.level}: one CUDA-graph replay",
             "", f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {len(engine.graph.nodes)} layers",
             f"{len(rows)} kernels, busy {busy:.1f} us, idle between kernels {idle:.1f} us, span {busy + idle:.1f} us",
             f"per call as bench/run.py times it {per_call:.1f} us; device time with the host hidden {device:.1f} us "
             f"(so the device waits {per_call - device:.1f} us for the host); the call itself returns after "
             f"{host:.1f} us of host time",
             f"the graph's replay alone (no input copies): {replay_call:.1f} us per call, {replay_host:.1f} us of host "
             "time",
             "", "| # | gap us | kernel us | kernel |", "|---|---|---|---|"]
    lines += [f"| {i} | {r['gap_us']:.1f} | {r['us']:.1f} | `{r['kernel']}` |" for i, r in enumerate(rows)]
    if args.layers:
        lines += layer_table(engine, *per_layer(layer_kernels(ctx, dev_feeds), rows))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out, f"{args.model}-b{args.batch}-{args.precision}-trace.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
