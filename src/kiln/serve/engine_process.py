"""The LLM engine in a child process of the server, as vLLM's engine core runs beside its API server.

In one process the engine's Python work (scheduling, sampling, detokenizing) and the event loop's (HTTP, JSON,
socket writes) take turns on the interpreter lock, so every token the server streams lengthens the next
step. Here the child owns the LLMEngine and steps it without pause; the server process parses requests,
admits them and writes the streams. They talk over pipes in length-prefixed frames of `marshal` data (plain
tuples, lists, strings and numbers; the pipes join the child only to the server's own processes):

    server -> engine   ("add", rid, prompt_ids, sampling fields) | ("abort", rid) | ("stop",)
    engine -> server   ("info", {...}) once loaded, or ("error", KilnError class name, message)
                       ("step", accepted rids, [(rid, message, kind)] refused, tokens, deltas, stats, failure)

With --api-servers N the child has N pairs of pipes, one per HTTP process (kiln/serve/api_servers.py): every
process's requests are scheduled together in the one engine, and each step's frame to a process carries only
that process's streams. A refusal's kind is "input" (the request is wrong: 400) or "full" (the engine holds
max_num_seqs + max_waiting requests of all the processes together: 429).

One "step" frame carries everything a step produced for a process's streams (tokens and deltas: kiln/serve/
step_frames.py, decoded here into async_engine.py's Deltas) and is read by the event loop in one callback. The
child makes no text for requests without stop strings (SamplingParams.detokenize False): their token ids cross
the pipe and the HTTP process detokenizes each step's in one batched decode (kiln/serve/detokenize.py), so the
step loop that bounds the throughput does no string work. The requests of a process whose pipe closes are
aborted; the child exits when told to stop or when every server process's pipe has closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import gc
import json
import marshal
import os
import select
import signal
import struct
import subprocess
import sys
import time
import traceback

from .. import errors
from . import cpu_placement, step_profile
from .async_engine import (
    ACCEPTED,
    REFUSED_FULL,
    REFUSED_INPUT,
    EngineFailure,
    EngineInfo,
    QueueFull,
)
from .detokenize import StreamDetokenizer
from .step_frames import StepDecoder, StepEncoder

_HEADER = struct.Struct("<I")
_PIPE_BYTES = 1 << 20  # so a step's frame or a burst of adds rarely waits for the reader


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, 1031, _PIPE_BYTES)  # F_SETPIPE_SZ (Linux); elsewhere the default size serves
    except OSError:
        pass


def write_frame(fd: int, payload: bytes) -> None:
    """Blocking write of one frame."""
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Splits a byte stream into frames."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        frames, pos, size = [], 0, len(buf)
        while size - pos >= 4:
            (n,) = _HEADER.unpack_from(buf, pos)
            if size - pos - 4 < n:
                break
            frames.append(bytes(buf[pos + 4:pos + 4 + n]))
            pos += 4 + n
        del buf[:pos]
        return frames


def _read_frame_blocking(fd: int, reader: FrameReader, pending: list) -> bytes | None:
    while not pending:
        data = os.read(fd, 1 << 20)
        if not data:
            return None
        pending += reader.feed(data)
    return pending.pop(0)


# --- the server's side --------------------------------------------------------------------------------------
def _tokenizer_state(tok) -> dict:
    # The child's Tokenizer rebuilt in the server: its `tokenizers` object (as JSON) and what the constructor
    # takes. _tok and _prepend_bos are kiln.llm.tokenizer.Tokenizer's own fields.
    return {"json": tok._tok.to_str(), "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "eos_token_ids": sorted(tok.eos_token_ids), "chat_template": tok.chat_template,
            "prepend_bos": tok._prepend_bos, "source": tok.source}


def _tokenizer_from(state: dict):
    from tokenizers import Tokenizer as HFTokenizer

    from ..llm.tokenizer import Tokenizer

    return Tokenizer(HFTokenizer.from_str(state["json"]), bos_token=state["bos_token"],
                     eos_tokens=[state["eos_token"]] if state["eos_token"] else [],
                     eos_token_ids=state["eos_token_ids"], chat_template=state["chat_template"],
                     add_bos_token=state["prepend_bos"], source=state["source"])


class EngineChannel:
    """One HTTP process's end of the engine child: the AsyncLLMEngine interface over a pair of pipes (to_engine,
    from_engine). `connect()` waits for the child's info frame; the server's first process gets its channel from
    EngineProcess, the others (kiln/serve/api_servers.py) build theirs on the pipes they were handed."""

    def __init__(self, to_engine: int, from_engine: int):
        self._to_child, self._from_child = to_engine, from_engine
        self._reader = FrameReader()
        self._early: list = []  # frames that came with the info one (none: the child waits for requests)
        self.info: EngineInfo | None = None
        self._sinks: dict = {}
        self._out = bytearray()  # frames for the child that its pipe did not take yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._alive = True
        self._death = ""
        self._stopped = False

    def connect(self, model: str = "the model") -> None:
        """Blocks until the engine is loaded; raises the load's KilnError (or ModelError if the child died)."""
        frame = _read_frame_blocking(self._from_child, self._reader, self._early)
        if frame is None:
            raise errors.ModelError(f"{model}: the engine process exited{self._exit_status()} before the model "
                                    "was loaded; its error is printed above.")
        msg = marshal.loads(frame)
        if msg[0] == "error":
            cls = getattr(errors, msg[1], None)
            raise (cls if isinstance(cls, type) and issubclass(cls, errors.KilnError) else errors.KilnError)(msg[2])
        info = msg[1]
        self.info = EngineInfo(info["model_name"], _tokenizer_from(info["tokenizer"]), info["vocab_size"],
                               info["max_model_len"], info["max_num_seqs"], info["device"], info["num_kv_blocks"],
                               info["block_size"])
        self._text = StreamDetokenizer(self.info.tokenizer)  # the text of requests the child does not detokenize
        self._frames = StepDecoder()
        self._stats = info["stats"]

    def _exit_status(self) -> str:
        return ""  # the child is the first process's: only it can reap it

    def start(self) -> None:
        """On the event loop that serves: read the child's frames as they arrive, write without blocking."""
        self._loop = asyncio.get_running_loop()
        os.set_blocking(self._from_child, False)
        os.set_blocking(self._to_child, False)
        self._loop.add_reader(self._from_child, self._on_readable)
        for frame in self._early:
            self._handle(marshal.loads(frame))

    def is_alive(self) -> bool:
        return self._alive

    def stats(self) -> dict:
        return self._stats

    def add(self, request_id: str, prompt, params, sink) -> None:
        if not self._alive:
            sink.put(EngineFailure(self._death))
            return
        self._sinks[request_id] = sink
        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "extra"}
        if params.detokenize and not params.stop:  # the text is made here; stop strings need it in the child
            fields["detokenize"] = False
            self._text.open(request_id, prompt, params.skip_special_tokens)
        prompt = list(prompt)
        self._frames.expect(request_id, prompt)
        self._send(("add", request_id, prompt, fields))

    def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self._text.close(request_id)
            self._frames.forget(request_id)
            self._send(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        """Close this process's pipes (idempotent): the child aborts what this process left running."""
        if self._stopped:
            return
        self._stopped = True
        self._detach()
        self._flush_blocking()
        self._close()

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._from_child)
            self._loop.remove_writer(self._to_child)
        os.set_blocking(self._to_child, True)

    def _flush_blocking(self, *frames: bytes) -> None:
        try:
            if self._out:
                write_frame_raw(self._to_child, bytes(self._out))
                self._out.clear()
            for payload in frames:
                write_frame(self._to_child, payload)
        except OSError:
            pass

    def _close(self) -> None:
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass

    # --- pipe I/O on the event loop -----------------------------------------------------------------------
    def _send(self, msg) -> None:
        payload = marshal.dumps(msg)
        frame = _HEADER.pack(len(payload)) + payload
        if self._out:  # earlier frames wait for the pipe: keep the order
            self._out += frame
            return
        try:
            n = os.write(self._to_child, frame)
        except BlockingIOError:
            n = 0
        except OSError:  # the child is gone; its pipe's reader reports it
            return
        if n < len(frame):
            self._out += frame[n:]
            self._loop.add_writer(self._to_child, self._on_writable)

    def _on_writable(self) -> None:
        try:
            n = os.write(self._to_child, self._out)
        except BlockingIOError:
            return
        except OSError:
            n = len(self._out)
        del self._out[:n]
        if not self._out:
            self._loop.remove_writer(self._to_child)

    def _on_readable(self) -> None:
        try:
            data = os.read(self._from_child, 1 << 22)
        except BlockingIOError:
            return
        if not data:  # the child died: every waiting handler gets the failure
            self._loop.remove_reader(self._from_child)
            self._alive = False
            self._death = f"the engine process exited{self._exit_status()}; restart the server"
            print(f"kiln llm serve: {self._death}.", file=sys.stderr, flush=True)
            failure = EngineFailure(self._death)
            for rid, sink in self._sinks.items():
                sink.put(failure)
                self._text.close(rid)
                self._frames.forget(rid)
            self._sinks.clear()
            return
        for frame in self._reader.feed(data):
            self._handle(marshal.loads(frame))

    def _handle(self, msg) -> None:
        _, accepted, refused, tokens, deltas, stats, failure = msg
        sinks = self._sinks
        for rid in accepted:
            sink = sinks.get(rid)
            if sink is not None:
                sink.put(ACCEPTED)
        for rid, message, kind in refused:
            self._text.close(rid)
            self._frames.forget(rid)
            sink = sinks.pop(rid, None)
            if sink is not None:
                sink.put(QueueFull(message) if kind == REFUSED_FULL else errors.InputError(message))
        text = self._text
        for delta in self._frames.decode(tokens, text.fill(deltas), text.texts(*tokens)):
            sink = sinks.get(delta[0])
            if sink is not None:
                sink.put(delta)
                if delta[2]:  # finished
                    del sinks[delta[0]]
        if failure is not None:
            failure = EngineFailure(failure)
            for rid, sink in sinks.items():
                sink.put(failure)
                self._text.close(rid)
                self._frames.forget(rid)
            sinks.clear()
        self._stats = stats


