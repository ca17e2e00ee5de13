"""Timing one layer's candidate on the GPU: CUDA events, warm-up, median.

Engines replay CUDA graphs, so a candidate is timed the same way: CALLS_PER_GRAPH
calls are captured into one graph and each replay's time is divided by that count.
Timing one Python call per event pair would charge each candidate its host launch
cost (tens of microseconds through torch, more for a Triton launch), which decides
the race at batch 1 although the engine never pays it. A candidate that cannot be
captured (it synchronizes with the host, say) is timed call by call instead.

In an engine a layer's weights were last read one inference earlier, with the rest of the network's
weights and activations passing through L2 since: at batch 32 they come from memory, while its input,
just written by the layer before, is still in L2. Calling a candidate over and over keeps its weights
in L2 and favours tiles that hide memory latency worst (see docs/design/timing.md). So the selector times
quantized layers' candidates
each after `before`, an `L2Reset`: a read of twice L2's size, then of the layer's activation inputs. The
time of `before` alone, measured the same way once per layer, is subtracted from each candidate's. (select.py
says why float layers are not.)
"""

from __future__ import annotations

import copy
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


def median_ms(fn, warmup: int = 3, runs: int = 10, may_sync: bool = True, before=None) -> float:
    """may_sync=False: the caller has checked that fn does not synchronize (see synchronizes). before: run ahead
    of every call and not counted (e.g. an L2Reset)."""
    if before is None:
        return _median_ms(fn, warmup, runs, may_sync)

    def both():
        before()
        fn()

    return max(0.0, _median_ms(both, warmup, runs, may_sync) - _own_ms(before, warmup, runs))


def _own_ms(before, warmup: int, runs: int) -> float:
    """before's own time, measured once per L2Reset (one layer's): each candidate of the layer then has the same
    amount taken off, and their ranking rests on their own timings. Measured per candidate, the reset's noise
    (its read of twice L2 takes longer than BERT's QKV GEMM) came on top of each candidate's."""
    if not isinstance(before, L2Reset):
        return _median_ms(before, warmup, runs, False)
    if before.own_ms is None:
        before.own_ms = _median_ms(before, warmup, runs, False)
    return before.own_ms


class L2Reset:
    """Puts L2 in the state an engine leaves it in for a layer: a clean read of twice its size, then a read of
    the layer's activation inputs (`keep`), so its weights come from memory and its inputs from L2."""

    def __init__(self, device: torch.device):
        size = torch.cuda.get_device_properties(device).L2_cache_size
        self._buffer = torch.ones(2 * size // 4, device=device)
        self._sink = torch.empty((), device=device)
        self._int_sink = torch.empty((), dtype=torch.int32, device=device)
        self.keep: list[torch.Tensor] = []
        self.own_ms: float | None = None  # this reset's time alone, once measured (_own_ms)

    def __call__(self):
        torch.sum(self._buffer, dim=0, out=self._sink)  # a read leaves no dirty lines to write back
        for t in self.keep:
            torch.sum(t, dim=0, dtype=torch.int32, out=self._int_sink)

    def keeping(self, tensors) -> L2Reset:
        """A reset sharing this one's buffer that re-reads these tensors' bytes afterwards (those a byte view can
        read whole)."""
        other = copy.copy(self)
        other.own_ms = None  # it reads other bytes: its own time
        # reshape first: a contiguous tensor may still have a large stride on a size-1 last axis
        other.keep = [t.reshape(-1).view(torch.uint8) for t in tensors
                      if isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() and t.numel()]
        return other


def _median_ms(fn, warmup: int, runs: int, may_sync: bool) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = None if may_sync and synchronizes(fn) else _capture(fn)
    if graph is None:
        return _median(fn, runs)
    graph.replay()  # first replay uploads the graph
    return _median(graph.replay, runs) / CALLS_PER_GRAPH
