"""Compiling the layers' Triton/Gluon candidates before any is timed, in parallel threads.

A Triton or Gluon tactic compiles its kernels on its first call; a cold 8-bit build spent most of its time
there, one candidate after another. Triton's compiler spends most of its time outside the GIL (MLIR passes,
LLVM, ptxas), so threads compile side by side: every candidate of every layer the timing loop will measure.

The selector runs the engine once before timing (Selector.ahead): each such layer hands its inputs and JIT
candidates to this pool, which calls each candidate once on a side stream (the first call compiles) and drops
the inputs when done. The timing run starts once every compile has finished (finish): compiling threads would
hold the GIL between a timing's CUDA events and its graph replay, and the timings would read host gaps. It then
finds every kernel compiled. A candidate that raises here raises again in the timing loop, which records why;
nothing done here decides a timing.

Identical kernels: Triton keeps each compiled kernel, so a tactic called again with the same specialization
compiles nothing; two layers that compile the same kernel at once, in two threads, would both compile it. So one
tactic's first calls on layers of one `family` (same op, attributes, weights and input types: one layer at the
batch of each profile, or at two spatial sizes) never overlap: the second finds the first's kernel. Layers of
other families rarely share a kernel, and their compiles run side by side.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

# Held inputs of layers whose compiles are still queued, at most this share of the device's memory: the ahead
# run waits for the oldest layers' compiles beyond it (a large model's activations need not all be alive).
HELD_SHARE = 0.1
PROGRESS_S = 2.0


class CompileAhead:
    """A pool of `threads` threads compiling layers' JIT candidates on `device`."""

    def __init__(self, threads: int, device: torch.device):
        self.threads, self.device = threads, device
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kiln-compile")
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._streams = threading.local()
        self._pending: dict[str, list[Future]] = {}  # layer key -> its candidates' first calls
        self._held: dict[str, int] = {}  # layer key -> bytes of activation inputs kept alive for them
        self._count = threading.Lock()
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
        self._budget = HELD_SHARE * free
        self.queued = 0  # candidate first calls queued
        self.calls = 0  # ...and made
        self.failed = 0  # ...of which raised (the timing loop records why)

    def submit(self, key: str, node, args: list, tactics: list, activations: list[torch.Tensor],
               family: str = "") -> None:
        """Call each of `tactics` once on `args` (the layer's inputs as the timing loop will see them), in the
        pool. The inputs were written on the current stream: the side streams wait for them. `activations`: the
        inputs that are not weights (their bytes count against the budget); `family`: see the module doc."""
        if key in self._pending or not tactics:
            return
        held = sum(t.numel() * t.element_size() for t in activations)
        while self._held and sum(self._held.values()) + held > self._budget:
            self._settle(next(iter(self._held)))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._held[key] = held
        self.queued += len(tactics)
        self._pending[key] = [self._pool.submit(self._first_call, t, node, args, ready, family)
                              for t in tactics]

    def finish(self, progress=None) -> None:
        """Wait for every queued first call, and end the threads. progress(done, queued), if given, is called
        every PROGRESS_S while waiting, when more are done (a long compile shows it is moving)."""
        futures, shown = [f for fs in self._pending.values() for f in fs], -1
        while progress is not None and futures:
            if self.calls != shown:
                shown = self.calls
                progress(shown, self.queued)
            futures = list(wait(futures, timeout=PROGRESS_S).not_done)
        for key in list(self._pending):
            self._settle(key)
        self._pool.shutdown(wait=True)

    def _settle(self, key: str) -> None:
        for f in self._pending.pop(key, []):
            f.result()
        self._held.pop(key, None)

    def _stream(self) -> torch.cuda.Stream:
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        return stream

    def _first_call(self, tactic, node, args, ready: torch.cuda.Event, family: str) -> None:
        failed = 0
        with self._locks.setdefault((tactic.name, family), threading.Lock()):
            try:
                stream = self._stream()
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    try:
                        tactic.fn(node, *args)
                    except Exception:  # noqa: BLE001  (the timing loop calls it again and records the failure)
                        failed = 1
                    done = torch.cuda.Event()
                    done.record(stream)
                # Polled, not synchronized: the inputs stay alive until the launches end, and no call here may
                # synchronize (the timing loop's check, tactics/timer.synchronizes, makes that an error).
                while not done.query():
                    time.sleep(0.0005)
            except Exception:  # noqa: BLE001  (a stream or event that failed: the timing loop compiles it)
                failed = 1
        with self._count:
            self.calls += 1
            self.failed += failed
