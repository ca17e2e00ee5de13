"""trtexec-style timing of an execution context.

Per iteration: Enqueue Time (host time to copy inputs and launch), Latency
(host wall time from enqueue to results ready) and, on a GPU, GPU Compute Time
(CUDA events around the launch). Inputs rotate among several sets so the L2
cache does not flatter the result. With h2d=True the inputs start in (pinned)
host memory and the outputs return to it: H2D and D2H times are measured with
CUDA events apart from the compute, and Latency includes both.

time_fn times any callable feeds -> outputs (an engine, or PyTorch eager and
torch.compile baselines in `kiln bench`), so every peer is timed the same way.

A figure that is noise says so. The timed runs are split into consecutive groups
(repeats); the report gives each group's median and warns when they differ by more
than REPEAT_SPREAD_LIMIT of the overall median, or when p99 exceeds the median by
P99_OVER_MEDIAN_LIMIT (stalls: another process, a thread pool waiting for a core).
On the CPU target the runs use as many threads as there are idle physical cores
(`cpu_threads`; torch's default pool of every logical CPU stalls on a busy machine),
and the report says a CPU figure is not a GPU one. With stop_when_stable, timing
ends once the median is stable: after MIN_STABLE_RUNS runs, when adding the last
STABLE_WINDOW runs moved it by less than STABLE_MEDIAN_CHANGE.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPEATS = 5  # groups the timed runs are split into, to measure run-to-run spread
REPEAT_SPREAD_LIMIT = 0.10  # (max - min) of the groups' medians over the median
P99_OVER_MEDIAN_LIMIT = 1.5
MIN_STABLE_RUNS = 20
STABLE_WINDOW = 10
STABLE_MEDIAN_CHANGE = 0.01


class TimingNoiseWarning(UserWarning):
    """A timing whose spread makes its median unreliable."""


class EmulatedPrecisionWarning(UserWarning):
    """FP16/BF16 arithmetic on the CPU target: emulated, and much slower than FP32."""


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
    device: str = ""  # "cuda" or "cpu": where the timed runs ran
    cpu_threads: int | None = None  # torch threads the CPU runs used
    cpu_threads_reason: str = ""
    stopped_early: bool = False  # stop_when_stable ended the runs before `iterations`
    iterations_asked: int = 0

    def noise(self) -> dict:
        """Run-to-run spread of the primary time (GPU compute on a GPU, latency on the CPU) and warnings."""
        xs = self.gpu_ms or self.latency_ms
        out = {"measure": "gpu_compute" if self.gpu_ms else "latency", "warnings": []}
        if len(xs) < 2:
            return out
        med = statistics.median(xs)
        p99 = percentile(xs, 99)
        out["p99_over_median"] = p99 / med if med > 0 else math.inf
        if len(xs) >= 2 * REPEATS:
            size = len(xs) // REPEATS
            medians = [statistics.median(xs[i * size:(i + 1) * size]) for i in range(REPEATS)]
            out["repeat_medians_ms"] = medians
            out["repeat_spread"] = (max(medians) - min(medians)) / med if med > 0 else math.inf
        what = "GPU compute time" if self.gpu_ms else "latency"
        if out["p99_over_median"] > P99_OVER_MEDIAN_LIMIT:
            out["warnings"].append(
                f"noisy timing: {what} p99 {p99:.4g} ms is {out['p99_over_median']:.1f}x the median {med:.4g} ms "
                f"(limit {P99_OVER_MEDIAN_LIMIT:g}x): some runs stalled (other processes on the machine, "
                f"{'a thread pool waiting for cores' if not self.gpu_ms else 'host interruptions'}). "
                "Treat the median as approximate; time on a quiet machine, or longer (--duration).")
        if out.get("repeat_spread", 0) > REPEAT_SPREAD_LIMIT:
            meds = ", ".join(f"{m:.4g}" for m in out["repeat_medians_ms"])
            out["warnings"].append(
                f"noisy timing: the medians of {REPEATS} consecutive groups of runs differ by "
                f"{out['repeat_spread']:.0%} of the median (limit {REPEAT_SPREAD_LIMIT:.0%}): {meds} ms. "
                "The machine's speed changed while timing; one figure is not reproducible to better than that.")
        return out

    def to_json(self) -> dict:
        d = {
            "iterations": len(self.latency_ms),
            "throughput_qps": len(self.latency_ms) / self.wall_s if self.wall_s else None,
            "latency_ms": summarize(self.latency_ms),
            "enqueue_ms": summarize(self.enqueue_ms),
            "noise": self.noise(),
            "device": self.device, "cpu_threads": self.cpu_threads, "stopped_early": self.stopped_early,
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
                 duration_s: float = 0.0, h2d: bool = False, stop_when_stable: bool = False,
                 warn_emulated: bool = True) -> Timings:
    """Run until both `iterations` runs and `duration_s` seconds are done (after warm-up); with
    stop_when_stable, `iterations` is a most and the runs end once the median is stable.
    warn_emulated: warn first when FP16/BF16 runs on the CPU (a caller that said so already passes False)."""
    if warn_emulated:
        warn_if_emulated(ctx.engine.precision, ctx.device)
    return time_fn(lambda feeds: ctx.run(feeds, copy_outputs=False), input_sets, ctx.device,
                   iterations=iterations, warmup_ms=warmup_ms, duration_s=duration_s, h2d=h2d,
                   stop_when_stable=stop_when_stable)


def emulation_note(precision: str, device) -> str | None:
    """The warning for FP16/BF16 arithmetic on the CPU, or None."""
    if torch.device(device).type != "cpu" or precision not in ("float16", "bfloat16", "fp16", "bf16"):
        return None
    name = "FP16" if precision in ("float16", "fp16") else "BF16"
    return (f"{name} on the CPU target is emulated: most CPUs have no {name} arithmetic, so each layer converts "
            f"and runs much slower than FP32 (a large model can take seconds per call). It shows accuracy, "
            f"not speed; build FP32 for CPU timings, and time {name} on the GPU.")


def warn_if_emulated(precision: str, device) -> None:
    note = emulation_note(precision, device)
    if note:
        warnings.warn(note, EmulatedPrecisionWarning, stacklevel=3)


def _physical_cores(cpus: set[int]) -> int:
    """Physical cores among the logical CPUs `cpus` (hyperthread siblings count once)."""
    cores = set()
    for c in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(c))
    return max(1, len(cores))


def cpu_threads() -> tuple[int, str]:
    """(threads, why): the physical cores this process may use, less those busy with other work
    (the 1-minute load average beyond this process's own one), at least 1."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        cpus = set(range(os.cpu_count() or 1))
    cores = _physical_cores(cpus)
    try:
        busy = max(0, round(os.getloadavg()[0] - 1))
    except OSError:
        busy = 0
    n = max(1, min(cores, len(cpus)) - busy)
    why = (f"{cores} physical core(s) of {len(cpus)} CPU(s) available"
           + (f", about {busy} busy with other work (load average)" if busy else ""))
    return n, why


@contextlib.contextmanager
def _threads(n: int | None):
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _stable(xs: list[float]) -> bool:
    """The median of all runs moved less than STABLE_MEDIAN_CHANGE when the last window was added (the
    median resists stalls; the noise warnings still report them)."""
    if len(xs) < MIN_STABLE_RUNS or len(xs) % STABLE_WINDOW:
        return False
    now, before = statistics.median(xs), statistics.median(xs[:-STABLE_WINDOW])
    return now > 0 and abs(now - before) / now < STABLE_MEDIAN_CHANGE


def time_fn(fn, input_sets: list[dict], device, iterations: int = 100, warmup_ms: float = 200.0,
            duration_s: float = 0.0, h2d: bool = False, stop_when_stable: bool = False,
            threads: int | None = None) -> Timings:
    """Time fn(feeds) trtexec-style. input_sets are on `device`, or on the host when h2d=True.
    On the CPU, torch runs with `threads` threads (default `cpu_threads()`) while timing."""
    device = torch.device(device)
    why = ""
    if device.type == "cpu" and threads is None:
        threads, why = cpu_threads()
    with _threads(threads if device.type == "cpu" else None):
        t = _time(fn, input_sets, device, iterations, warmup_ms, duration_s, h2d, stop_when_stable)
    t.device, t.iterations_asked = device.type, iterations
    if device.type == "cpu":
        t.cpu_threads, t.cpu_threads_reason = threads, why or "as asked"
    for w in t.noise()["warnings"]:
        warnings.warn(w, TimingNoiseWarning, stacklevel=2)
    return t


def _time(fn, input_sets, device, iterations, warmup_ms, duration_s, h2d, stop_when_stable) -> Timings:
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
        if (stop_when_stable and n < iterations and time.perf_counter() - start >= duration_s
                and _stable(t.gpu_ms or t.latency_ms)):
            t.stopped_early = True
            break
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
    console.print(f"Total Host Walltime: {t.wall_s:.3f} s, iterations: {j['iterations']}"
                  + (f" (stopped early of {t.iterations_asked}: the median moved less than "
                     f"{STABLE_MEDIAN_CHANGE:.0%} over the last {STABLE_WINDOW} runs)" if t.stopped_early else ""))
    noise = j["noise"]
    if "repeat_medians_ms" in noise:
        meds = ", ".join(f"{m:.4f}" for m in noise["repeat_medians_ms"])
        console.print(f"Run-to-run spread: medians of {REPEATS} consecutive groups {meds} ms "
                      f"({noise['repeat_spread']:.1%} of the median); p99/median {noise['p99_over_median']:.2f}")
    if t.device == "cpu":
        console.print(f"Note: measured on the CPU with {t.cpu_threads} thread(s) ({t.cpu_threads_reason}): a CPU "
                      "figure from the reference kernels, not a latency on any GPU.")
