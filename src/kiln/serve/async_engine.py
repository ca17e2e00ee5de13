"""The LLM engine behind an asyncio server: one background thread loops `LLMEngine.step()`.

LLMEngine is used from one thread only. Handlers on the event loop send it commands (add, abort) through a
thread-safe queue; the engine thread applies them between steps, so an abort frees the request's KV blocks
before the next step runs. Each request's outputs go back to its handler's asyncio.Queue through
`loop.call_soon_threadsafe`. An accepted request first receives `ACCEPTED` (or the KilnError that refused it),
then its RequestOutputs, the last one with `finished` set.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass

from ..errors import KilnError

ACCEPTED = object()  # sentinel: add_request validated the request


@dataclass
class EngineFailure:
    """A step raised (a bug, not the user's input): the engine dropped every request."""

    message: str


class AsyncLLMEngine:
    def __init__(self, engine, idle_poll_s: float = 0.5):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._idle_poll_s = idle_poll_s
        self._stats_lock = threading.Lock()
        self._stats = dict(engine.stats())
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="kiln-llm-engine", daemon=True)

    # --- called from the event loop -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add(self, request_id: str, prompt, params, sink: asyncio.Queue) -> None:
        self._inbox.put(("add", request_id, prompt, params, (asyncio.get_running_loop(), sink)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> dict:
        with self._stats_lock:
            return dict(self._stats)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------------------
    @staticmethod
    def _send(sink, item) -> None:
        loop, q = sink
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _apply(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, sink = cmd
            try:
                self.engine.add_request(rid, prompt, params)
            except KilnError as e:
                self._send(sink, e)
                return
            self._sinks[rid] = sink
            self._send(sink, ACCEPTED)
        elif kind == "abort":
            self._sinks.pop(cmd[1], None)
            self.engine.abort_request(cmd[1])

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self._idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # the engine already freed everything; tell every waiting handler
                    failure = EngineFailure(f"{type(e).__name__}: {e}")
                    traceback.print_exc()
                    for sink in self._sinks.values():
                        self._send(sink, failure)
                    self._sinks.clear()
                    outputs = []
                self.steps += 1
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        self._send(sink, out)
                        if out.finished:
                            del self._sinks[out.request_id]
            with self._stats_lock:
                self._stats = dict(self.engine.stats())
