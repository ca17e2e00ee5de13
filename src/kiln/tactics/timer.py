"""Timing one layer's candidate on the GPU: CUDA events, warm-up, median.

Engines replay CUDA graphs, so a candidate is timed the same way: CALLS_PER_GRAPH
calls are captured into one graph and each replay's time is divided by that count.
Timing one Python call per event pair would charge each candidate its host launch
cost (tens of microseconds through torch, more for a Triton launch), which decides
the race at batch 1 although the engine never pays it. A candidate that cannot be
captured (it synchronizes with the host, say) is timed call by call instead.
"""

from __future__ import annotations

import statistics

import torch

CALLS_PER_GRAPH = 10


def _median(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def synchronizes(fn) -> bool:
    """Whether fn makes a synchronizing CUDA call (.item(), a blocking copy): such a call would abort a
    capture, and an aborted capture leaves torch's CUDA random generator unusable for the process."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _capture(fn) -> torch.cuda.CUDAGraph | None:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(CALLS_PER_GRAPH):
                fn()
    except Exception:  # not capturable: the caller times it call by call
        torch.cuda.synchronize()
        return None
    return graph


def median_ms(fn, warmup: int = 3, runs: int = 10, may_sync: bool = True) -> float:
    """may_sync=False: the caller has checked that fn does not synchronize (see synchronizes)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = None if may_sync and synchronizes(fn) else _capture(fn)
    if graph is None:
        return _median(fn, runs)
    graph.replay()  # first replay uploads the graph
    return _median(graph.replay, runs) / CALLS_PER_GRAPH