class EngineProcess(EngineChannel):
    """The server's handle of the engine child: `EngineProcess(model, engine_kwargs)` starts it and waits
    until the model is loaded (a KilnError of the load is raised here); then the AsyncLLMEngine interface, as
    the channel of the server's first HTTP process."""

    def __init__(self, model: str, engine_kwargs: dict, verify_key: bytes | None = None,
                 step_profile: str | None = None, engine_cpu: str | None = None, *, api_servers: int = 1,
                 max_waiting: int | None = None, on_spawn=None):
        """step_profile: a file the child writes its engine steps' timings to at exit (StepProfile.save).
        engine_cpu: kiln/serve/cpu_placement.py's spec (auto, none, a CPU): the child's step loop on a core of
        its own, this process on the other CPUs.
        api_servers: HTTP processes the child serves; the pipes of all but this one are handed to
        on_spawn([(to_engine, from_engine), ...]) once the child runs (while it loads), then closed here.
        max_waiting: the child refuses ("full") a request past max_num_seqs + max_waiting of all processes."""
        self.placement = cpu_placement.placement(engine_cpu)
        child_fds, ours = [], []
        for _ in range(api_servers):
            to_child_r, to_child_w = os.pipe()
            from_child_r, from_child_w = os.pipe()
            for fd in (to_child_w, from_child_w):
                _grow_pipe(fd)
            child_fds += [to_child_r, from_child_w]
            ours.append((to_child_w, from_child_r))
        super().__init__(*ours[0])
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.serve.engine_process", *map(str, child_fds)],
                                     pass_fds=child_fds, env=env)
        for fd in child_fds:
            os.close(fd)
        config = {"model": str(model), "kwargs": engine_kwargs, "verify_key": verify_key.hex() if verify_key else None,
                  "step_profile": step_profile, "max_waiting": max_waiting,
                  "engine_cpus": sorted(self.placement[0]) if self.placement else None}
        write_frame(self._to_child, json.dumps(config).encode())
        try:
            if on_spawn is not None and len(ours) > 1:
                on_spawn(ours[1:])
        finally:
            for pair in ours[1:]:
                for fd in pair:
                    os.close(fd)
        try:
            self.connect(str(model))
        except errors.KilnError:
            self.proc.wait()
            raise
        if self.placement:  # the child pinned its step loop after loading; this process keeps off that core
            cpu_placement.pin(self.placement[1])

    def _exit_status(self) -> str:
        try:
            return f" (status {self.proc.wait(1)})"
        except subprocess.TimeoutExpired:
            return ""

    def is_alive(self) -> bool:
        return self._alive and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the child to stop and reap it (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._detach()
        self._flush_blocking(marshal.dumps(("stop",)))
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._close()


def write_frame_raw(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# --- the engine's side (the child) --------------------------------------------------------------------------
_STATS_EVERY_S = 0.02  # with several HTTP processes: the longest one without news goes without the engine's stats


class _Outbox:
    """The step frames, written without blocking: what the pipe does not take now waits here and goes out with
    the next frame, so a slow reader never stops the stepping (and no second thread contends for the lock)."""

    def __init__(self, fd: int):
        self.fd, self.pending, self.closed = fd, bytearray(), False
        os.set_blocking(fd, False)

    def put(self, payload: bytes) -> None:
        self.pending += _HEADER.pack(len(payload)) + payload
        self.flush()

    def flush(self) -> None:
        if self.pending:
            try:
                del self.pending[:os.write(self.fd, self.pending)]
            except BlockingIOError:
                pass
            except OSError:  # the reader is gone (EPIPE): nothing more goes to it
                self.pending.clear()
                self.closed = True


class _Client:
    """One HTTP process as the engine sees it: its pipes, and what this turn of the loop owes it."""

    __slots__ = ("accepted", "fd_in", "heard", "index", "outbox", "reader", "refused", "sent_at")

    def __init__(self, index: int, fd_in: int, fd_out: int):
        self.index, self.fd_in, self.reader, self.outbox = index, fd_in, FrameReader(), _Outbox(fd_out)
        self.accepted: list = []
        self.refused: list = []
        self.heard = False  # it sent commands this turn
        self.sent_at = 0.0


def _serve_engine(engine, clients: list[_Client], profile_path: str | None = None,
                  max_waiting: int | None = None) -> None:
    # After "stop" the server reads no more: what its pipe does not take is dropped.
    profile = step_profile.StepProfile(engine)
    try:
        _engine_loop(engine, clients, max_waiting)
    finally:
        print(f"kiln llm serve: engine steps: {step_profile.summary(profile.records)}", file=sys.stderr, flush=True)
        if profile_path:
            profile.save(profile_path)


def _engine_loop(engine, clients: list[_Client], max_waiting: int | None = None) -> None:
    from ..llm.sampling import SamplingParams

    streams = StepEncoder(engine, len(clients))
    bound = None if max_waiting is None else engine.scheduler.max_num_seqs + max_waiting
    live = {c.fd_in: c for c in clients}
    by_out = {c.outbox.fd: c for c in clients}
    single = len(clients) == 1  # its one process gets a frame every turn, as it always did
    stop = False

    def apply(msg, client: _Client) -> bool:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, fields = msg
            if bound is not None and len(streams) >= bound:
                full = f"the server's queue is full ({len(streams)} requests admitted, at most {bound}); retry later."
                client.refused.append((rid, full, REFUSED_FULL))
                return True
            try:
                engine.add_request(rid, prompt, SamplingParams(**{**fields,
                                                                  "output_kind": streams.output_kind(fields)}))
            except errors.KilnError as e:
                client.refused.append((rid, str(e), REFUSED_INPUT))
                return True
            streams.add(rid, fields, client.index)
            client.accepted.append(rid)
        elif kind == "abort":
            if msg[1] in streams:
                streams.forget(msg[1])
                engine.abort_request(msg[1])
        elif kind == "stop":
            return False
        return True

    def drop(client: _Client) -> None:  # its process is gone: its requests' blocks go back now
        live.pop(client.fd_in, None)
        by_out.pop(client.outbox.fd, None)
        for rid in streams.owned_by(client.index):
            streams.forget(rid)
            engine.abort_request(rid)
        for fd in (client.fd_in, client.outbox.fd):
            try:
                os.close(fd)
            except OSError:
                pass

    clock = time.perf_counter
    spent = {"idle": 0.0, "commands": 0.0, "step": 0.0, "deltas": 0.0, "send": 0.0}
    steps = 0
    nothing = [((), ()), []]
    while not stop and live:
        busy = engine.has_unfinished_requests()
        t0 = clock()
        ready, writable, _ = select.select(list(live), [fd for fd, c in by_out.items() if c.outbox.pending], [],
                                           0 if busy else 0.5)
        for fd in writable:
            by_out[fd].outbox.flush()
        t1 = clock()
        spent["idle"] += t1 - t0
        for fd in ready:
            client = live[fd]
            data = os.read(fd, 1 << 20)
            if not data:  # that server process is gone
                drop(client)
                continue
            client.heard = True
            for frame in client.reader.feed(data):
                if not apply(marshal.loads(frame), client):
                    stop = True
        t2 = clock()
        spent["commands"] += t2 - t1
        parts, failure = None, None
        if not stop and engine.has_unfinished_requests():
            steps += 1
            try:
                outputs = engine.step()
            except Exception as e:  # the engine already freed everything
                traceback.print_exc()
                failure = f"{type(e).__name__}: {e}"
                streams.clear()
                outputs = []
            t3 = clock()
            spent["step"] += t3 - t2
            parts = streams.encode(outputs)
            t2 = clock()
            spent["deltas"] += t2 - t3
        elif not ready and not stop:
            continue  # idle: nothing new to say
        stats = engine.stats()
        idle = not engine.has_unfinished_requests()  # then every process gets the final numbers
        for client in list(live.values()):
            tokens, deltas = parts[client.index] if parts is not None else nothing
            if (single or client.heard or tokens[0] or deltas or failure is not None or idle
                    or t2 - client.sent_at >= _STATS_EVERY_S):
                client.outbox.put(marshal.dumps(("step", client.accepted, client.refused, tokens, deltas, stats,
                                                 failure)))
                client.accepted, client.refused, client.sent_at = [], [], t2
                if client.outbox.closed:
                    drop(client)
            client.heard = False
        spent["send"] += clock() - t2
    # Where the engine process's time went: a server that keeps the engine busy shows little idle time.
    total = sum(spent.values()) or 1.0
    print(f"kiln llm serve: engine process: {steps} steps; " + ", ".join(
        f"{k} {v:.2f} s ({v / total:.0%})" for k, v in spent.items()), file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    # Ctrl-C, or a SIGTERM sent to the whole group (timeout(1), systemd), reaches us too: the server's processes
    # drain, then the first stops us (or their pipes close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fds = [int(x) for x in argv]
    pairs = list(zip(fds[0::2], fds[1::2]))  # (commands in, frames out) of each HTTP process, the first's first
    frame = _read_frame_blocking(pairs[0][0], FrameReader(), [])
    if frame is None:
        return 0
    config = json.loads(frame)
    try:
        from ..llm.engine import LLMEngine
        from ..llm.engine_file import require_signed

        key = bytes.fromhex(config["verify_key"]) if config.get("verify_key") else None
        require_signed(config["model"], key)  # pins the checked engine for the load below, in this process
        engine = LLMEngine.from_model(config["model"], **config["kwargs"])
    except errors.KilnError as e:
        for _, fd_out in pairs:
            try:
                write_frame(fd_out, marshal.dumps(("error", type(e).__name__, str(e))))
            except OSError:
                pass
        return 2
    facts = EngineInfo.of(engine)
    info = {f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)}
    info["tokenizer"] = _tokenizer_state(engine.tokenizer)
    info["stats"] = engine.stats()
    runner = engine.runner
    if runner.graphs or runner.graph_error:  # what its decode-only steps replay, and its torch threads
        import torch

        print(f"kiln llm serve: engine process: {torch.get_num_threads()} torch threads, CUDA graphs for decode "
              f"batches {sorted(runner.graphs)}" + (f"; capture failed: {runner.graph_error}" if runner.graph_error
                                                    else ""), file=sys.stderr, flush=True)
    # What the load left (torch's modules, the model, the tokenizer) lives until exit: out of the collector's sight,
    # a full collection during serving scans only what serving made, not a few hundred thousand startup objects.
    gc.collect()
    gc.freeze()
    if config.get("engine_cpus"):  # the step loop's thread only: threads started by the load keep their CPUs
        cpu_placement.pin(set(config["engine_cpus"]))
    payload = marshal.dumps(("info", info))
    clients = []
    for fd_in, fd_out in pairs:
        try:
            write_frame(fd_out, payload)
        except OSError:  # that HTTP process died while the model loaded
            continue
        clients.append(_Client(len(clients), fd_in, fd_out))
    try:
        _serve_engine(engine, clients, config.get("step_profile"), config.get("max_waiting"))
    except BrokenPipeError:
        pass
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
