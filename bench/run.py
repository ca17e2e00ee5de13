"""Same-run latency and accuracy table (../shared/BENCHMARKS.md).

For each model and batch: PyTorch eager FP32 and FP16 (channels_last for CNNs),
torch.compile (max-autotune-no-cudagraphs, reduce-overhead) at FP16, and Kiln
engines at FP32/FP16/BF16 built from the model's ONNX export. Each Kiln engine is
also compared with onnxruntime (CPU, FP32) on the same inputs.

    python bench/run.py --out bench/results --models resnet50,bert-base --batches 1,32
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import kiln  # noqa: E402
from bench.models import MODELS, export_onnx  # noqa: E402

PEAK_FLOPS = 790e12  # measured dense bf16 matmul on the H200 here (BENCHMARKS.md)
PEAK_BYTES = 4.3e12  # measured device copy bandwidth


class Timeout(Exception):
    pass


def _alarm(seconds):
    def handler(signum, frame):
        raise Timeout(f"timed out after {seconds} s")

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


def time_fn(fn, input_sets, iterations: int, warmup: int = 20, before=None) -> dict:
    """CUDA-event timing, one event pair per call, rotating input sets; ms. before(): enqueued ahead of each
    call's first event (bench/trace.py queues a sleep kernel there to hide the host's share). Also the median
    host time of the call itself (host_us, from entering fn to its return) and how many times Python's garbage
    collector ran while timing (gc_runs): where the device waits for the host, whether the call's own host
    work is why."""
    for i in range(warmup):
        fn(input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    times, host = [], []
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(1) if phase == "start" else None)
    try:
        for i in range(iterations):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if before:
                before()
            e0.record()
            t0 = time.perf_counter()
            fn(input_sets[i % len(input_sets)])
            host.append(time.perf_counter() - t0)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
    finally:
        gc.callbacks.pop()
    t = np.array(times)
    return {"median_ms": float(np.median(t)), "p90_ms": float(np.percentile(t, 90)),
            "p99_ms": float(np.percentile(t, 99)), "min_ms": float(t.min()), "runs": iterations,
            "host_us": 1e6 * float(np.median(host)), "gc_runs": len(collections)}


def layer_profile(engine, feeds, runs: int = 5) -> dict:
    """Per-op-type GPU time (kiln bench's layer-by-layer profile, summed by op:tactic): where an engine
    spends its time."""
    from kiln.tools.bench import layer_profile as per_layer

    totals: dict[str, float] = {}
    for r in per_layer(engine, feeds, iterations=runs):
        key = f"{r.op_type}:{r.tactic}"
        totals[key] = totals.get(key, 0.0) + r.mean_ms
    total = sum(totals.values())
    return {k: {"ms": round(v, 4), "share": round(v / total, 4)}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[:8]}


def kernel_events(fn, feeds: dict, runs: int) -> list:
    """The device events of `runs` calls after a warm-up call, from torch.profiler (CUPTI), which sees
    kernels inside CUDA graphs."""
    from torch.profiler import ProfilerActivity, profile

    fn(feeds)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn(feeds)
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]


def device_ms(fn, feeds: dict, iterations: int = 100) -> float:
    """Median time of one call with the host's part hidden: a sleep kernel (about 1 ms at H200 clocks, far
    more than the host needs) keeps the GPU busy while the host enqueues the call, so the events bracket
    device work only. bench/run.py's per-call timing minus this is the host time the device waits for
    (input checks, copies, graph launch)."""
    return time_fn(fn, [feeds], iterations, before=lambda: torch.cuda._sleep(2_000_000))["median_ms"]


def kernel_profile(fn, feeds: dict, runs: int = 10, top: int = 12) -> list:
    """GPU time per kernel name, per call: what the device really runs, without the launch gaps a
    layer-by-layer profile adds."""
    totals: dict[str, list] = {}
    for e in kernel_events(fn, feeds, runs):
        t = totals.setdefault(e.name[:90], [0.0, 0])
        t[0] += e.time_range.elapsed_us() / 1000 / runs
        t[1] += 1
    total = sum(v[0] for v in totals.values()) or 1.0
    return [{"kernel": k, "ms": round(v[0], 4), "share": round(v[0] / total, 4), "calls": v[1] // runs}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]


def tactic_summary(engine) -> dict:
    """What the builder chose per op type, why candidates were excluded (naming up to three layers per
    reason), and each candidate's timing summed over its layers (for the next diagnosis)."""
    from collections import Counter

    chosen, excluded, where, timed = Counter(), Counter(), {}, {}
    for rep in engine.tactics:
        chosen[f"{rep['op']}:{rep.get('chosen')}"] += 1
        for name, ms in rep.get("timings", {}).items():  # each candidate's time summed over the layers it ran on
            t = timed.setdefault(f"{rep['op']}:{name}", {"layers": 0, "ms": 0.0})
            t["layers"] += 1
            t["ms"] = round(t["ms"] + ms, 4)
        for name, why in rep.get("excluded", {}).items():
            key = f"{rep['op']}:{name.split('_')[0]}: {why[:90]}"
            excluded[key] += 1
            layers = where.setdefault(key, [])
            if len(layers) < 3 and rep["layer"] not in layers:
                layers.append(rep["layer"])
    return {"chosen": dict(chosen.most_common()),
            "excluded": {k: {"count": c, "layers": where[k]} for k, c in excluded.most_common(12)}, "timed": timed,
            "slowest": slowest_layers(engine)}


