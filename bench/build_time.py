"""Where a build's time goes: one zoo model built cold (fresh Triton cache, no timing cache) at one precision.

    python bench/build_time.py --save /tmp/bt resnet18 bert          # export once: ONNX + inputs per model
    python bench/build_time.py --load /tmp/bt --model resnet18 --precision int8 --threads 16
    python bench/build_time.py --save /tmp/tv --torchvision resnet18 --model resnet18 --obey --threads 16 --deadline 27

Prints the build's seconds, its phases (engine.build_config["build_phases"]), what the tactic selection did
(["tactic_selection"]: layers measured, candidates, seconds in first calls and timing, compiles made ahead) and,
for an 8-bit GPU build at the default precision constraints, the same for each engine it built
(quant/speed.py). --threads sets KILN_PARALLEL_COMPILE (0: every candidate compiles on its first call).
--obey builds the fully quantized engine alone. --no-prune offers the candidates tactic_selection.SUPERSEDED
takes out, and prints for each layer whether one of them would have won, and by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()  # --deadline counts from here


def _save(folder: Path, names: list[str], size: str, batch: int) -> None:
    import numpy as np
    import onnx

    sys.path.insert(0, str(Path(__file__).parent))
    import zoo
    import zoo_models

    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        start = time.perf_counter()
        prep = zoo.prepare(zoo_models.by_name([name])[0], size, batch)
        model = prep.onnx_model if not isinstance(prep.onnx_model, (str, os.PathLike)) else onnx.load(prep.onnx_model)
        onnx.save(model, str(folder / f"{name}.onnx"))
        np.savez(folder / f"{name}-feeds.npz", **{k: v.numpy() for k, v in prep.feeds.items()})
        calib = zoo.calibration_feeds(prep)
        np.savez(folder / f"{name}-calib.npz", **{k: np.concatenate([c[k].numpy() for c in calib]) for k in calib[0]})
        print(f"saved {name} (batch {batch}, {size}) in {time.perf_counter() - start:.1f} s", flush=True)


def _save_torchvision(folder: Path, names: list[str], batch: int) -> None:
    """torchvision models at 224x224 with their initial weights, through torch.onnx's TorchScript exporter (seconds,
    where the zoo's dynamo export takes tens of them): for a build-time run on a short budget."""
    import numpy as np
    import torch
    import torchvision

    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        start = time.perf_counter()
        module = getattr(torchvision.models, name)().eval()
        x = torch.randn(batch, 3, 224, 224)
        torch.onnx.export(module, (x,), str(folder / f"{name}.onnx"), dynamo=False, opset_version=17,
                          input_names=["x"])
        np.savez(folder / f"{name}-feeds.npz", x=x.numpy())
        np.savez(folder / f"{name}-calib.npz", x=np.random.default_rng(0).standard_normal((8 * batch, 3, 224, 224),
                                                                                         dtype=np.float32))
        print(f"saved {name} (batch {batch}, torchvision, TorchScript export) in {time.perf_counter() - start:.1f} s",
              flush=True)


def _stop_at(seconds: float, compiles: dict, start: float) -> None:
    """After `seconds` (or on SIGINT, as a caller's timeout -s INT sends it): print the compiles so far and exit
    at once (compiling threads are not waited for)."""
    import signal

    def stop(signum, frame):
        print(f"STOPPED after {time.perf_counter() - start:.1f} s ({signal.Signals(signum).name}); so far:", flush=True)
        _print_compiles(compiles)
        os._exit(3)

    signal.signal(signal.SIGINT, stop)
    if seconds:
        signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.1))


def _print_selection(label: str, build: dict) -> None:
    sel = build.get("tactic_selection") or {}
    phases = build.get("phases") or build.get("build_phases") or {}
    print(f"  {label}: {build.get('seconds', '?')} s; phases {json.dumps(phases)}", flush=True)
    if sel:
        print(f"    tactic selection {json.dumps(sel)}", flush=True)


