"""Timing one layer's candidate on the GPU: CUDA events, warm-up, median."""

from __future__ import annotations

import statistics

import torch


def median_ms(fn, warmup: int = 3, runs: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)