def slowest_layers(engine, top: int = 16) -> list[dict]:
    """The layers whose chosen tactic the builder timed longest (CUDA-graph replays of the layer alone, summed
    over profiles), with their weights' shape: which layers a kernel-name profile's total is made of."""
    nodes = {n.name: n for n in engine.graph.nodes}
    rows = []
    for rep in engine.tactics:
        ms = rep.get("timings", {}).get(rep.get("chosen"))
        node = nodes.get(rep["layer"])
        if ms is None or node is None:
            continue
        w = engine.graph.initializers.get(node.inputs[1]) if len(node.inputs) > 1 else None
        rows.append({"layer": rep["layer"], "op": rep["op"], "tactic": rep["chosen"], "ms": ms,
                     "weights": list(w.shape) if w is not None else None,
                     "strides": node.attr("strides", None)})
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def count_flops(model, inputs: dict) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(**inputs)
    return float(fc.get_total_flops())


def ort_outputs(onnx_path: str, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0]


def error_stats(got: np.ndarray, ref: np.ndarray, tol: float) -> dict:
    """Errors against the reference. Pass: max |got - ref| <= tol * max(1, max |ref|).

    Scaled by the output's range: random-weight models have logits near 100, where
    one FP16 ulp is 0.06, so an absolute 1e-2 would demand more than FP16 can hold.
    """
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    scale = max(1.0, float(np.abs(ref).max()))
    return {
        "max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "ref_max_abs": float(np.abs(ref).max()),
        "max_err_of_range": float(diff.max() / scale),
        "rel_l2": float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30)), "tol": tol,
        "passed": bool(diff.max() <= tol * scale) and bool(np.isfinite(got).all()),
    }


TOL = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2, "int8": 1e-1, "fp8": 1e-1}