def _pruning(engine) -> None:
    """For each layer timed with the superseded candidates: whether one of them won, and the kept best's cost."""
    from kiln.builder import tactic_selection

    tactic_selection.PRUNE_BELOW_LEVEL = 4  # the rule as a default-level build applies it (--no-prune set 0)
    superseded = tactic_selection.superseded
    lost, layers = [], 0
    for rep in engine.tactics:
        names = [n for n in rep["timings"] if n != "reference"]
        pruned = superseded(names, 3)
        if not pruned:
            continue
        layers += 1
        kept = {n: t for n, t in rep["timings"].items() if n not in pruned}
        best_kept = min(kept, key=kept.get)
        if rep["chosen"] in pruned:
            lost.append((rep["layer"], rep["chosen"], rep["timings"][rep["chosen"]], best_kept, kept[best_kept]))
    print(f"pruning check: {layers} layers had superseded candidates; a superseded one won on {len(lost)}", flush=True)
    for layer, chosen, ms, best, best_ms in lost:
        print(f"  {layer}: {chosen} {ms * 1e3:.2f} us, best kept {best} {best_ms * 1e3:.2f} us "
              f"(+{100 * (best_ms / ms - 1):.1f}%)", flush=True)


def _count_compiles() -> dict:
    """Wrap Triton's compile (which JITFunction binds on its first call) to record each compile's kernel, cache
    key and seconds: {(kernel name, source hash, options): [seconds, ...]}. A key seen twice was compiled twice
    (the second from Triton's disk cache if the first had finished)."""
    import threading

    import triton.compiler

    real, seen, lock = triton.compiler.compile, {}, threading.Lock()
    span = [float("inf"), 0.0]  # first compile's start, last one's end
    seen["span"] = span

    def counted(src, *a, **kw):
        start = time.perf_counter()
        try:
            return real(src, *a, **kw)
        finally:
            took = time.perf_counter() - start
            try:
                ident = (src.name, src.hash(), json.dumps(kw.get("options"), sort_keys=True, default=str))
            except Exception:  # noqa: BLE001  (a source this Triton hashes otherwise: counted, not matched)
                ident = (getattr(src, "name", "?"), str(id(src)), "")
            with lock:
                seen.setdefault(ident, []).append(took)
                span[0] = min(span[0], start)
                span[1] = max(span[1], start + took)

    triton.compiler.compile = counted
    try:
        import triton.compiler.compiler as module

        module.compile = counted
    except ImportError:
        pass
    return seen


def _print_compiles(seen: dict) -> None:
    seen = dict(seen)
    span = seen.pop("span", None)
    if not seen:
        print("compiles: none counted (this Triton binds its compile elsewhere)", flush=True)
        return
    total = sum(len(v) for v in seen.values())
    secs = sum(sum(v) for v in seen.values())
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    print(f"compiles: {total} ({len(seen)} distinct kernels, {sum(len(v) - 1 for v in dup.values())} repeats), "
          f"{secs:.1f} s summed over threads, {span[1] - span[0]:.1f} s from the first one's start to the last one's "
          f"end", flush=True)
    by_name: dict[str, list] = {}
    for (name, _, _), v in seen.items():
        by_name.setdefault(name, []).extend(v)
    for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"  {name}: {len(v)} compiles, {sum(v):.1f} s, {max(v):.2f} s the longest", flush=True)
    for (name, _, _), v in list(dup.items())[:5]:
        print(f"  repeated: {name} x{len(v)} ({', '.join(f'{t:.2f}' for t in v)} s)", flush=True)


