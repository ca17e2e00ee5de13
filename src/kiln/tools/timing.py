"""trtexec-style timing of an execution context.

Per iteration: Enqueue Time (host time to copy inputs and launch), Latency
(host wall time from enqueue to results ready) and, on a GPU, GPU Compute Time
(CUDA events around the launch). Inputs rotate among several sets so the L2
cache does not flatter the result.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(xs: list[float]) -> dict:
    return {
        "min": min(xs), "max": max(xs), "mean": statistics.fmean(xs), "median": statistics.median(xs),
        "p90": percentile(xs, 90), "p95": percentile(xs, 95), "p99": percentile(xs, 99),
    }


@dataclass
class Timings:
    latency_ms: list[float] = field(default_factory=list)
    enqueue_ms: list[float] = field(default_factory=list)
    gpu_ms: list[float] = field(default_factory=list)
    batch: int = 1
    wall_s: float = 0.0

    def to_json(self) -> dict:
        d = {
            "iterations": len(self.latency_ms),
            "throughput_qps": len(self.latency_ms) / self.wall_s if self.wall_s else None,
            "latency_ms": summarize(self.latency_ms),
            "enqueue_ms": summarize(self.enqueue_ms),
        }
        if self.gpu_ms:
            d["gpu_compute_ms"] = summarize(self.gpu_ms)
        return d


def time_context(ctx, input_sets: list[dict], iterations: int = 100, warmup_ms: float = 200.0,
                 duration_s: float = 0.0) -> Timings:
    """Run until both `iterations` runs and `duration_s` seconds are done (after warm-up)."""
    cuda = ctx.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(ctx.device)) if cuda else (lambda: None)
    t_end = time.perf_counter() + warmup_ms / 1000
    i = 0
    while True:  # warm-up (also captures the CUDA graph for each shape)
        ctx.run(input_sets[i % len(input_sets)], copy_outputs=False)
        i += 1
        if time.perf_counter() >= t_end and i >= len(input_sets):
            break
    sync()
    t = Timings()
    start = time.perf_counter()
    n = 0
    while n < iterations or time.perf_counter() - start < duration_s:
        feeds = input_sets[n % len(input_sets)]
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            ctx.run(feeds, copy_outputs=False)
            e1.record()
            t1 = time.perf_counter()
            e1.synchronize()
            t2 = time.perf_counter()
            t.gpu_ms.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            ctx.run(feeds, copy_outputs=False)
            t1 = t2 = time.perf_counter()
        t.enqueue_ms.append((t1 - t0) * 1000)
        t.latency_ms.append((t2 - t0) * 1000)
        n += 1
    t.wall_s = time.perf_counter() - start
    return t


def render(t: Timings, console) -> None:
    j = t.to_json()

    def line(label, s):
        return (f"{label}: min = {s['min']:.4f} ms, max = {s['max']:.4f} ms, mean = {s['mean']:.4f} ms, "
                f"median = {s['median']:.4f} ms, percentile(90%) = {s['p90']:.4f} ms, "
                f"percentile(95%) = {s['p95']:.4f} ms, percentile(99%) = {s['p99']:.4f} ms")

    console.print("=== Performance summary ===")
    console.print(f"Throughput: {j['throughput_qps']:.2f} qps ({j['throughput_qps'] * t.batch:.1f} samples/s at batch {t.batch})")
    console.print(line("Latency", j["latency_ms"]))
    console.print(line("Enqueue Time", j["enqueue_ms"]))
    if "gpu_compute_ms" in j:
        console.print(line("GPU Compute Time", j["gpu_compute_ms"]))
    else:
        console.print("GPU Compute Time: n/a (CPU target)")
    console.print(f"Total Host Walltime: {t.wall_s:.3f} s, iterations: {j['iterations']}")
