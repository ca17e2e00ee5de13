"""trtexec-style timing of an execution context.

Per iteration: Enqueue Time (host time to copy inputs and launch), Latency
(host wall time from enqueue to results ready) and, on a GPU, GPU Compute Time
(CUDA events around the launch). Inputs rotate among several sets so the L2
cache does not flatter the result. With h2d=True the inputs start in (pinned)
host memory and the outputs return to it: H2D and D2H times are measured with
CUDA events apart from the compute, and Latency includes both.

time_fn times any callable feeds -> outputs (an engine, or PyTorch eager and
torch.compile baselines in `kiln bench`), so every peer is timed the same way.
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
    h2d_ms: list[float] = field(default_factory=list)
    d2h_ms: list[float] = field(default_factory=list)
    start_ms: list[float] = field(default_factory=list)  # each iteration's start, from the first timed one

    def to_json(self) -> dict:
        d = {
            "iterations": len(self.latency_ms),
            "throughput_qps": len(self.latency_ms) / self.wall_s if self.wall_s else None,
            "latency_ms": summarize(self.latency_ms),
            "enqueue_ms": summarize(self.enqueue_ms),
        }
        if self.gpu_ms:
            d["gpu_compute_ms"] = summarize(self.gpu_ms)
        if self.h2d_ms:
            d["h2d_ms"] = summarize(self.h2d_ms)
        if self.d2h_ms:
            d["d2h_ms"] = summarize(self.d2h_ms)
        return d

    def export_times(self) -> list[dict]:
        """Per-iteration times (trtexec's --exportTimes)."""
        rows = []
        for i, lat in enumerate(self.latency_ms):
            r = {"startMs": self.start_ms[i] if i < len(self.start_ms) else None, "latencyMs": lat,
                 "enqueueMs": self.enqueue_ms[i]}
            if self.gpu_ms:
                r["computeMs"] = self.gpu_ms[i]
            if self.h2d_ms:
                r["h2dMs"] = self.h2d_ms[i]
            if self.d2h_ms:
                r["d2hMs"] = self.d2h_ms[i]
            rows.append(r)
        return rows


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def time_context(ctx, input_sets: list[dict], iterations: int = 100, warmup_ms: float = 200.0,
                 duration_s: float = 0.0, h2d: bool = False) -> Timings:
    """Run until both `iterations` runs and `duration_s` seconds are done (after warm-up)."""
    return time_fn(lambda feeds: ctx.run(feeds, copy_outputs=False), input_sets, ctx.device,
                   iterations=iterations, warmup_ms=warmup_ms, duration_s=duration_s, h2d=h2d)


def time_fn(fn, input_sets: list[dict], device, iterations: int = 100, warmup_ms: float = 200.0,
            duration_s: float = 0.0, h2d: bool = False) -> Timings:
    """Time fn(feeds) trtexec-style. input_sets are on `device`, or on the host when h2d=True."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    h2d = h2d and cuda
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    if h2d:
        input_sets = [{k: (x.pin_memory() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x)
                       for k, x in s.items()} for s in input_sets]

    def upload(feeds):
        return {k: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x for k, x in feeds.items()}

    t_end = time.perf_counter() + warmup_ms / 1000
    i = 0
    while True:  # warm-up (also captures the CUDA graph for each shape)
        feeds = input_sets[i % len(input_sets)]
        fn(upload(feeds) if h2d else feeds)
        i += 1
        if time.perf_counter() >= t_end and i >= len(input_sets):
            break
    sync()
    t = Timings()
    start = time.perf_counter()
    n = 0
    while n < iterations or time.perf_counter() - start < duration_s:
        feeds = input_sets[n % len(input_sets)]
        if h2d:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            t0 = time.perf_counter()
            ev[0].record()
            dev_feeds = upload(feeds)
            ev[1].record()
            out = fn(dev_feeds)
            ev[2].record()
            host = [x.to("cpu", non_blocking=True) for x in _tensors(out)]
            ev[3].record()
            t1 = time.perf_counter()
            ev[3].synchronize()
            t2 = time.perf_counter()
            del host
            t.h2d_ms.append(ev[0].elapsed_time(ev[1]))
            t.gpu_ms.append(ev[1].elapsed_time(ev[2]))
            t.d2h_ms.append(ev[2].elapsed_time(ev[3]))
        elif cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            e0.record()
            fn(feeds)
            e1.record()
            t1 = time.perf_counter()
            e1.synchronize()
            t2 = time.perf_counter()
            t.gpu_ms.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            fn(feeds)
            t1 = t2 = time.perf_counter()
        t.start_ms.append((t0 - start) * 1000)
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
    console.print(f"Throughput: {j['throughput_qps']:.2f} qps "
                  f"({j['throughput_qps'] * t.batch:.1f} samples/s at batch {t.batch})")
    console.print(line("Latency", j["latency_ms"]))
    console.print(line("Enqueue Time", j["enqueue_ms"]))
    if "h2d_ms" in j:
        console.print(line("H2D Latency", j["h2d_ms"]))
    if "gpu_compute_ms" in j:
        console.print(line("GPU Compute Time", j["gpu_compute_ms"]))
    else:
        console.print("GPU Compute Time: n/a (CPU target)")
    if "d2h_ms" in j:
        console.print(line("D2H Latency", j["d2h_ms"]))
    console.print(f"Total Host Walltime: {t.wall_s:.3f} s, iterations: {j['iterations']}")