def _build(args) -> None:
    import numpy as np

    os.environ["KILN_PARALLEL_COMPILE"] = str(args.threads)
    if not args.triton_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-build-time-triton-")
    else:
        os.environ["TRITON_CACHE_DIR"] = args.triton_cache
    import warnings

    import onnx

    import kiln
    from kiln import BuildConfig, Profile
    from kiln.builder import tactic_selection

    if args.no_prune:
        tactic_selection.PRUNE_BELOW_LEVEL = 0
    compiles = _count_compiles()
    _stop_at(max(0.1, args.deadline - (time.perf_counter() - START)) if args.deadline else 0.0, compiles, START)
    folder = Path(args.load)
    model = onnx.load(str(folder / f"{args.model}.onnx"))
    feeds = dict(np.load(folder / f"{args.model}-feeds.npz"))
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    extra = {"fp16": {"fp16": True}, "bf16": {"bf16": True}, "int8": {"int8": True, "fp16": True},
             "fp8": {"fp8": True, "fp16": True}}[args.precision]
    if args.precision in ("int8", "fp8"):
        calib = dict(np.load(folder / f"{args.model}-calib.npz"))
        batch = next(iter(shapes.values()))[0]
        rows = next(iter(calib.values())).shape[0]
        extra["calib"] = [{k: v[i:i + batch] for k, v in calib.items()} for i in range(0, rows, batch)]
    config = BuildConfig(profiles=[Profile({k: (s, s, s) for k, s in shapes.items()})], device=args.device,
                         progress=not args.quiet, validate=False,
                         precision_constraints="obey" if args.obey else "none",
                         timing_cache=args.timing_cache, **extra)
    print(f"== {args.model} {args.precision} batch {next(iter(shapes.values()))[0]}: KILN_PARALLEL_COMPILE="
          f"{args.threads}, {'obey' if args.obey else 'precision by speed'}, "
          f"{'no pruning' if args.no_prune else 'pruned'}, timing cache {args.timing_cache or 'none'}, Triton cache "
          f"{'warm' if args.triton_cache else 'cold'}", flush=True)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = kiln.build(model, config)
    wall = time.perf_counter() - start
    print(f"RESULT {args.model} {args.precision} threads={args.threads}{' obey' if args.obey else ''}"
          f"{' no-prune' if args.no_prune else ''}: build {engine.build_seconds:.1f} s (wall {wall:.1f} s)",
          flush=True)
    speed = next((f for f in engine.findings if f.get("kind") == "precision-by-speed"), None)
    if speed is not None:
        for b in speed.get("builds", []):
            _print_selection(b["engine"], b)
        print(f"  result: {speed.get('result')}; trials {json.dumps(speed.get('trials', []))}", flush=True)
    else:
        _print_selection("engine", {"seconds": round(engine.build_seconds, 2), **engine.build_config})
    _print_compiles(compiles)
    if args.no_prune:
        _pruning(engine)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="with --save: the zoo models to export")
    p.add_argument("--save", help="export the named zoo models to this folder")
    p.add_argument("--size", default="real")
    p.add_argument("--torchvision", action="store_true",
                   help="with --save: torchvision models of these names, exported by torch.onnx's TorchScript exporter")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--load", help="the folder --save wrote")
    p.add_argument("--model")
    p.add_argument("--precision", default="int8", choices=["fp16", "bf16", "int8", "fp8"])
    p.add_argument("--threads", type=int, default=0, help="KILN_PARALLEL_COMPILE")
    p.add_argument("--obey", action="store_true", help="the fully quantized engine only (precisionConstraints=obey)")
    p.add_argument("--no-prune", action="store_true")
    p.add_argument("--timing-cache", help="a timing cache file (read if it exists, written after)")
    p.add_argument("--triton-cache", help="a Triton cache folder to reuse (default: a fresh one, a cold build)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from the start after which to print the compiles so far and stop (SIGINT does "
                        "the same)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.save:
        if args.torchvision:
            _save_torchvision(Path(args.save), args.names, args.batch)
        else:
            _save(Path(args.save), args.names, args.size, args.batch)
        if not args.model:
            return 0
        args.load = args.save  # saved, then built in the same process
    if not (args.load and args.model):
        p.error("give --save FOLDER NAMES..., or --load FOLDER --model NAME")
    _build(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
