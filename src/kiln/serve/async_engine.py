"""What the server needs of an engine, and the in-process backend: one background thread loops `LLMEngine.step()`.

Two backends give the service (kiln/serve/service.py) the same interface: `add`, `abort`, `stats`, `start`,
`stop` and `info` (an `EngineInfo`). `AsyncLLMEngine` here runs the engine on a thread of the server's own
process (the Ray Serve replicas use it); `EngineProcess` (kiln/serve/engine_process.py) runs it in a child
process, so the engine's Python work and the HTTP work do not take turns on one interpreter lock.

Both hand out the same items: a request's `Sink` first receives `ACCEPTED` (or the KilnError that refused it),
then its `Delta`s (what each step added), the last with `finished` set; `EngineFailure` if a step raised; from
an engine process serving several HTTP processes, `QueueFull` instead of ACCEPTED past its global bound. All the
new items of one step reach the event loop in one call, not one wakeup per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
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


@dataclass
class QueueFull:
    """The engine process refused a request: it holds max_num_seqs + max_waiting requests of all the server's HTTP
    processes together (the service answers 429)."""

    message: str


REFUSED_INPUT, REFUSED_FULL = "input", "full"  # the kinds of an engine process's refusal


@dataclass
class EngineInfo:
    """The engine's facts the service parses requests against and the CLI prints."""

    model_name: str
    tokenizer: object  # kiln.llm.tokenizer.Tokenizer
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    device: str
    num_kv_blocks: int
    block_size: int

    @classmethod
    def of(cls, engine) -> EngineInfo:
        return cls(engine.model_name, engine.tokenizer, engine.model_config.vocab_size, engine.max_model_len,
                   engine.scheduler.max_num_seqs, str(engine.device), engine.block_manager.num_blocks,
                   engine.block_manager.block_size)


# A Delta is a plain tuple, so that it crosses a process boundary as data (marshal) and is cheap to build:
#   (request_id, prompt_token_ids or None (sent with the first delta only), finished, choices)
# and each choice: (index, new_text, new_token_ids, finish_reason, stop_reason, new_logprobs or None).
RID, PROMPT, FINISHED, CHOICES = range(4)
C_INDEX, C_TEXT, C_IDS, C_FINISH, C_STOP, C_LOGPROBS = range(6)


STREAMED = "delta"  # the engine's output kind for served requests: each output holds only what its step added


class DeltaMaker:
    """Turns the engine's RequestOutputs of output_kind "delta" (kiln.llm.engine) into Deltas, the prompt's
    token ids attached to a request's first."""

    def __init__(self):
        self._started: set[str] = set()  # requests that got their first delta

    def __call__(self, out) -> tuple:
        rid = out.request_id
        if rid in self._started:
            prompt = None
            if out.finished:
                self._started.discard(rid)
        else:
            prompt = out.prompt_token_ids
            if not out.finished:
                self._started.add(rid)
        return (rid, prompt, out.finished, [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
                                            for c in out.outputs])

    def forget(self, request_id: str) -> None:
        self._started.discard(request_id)


class Sink:
    """One HTTP request's inbox on the event loop: items appended by `put`, taken all at once by `take`."""

    __slots__ = ("_waiter", "items")

    def __init__(self):
        self.items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list:
        """Every item that arrived since the last take (at least one)."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


def deliver(batch: list) -> None:
    """On the event loop: one step's (sink, item) pairs into their sinks."""
    for sink, item in batch:
        sink.put(item)


class AsyncLLMEngine:
    """LLMEngine is used from its thread only. Handlers send it commands (add, abort) through a thread-safe
    queue; the thread applies them between steps, so an abort frees the request's KV blocks before the next step
    runs. Each step's new items go to the event loop in one `call_soon_threadsafe`."""

    def __init__(self, engine, idle_poll_s: float = 0.5):
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deltas = DeltaMaker()
        self._stop = threading.Event()
        self._idle_poll_s = idle_poll_s
        self._stats = dict(engine.stats())
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="kiln-llm-engine", daemon=True)

    # --- called from the event loop -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, request_id: str, prompt, params, sink: Sink) -> None:
        self._loop = asyncio.get_running_loop()
        self._inbox.put(("add", request_id, prompt, params, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> dict:
        return self._stats  # replaced whole by the engine thread, never mutated

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------------------
    def _send(self, batch: list) -> None:
        if batch and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _apply(self, cmd, batch: list) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, sink = cmd
            try:
                self.engine.add_request(rid, prompt, dataclasses.replace(params, output_kind=STREAMED))
            except KilnError as e:
                batch.append((sink, e))
                return
            self._sinks[rid] = sink
            batch.append((sink, ACCEPTED))
        elif kind == "abort":
            self._sinks.pop(cmd[1], None)
            self._deltas.forget(cmd[1])
            self.engine.abort_request(cmd[1])

    def _drain_inbox(self, block: bool, batch: list) -> None:
        try:
            cmd = self._inbox.get(timeout=self._idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd, batch)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        engine, sinks, make = self.engine, self._sinks, self._deltas
        while not self._stop.is_set():
            batch: list = []
            self._drain_inbox(not engine.has_unfinished_requests(), batch)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # the engine already freed everything; tell every waiting handler
                    failure = EngineFailure(f"{type(e).__name__}: {e}")
                    traceback.print_exc()
                    batch += [(sink, failure) for sink in sinks.values()]
                    sinks.clear()
                    outputs = []
                self.steps += 1
                for out in outputs:
                    sink = sinks.get(out.request_id)
                    if sink is None:
                        continue
                    batch.append((sink, make(out)))
                    if out.finished:
                        del sinks[out.request_id]
            self._stats = engine.stats()
            self._send(batch)