def bench_model(name: str, batches: list[int], args, results: list, onnx_dir: Path) -> None:
    make = MODELS[name]
    model, input_names, make_inputs = make()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    cpu_sets = {b: [make_inputs(b, g) for _ in range(4)] for b in batches}
    print(f"[{name}] exporting to ONNX", flush=True)
    t0 = time.perf_counter()
    onnx_path = export_onnx(model, input_names, make_inputs(2, g), max(batches), onnx_dir / f"{name}.onnx")
    export_s = time.perf_counter() - t0

    def shape_of(k, b):
        return tuple(cpu_sets[b][0][k].shape)

    lo, hi = min(batches), max(batches)

    def build_engines(b: int) -> tuple[dict, dict]:
        """Kiln's engines for batch b's rows: one profile covering every benchmarked batch, its opt shape
        (where tactics are timed) at b, as a TensorRT user benchmarking one shape builds."""
        profile = kiln.Profile({k: (shape_of(k, lo), shape_of(k, b), shape_of(k, hi)) for k in input_names})
        engines, builds = {}, {}
        levels = [int(v) for v in str(args.level).split(",")]
        auxes = [int(v) for v in str(args.max_aux_streams).split(",")]
        constraints = args.precision_constraints.split(",")
        for prec, level, aux, pc in [(p, lv, ax, c) for c in constraints for ax in auxes for lv in levels
                                     for p in args.precisions]:
            if pc != constraints[0] and prec not in ("int8", "fp8"):
                continue  # precision constraints only change quantized builds
            key = prec if level == levels[0] else f"{prec}_level{level}"  # a second level is a second engine
            key += "" if aux == auxes[0] else f"_aux{aux}"  # and so is a second auxiliary-stream setting
            key += "" if pc == constraints[0] else f"_{pc}"  # and a second precision-constraints value
            cache = str(onnx_dir / f"{name}-{key}.timing.json")
            if os.path.exists(cache):
                os.remove(cache)
            quant = {}
            if prec in ("int8", "fp8"):  # speed only: calibrated on random inputs, FP16 elsewhere
                calib = [{k: v.numpy() for k, v in make_inputs(b, g).items()} for _ in range(max(1, 128 // b))]
                quant = {prec: True, "calib": calib}
            cfg = kiln.BuildConfig(profiles=[profile], device="cuda", progress=False, timing_cache=cache,
                                   fp16=prec in ("fp16", "int8", "fp8"), bf16=prec == "bf16", tf32=prec == "tf32",
                                   optimization_level=level, max_aux_streams=aux, precision_constraints=pc,
                                   **quant)
            t0 = time.perf_counter()
            engines[key] = (kiln.build(onnx_path, cfg), time.perf_counter() - t0)
            t0 = time.perf_counter()
            kiln.build(onnx_path, cfg)  # again, with the timing cache the first build wrote
            builds[key] = {"cold_s": engines[key][1], "warm_cache_s": time.perf_counter() - t0}
            speed = next((f for f in engines[key][0].findings if f.get("kind") == "precision-by-speed"), None)
            if speed is not None:  # which quantized layers the build kept in FP16 because they timed faster there
                builds[key]["precision_by_speed"] = speed
            print(f"[{name} b{b}] built kiln {key}: {builds[key]}", flush=True)
        return engines, builds

    for b in batches:
        engines, builds = build_engines(b)
        row = {"model": name, "batch": b, "export_s": export_s, "results": {}, "accuracy": {}, "builds": builds}
        sets32 = [{k: v.to(dev) for k, v in s.items()} for s in cpu_sets[b]]
        half = lambda s: {k: (v.half() if v.is_floating_point() else v) for k, v in s.items()}  # noqa: E731
        sets16 = [half(s) for s in sets32]
        cl = name == "resnet50"
        m32 = model.to(dev).float()
        row["flops"] = count_flops(m32, sets32[0])
        weight_bytes16 = sum(p.numel() * 2 for p in m32.parameters())
        io_bytes = sum(v.numel() * v.element_size() for v in sets16[0].values())
        row["floor_ms"] = 1000 * max(row["flops"] / PEAK_FLOPS, (weight_bytes16 + io_bytes) / PEAK_BYTES)
        ref = ort_outputs(onnx_path, cpu_sets[b][0])

        with torch.no_grad():
            row["results"]["eager_fp32"] = time_fn(lambda s: m32(**s), sets32, args.iterations)
            m16 = m32.half()
            if cl:
                m16 = m16.to(memory_format=torch.channels_last)
                sets16 = [{k: v.contiguous(memory_format=torch.channels_last) for k, v in s.items()} for s in sets16]
            row["results"]["eager_fp16"] = time_fn(lambda s: m16(**s), sets16, args.iterations)
            for mode in ([] if args.skip_compile else args.compile_modes.split(",")):
                key = f"compile_{mode}_fp16"
                try:
                    torch._dynamo.reset()
                    _alarm(args.compile_timeout)
                    cm = torch.compile(m16, mode=mode)
                    t0 = time.perf_counter()
                    for s in sets16[:2]:
                        cm(**s)
                    torch.cuda.synchronize()
                    signal.alarm(0)
                    r = time_fn(lambda s: cm(**s), sets16, args.iterations)
                    r["compile_s"] = time.perf_counter() - t0
                    row["results"][key] = r
                except Exception as e:  # a crashing or timing-out mode is reported as such
                    signal.alarm(0)
                    row["results"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"[{name} b{b}] {key}: {row['results'][key]}", flush=True)
            model.float()  # m16 converted the module in place; restore for the next batch

        contexts = {prec: engine.create_execution_context() for prec, (engine, _) in engines.items()}
        for prec, (engine, build_s) in engines.items():  # every engine timed before any is profiled
            run = lambda s, ctx=contexts[prec]: ctx.run(s, copy_outputs=False)  # noqa: E731
            r = time_fn(run, sets32, args.iterations)
            if args.kernel_profile:
                r["device_ms"] = device_ms(run, sets32[0])
            r["build_s"] = build_s
            r["arena_bytes"] = engine.arena_bytes
            r["fused_layers"] = sum(n.domain == "kiln" for n in engine.graph.nodes)
            r["layers"] = len(engine.graph.nodes)
            r["tactics"] = tactic_summary(engine)
            row["results"][f"kiln_{prec}"] = r
        for prec, (engine, _) in engines.items():
            ctx, r = contexts[prec], row["results"][f"kiln_{prec}"]
            if prec == "fp16":
                r["layer_profile"] = layer_profile(engine, sets32[0])
            if args.kernel_profile:
                r["kernel_profile"] = kernel_profile(lambda s, ctx=ctx: ctx.run(s, copy_outputs=False), sets32[0])
            got = next(iter(ctx.run(sets32[0]).values())).float().cpu().numpy()
            row["accuracy"][f"kiln_{prec}"] = error_stats(got, ref, TOL[prec.split("_")[0]])
        eager = row["results"]["eager_fp32"]["median_ms"]
        eager16 = row["results"]["eager_fp16"]["median_ms"]
        compiled = [v["median_ms"] for k, v in row["results"].items() if k.startswith("compile") and "median_ms" in v]
        for k, v in row["results"].items():
            if "median_ms" in v:
                v["vs_eager_fp32"] = v["median_ms"] / eager
                v["vs_eager_fp16"] = v["median_ms"] / eager16
                v["vs_best_compile"] = v["median_ms"] / min(compiled) if compiled else None
                v["vs_floor"] = v["median_ms"] / row["floor_ms"]
        results.append(row)
        print(f"[{name} b{b}] " + json.dumps({k: round(v.get("median_ms", -1), 3) for k, v in row["results"].items()}),
              flush=True)
        print(f"[{name} b{b}] accuracy " + json.dumps(row["accuracy"]), flush=True)
        torch.cuda.empty_cache()


def environment(argv) -> dict:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        smi = "n/a"
    import triton

    return {
        "gpu": torch.cuda.get_device_name(), "nvidia_smi": smi, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "kiln": kiln.__version__,
        "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": "python bench/run.py " + " ".join(argv),
    }


def quantized_ratios(results: dict) -> list[str]:
    """The 8-bit engines against Kiln FP16 (issue 5's targets), per call and with the host's part hidden
    (device_ms): runs differ by tens of us in how long the device waits for the host."""
    fp16 = results.get("kiln_fp16", {})
    quant = [(k, v) for k, v in results.items() if k in ("kiln_int8", "kiln_fp8") and "median_ms" in v]
    if "median_ms" not in fp16 or not quant:
        return []
    lines = ["", "| Kiln engine against Kiln FP16 | per call | with the host's part hidden |", "|---|---|---|"]
    for k, v in quant:
        hidden = f"{v['device_ms'] / fp16['device_ms']:.2f}x" if "device_ms" in v and "device_ms" in fp16 else "n/a"
        lines.append(f"| {k} | {v['median_ms'] / fp16['median_ms']:.2f}x | {hidden} |")
    return lines


def to_markdown(env: dict, results: list) -> str:
    lines = [f"# Kiln benchmark on {env['gpu']}", "",
             f"- date: {env['date']}", f"- command: `{env['command']}`",
             f"- nvidia-smi: {env['nvidia_smi']}",
             f"- torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, kiln {env['kiln']}",
             "- median of CUDA-event timings per call, rotating 4 input sets; ratios are same-run.",
             "- each batch's Kiln engines are built for it: one profile over all benchmarked batches, "
             "opt at that batch.",
             f"- floor = max(FLOPs / {PEAK_FLOPS / 1e12:.0f} TFLOP/s, "
             f"FP16 weight+IO bytes / {PEAK_BYTES / 1e12:.1f} TB/s)",
             "- eager FP32 runs cuDNN convolutions in TF32 (torch's default cudnn.allow_tf32=True); Kiln FP32 is "
             "strict FP32, Kiln TF32 is the like-for-like peer.",
             "- accuracy passes when max |engine - reference| <= tol x max(1, max |reference|).",
             ""]
    for row in results:
        lines += [f"## {row['model']}, batch {row['batch']} "
                  f"({row['flops'] / 1e9:.1f} GFLOP, floor {row['floor_ms']:.3f} ms)", "",
                  "| runner | median ms | p90 ms | p99 ms | vs eager FP32 | vs eager FP16 | vs best compile | "
                  "vs floor |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in row["results"].items():
            if "median_ms" not in v:
                lines.append(f"| {k} | {v.get('error', 'n/a').splitlines()[0]} | | | | | | |")
                continue
            bc = f"{v['vs_best_compile']:.2f}x" if v.get("vs_best_compile") else "n/a"
            lines.append(f"| {k} | {v['median_ms']:.3f} | {v['p90_ms']:.3f} | {v['p99_ms']:.3f} | "
                         f"{v['vs_eager_fp32']:.2f}x | {v['vs_eager_fp16']:.2f}x | {bc} | {v['vs_floor']:.1f}x |")
        lines += quantized_ratios(row["results"])
        prof = row["results"].get("kiln_fp16", {}).get("layer_profile")
        if prof:
            lines += ["", "Kiln FP16 per-layer time (layer by layer, top op:tactic): " + ", ".join(
                f"{k} {v['ms']:.3f} ms ({100 * v['share']:.0f}%)" for k, v in prof.items())]
        for k, v in row["results"].items():
            slow = v.get("tactics", {}).get("slowest") if k.startswith("kiln_") and k != "kiln_fp16" else None
            if slow:
                lines += ["", f"{k} slowest layers (the builder's timing of the chosen tactic): " + "; ".join(
                    f"{x['layer']} {x['weights']}{' s' + str(x['strides'][0]) if x['strides'] else ''} "
                    f"{x['tactic']} {1000 * x['ms']:.1f} us" for x in slow)]
        for k, v in row["results"].items():
            if v.get("kernel_profile"):
                kp = v["kernel_profile"]
                busy = sum(x["ms"] for x in kp) / max(sum(x["share"] for x in kp), 1e-9)  # all kernels, not the top
                host = (f"; with the host's part hidden a call took {v['device_ms']:.3f} ms, so the device waits "
                        f"{1000 * (v['median_ms'] - v['device_ms']):.0f} us for the host" if "device_ms" in v else "")
                if "host_us" in v:  # older result files do not record it
                    host += (f"; the call's own host time {v['host_us']:.0f} us, the garbage collector ran "
                             f"{v['gc_runs']} times in {v['runs']} timed calls")
                outside = 1000 * (v["median_ms"] - busy)
                # kernels launched with programmatic dependent launch start while the one before finishes: their
                # profiled durations include that wait and overlap, so their sum can pass the call's time
                outside = (f"{outside:.0f} us of the median outside them" if outside >= 0 else
                           "more than the median: kernels overlap, each timed with its wait for the one before")
                lines += ["", f"{k} kernels (CUDA-graph replay, per call; all kernels {busy:.3f} ms, so "
                          f"{outside}{host}): " + "; ".join(
                              f"`{x['kernel'][:60]}` x{x['calls']} {x['ms']:.3f} ms ({100 * x['share']:.0f}%)"
                              for x in kp)]
        lines += ["", "| Kiln build | cold build s | rebuild with warm timing cache s |", "|---|---|---|"]
        for k, bl in row.get("builds", {}).items():
            lines.append(f"| {k} | {bl['cold_s']:.1f} | {bl['warm_cache_s']:.1f} |")
        for k, bl in row.get("builds", {}).items():
            speed = bl.get("precision_by_speed")
            if speed:
                kept = "; ".join(f"{', '.join(x['layers'])} ({x['float_us']:.1f} us FP16 against "
                                 f"{x['quantized_us']:.1f})" for x in speed["kept_in_float"])
                lines += ["", f"kiln_{k} precision by speed ({speed['engines_built']} builds"
                          + (f"; end to end {speed['quantized_latency_us']:.0f} us all quantized, "
                             f"{speed['mixed_latency_us']:.0f} us mixed" if "mixed_latency_us" in speed else "")
                          + f"): {speed.get('result', 'every group timed faster quantized')}"
                          + (f"; kept in FP16: {kept}" if kept else "")]
        lines += ["", "| engine vs onnxruntime (CPU FP32) | max abs err | max abs ref | err / range | rel L2 | tol | "
                      "result |",
                  "|---|---|---|---|---|---|---|"]
        for k, a in row["accuracy"].items():
            lines.append(f"| {k} | {a['max_abs']:.2e} | {a['ref_max_abs']:.3g} | {a['max_err_of_range']:.2e} | "
                         f"{a['rel_l2']:.2e} | {a['tol']} | {'PASSED' if a['passed'] else 'FAILED'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--models", default="resnet50,bert-base,vit-b16")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--precisions", default="fp32,tf32,fp16,bf16")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--compile-timeout", type=int, default=240)
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--compile-modes", default="max-autotune-no-cudagraphs,reduce-overhead")
    p.add_argument("--kernel-profile", action="store_true", help="per-kernel GPU time of each Kiln engine")
    p.add_argument("--name", default=None, help="results file stem (default: GPU name)")
    p.add_argument("--max-aux-streams", default="0", help="Kiln's --maxAuxStreams; a list (0,1) builds one engine "
                   "per value, the later ones named kiln_<precision>_aux<N>")
    p.add_argument("--level", default="3", help="Kiln's builderOptimizationLevel (tactic search breadth); "
                   "a list (3,4) builds one engine per level, the later ones named kiln_<precision>_level<N>")
    p.add_argument("--precision-constraints", default="none", help="Kiln's --precisionConstraints for INT8/FP8 "
                   "engines; a list (none,obey) builds one engine per value, the later ones named "
                   "kiln_<precision>_<value>")
    args = p.parse_args(argv)
    args.precisions = args.precisions.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(argv)
    results: list = []
    stem = args.name or env["gpu"].replace("NVIDIA ", "").replace(" ", "-")
    onnx_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    for name in args.models.split(","):
        try:
            bench_model(name, [int(b) for b in args.batches.split(",")], args, results, onnx_dir)
        except Exception as e:
            import traceback

            traceback.print_exc()
            results.append({"model": name, "error": f"{type(e).__name__}: {e}"})
        ok = [r for r in results if "error" not in r]
        (out / f"{stem}.json").write_text(json.dumps({"environment": env, "results": results}, indent=2))
        (out / f"{stem}.md").write_text(to_markdown(env, ok))
    print(to_markdown(env, [r for r in results if "error" not in r]))


if __name__ == "__main__":
    main()
