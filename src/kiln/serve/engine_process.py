"""The LLM engine in a child process of the server, as vLLM's engine core runs beside its API server.

In one process the engine's Python work (scheduling, sampling, detokenizing) and the event loop's (HTTP, JSON,
socket writes) take turns on the interpreter lock, so every token the server streams lengthens the next
step. Here the child owns the LLMEngine and steps it without pause; the server process parses requests,
admits them and writes the streams. They talk over two pipes in length-prefixed frames of `marshal` data
(plain tuples, lists, strings and numbers; the pipes join this process to its own child only):

    server -> engine   ("add", rid, prompt_ids, sampling fields) | ("abort", rid) | ("stop",)
    engine -> server   ("info", {...}) once loaded, or ("error", KilnError class name, message)
                       ("step", accepted rids, [(rid, message)] refused, tokens, deltas, stats, failure or None)

One "step" frame carries everything a step produced for every stream (tokens and deltas: kiln/serve/
step_frames.py, decoded here into async_engine.py's Deltas) and is read by the event loop in one callback. The child makes no text for requests without stop
strings (SamplingParams.detokenize False): their token ids cross the pipe and this process detokenizes each
step's in one batched decode (kiln/serve/detokenize.py), so the step loop that bounds the throughput does
no string work. The child exits when told to stop or when the server's end of the pipe closes (the server died).
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
from .async_engine import ACCEPTED, EngineFailure, EngineInfo
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


class EngineProcess:
    """The server-side handle of the engine child: `EngineProcess(model, engine_kwargs)` starts it and waits
    until the model is loaded (a KilnError of the load is raised here); then the AsyncLLMEngine interface."""

    def __init__(self, model: str, engine_kwargs: dict, verify_key: bytes | None = None,
                 step_profile: str | None = None, engine_cpu: str | None = None):
        """step_profile: a file the child writes its engine steps' timings to at exit (StepProfile.save).
        engine_cpu: kiln/serve/cpu_placement.py's spec (auto, none, a CPU): the child's step loop on a core of
        its own, this process on the other CPUs."""
        self.placement = cpu_placement.placement(engine_cpu)
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        for fd in (self._to_child, from_child_w):
            _grow_pipe(fd)
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.serve.engine_process", str(to_child_r),
                                      str(from_child_w)], pass_fds=(to_child_r, from_child_w), env=env)
        os.close(to_child_r)
        os.close(from_child_w)
        config = {"model": str(model), "kwargs": engine_kwargs, "verify_key": verify_key.hex() if verify_key else None,
                  "step_profile": step_profile,
                  "engine_cpus": sorted(self.placement[0]) if self.placement else None}
        write_frame(self._to_child, json.dumps(config).encode())
        self._reader = FrameReader()
        pending: list = []
        frame = _read_frame_blocking(self._from_child, self._reader, pending)
        if frame is None:
            self.proc.wait()
            raise errors.ModelError(f"{model}: the engine process exited (status {self.proc.returncode}) before "
                                    "the model was loaded; its error is printed above.")
        msg = marshal.loads(frame)
        if msg[0] == "error":
            self.proc.wait()
            cls = getattr(errors, msg[1], None)
            raise (cls if isinstance(cls, type) and issubclass(cls, errors.KilnError) else errors.KilnError)(msg[2])
        info = msg[1]
        if self.placement:  # the child pinned its step loop after loading; this process keeps off that core
            cpu_placement.pin(self.placement[1])
        self.info = EngineInfo(info["model_name"], _tokenizer_from(info["tokenizer"]), info["vocab_size"],
                               info["max_model_len"], info["max_num_seqs"], info["device"], info["num_kv_blocks"],
                               info["block_size"])
        self._early = pending  # frames that came with the info one (none: the child waits for requests)
        self._text = StreamDetokenizer(self.info.tokenizer)  # the text of requests the child does not detokenize
        self._frames = StepDecoder()
        self._stats = info["stats"]
        self._sinks: dict = {}
        self._out = bytearray()  # frames for the child that its pipe did not take yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._alive = True
        self._death = ""
        self._stopped = False

    def start(self) -> None:
        """On the event loop that serves: read the child's frames as they arrive, write without blocking."""
        self._loop = asyncio.get_running_loop()
        os.set_blocking(self._from_child, False)
        os.set_blocking(self._to_child, False)
        self._loop.add_reader(self._from_child, self._on_readable)
        for frame in self._early:
            self._handle(marshal.loads(frame))

    def is_alive(self) -> bool:
        return self._alive and self.proc.poll() is None

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
        """Tell the child to stop and reap it (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._from_child)
            self._loop.remove_writer(self._to_child)
            os.set_blocking(self._to_child, True)
        try:
            if self._out:
                write_frame_raw(self._to_child, bytes(self._out))
                self._out.clear()
            write_frame(self._to_child, marshal.dumps(("stop",)))
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
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
            try:
                code = self.proc.wait(1)
            except subprocess.TimeoutExpired:
                code = None
            self._death = f"the engine process exited (status {code}); restart the server"
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
        for rid, message in refused:
            self._text.close(rid)
            self._frames.forget(rid)
            sink = sinks.pop(rid, None)
            if sink is not None:
                sink.put(errors.InputError(message))
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


def write_frame_raw(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# --- the engine's side (the child) --------------------------------------------------------------------------
class _Outbox:
    """The step frames, written without blocking: what the pipe does not take now waits here and goes out with
    the next frame, so a slow reader never stops the stepping (and no second thread contends for the lock)."""

    def __init__(self, fd: int):
        self.fd, self.pending = fd, bytearray()
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


def _serve_engine(engine, fd_in: int, fd_out: int, profile_path: str | None = None) -> None:
    # After "stop" the server reads no more: what its pipe does not take is dropped.
    profile = step_profile.StepProfile(engine)
    try:
        _engine_loop(engine, fd_in, _Outbox(fd_out))
    finally:
        print(f"kiln llm serve: engine steps: {step_profile.summary(profile.records)}", file=sys.stderr, flush=True)
        if profile_path:
            profile.save(profile_path)


def _engine_loop(engine, fd_in: int, outbox: _Outbox) -> None:
    from ..llm.sampling import SamplingParams

    reader = FrameReader()
    streams = StepEncoder(engine)
    stop = False

    def apply(msg, accepted, refused) -> bool:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, fields = msg
            try:
                engine.add_request(rid, prompt, SamplingParams(**{**fields,
                                                                  "output_kind": streams.output_kind(fields)}))
            except errors.KilnError as e:
                refused.append((rid, str(e)))
                return True
            streams.add(rid, fields)
            accepted.append(rid)
        elif kind == "abort":
            if msg[1] in streams:
                streams.forget(msg[1])
                engine.abort_request(msg[1])
        elif kind == "stop":
            return False
        return True

    clock = time.perf_counter
    spent = {"idle": 0.0, "commands": 0.0, "step": 0.0, "deltas": 0.0, "send": 0.0}
    steps = 0
    while not stop:
        busy = engine.has_unfinished_requests()
        accepted, refused = [], []
        t0 = clock()
        ready, writable, _ = select.select([fd_in], [outbox.fd] if outbox.pending else [], [], 0 if busy else 0.5)
        if writable:
            outbox.flush()
        t1 = clock()
        spent["idle"] += t1 - t0
        if ready:
            data = os.read(fd_in, 1 << 20)
            if not data:  # the server is gone
                return
            for frame in reader.feed(data):
                if not apply(marshal.loads(frame), accepted, refused):
                    stop = True
        t2 = clock()
        spent["commands"] += t2 - t1
        tokens, deltas, failure = ((), ()), [], None
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
            tokens, deltas = streams.encode(outputs)
            t2 = clock()
            spent["deltas"] += t2 - t3
        elif not ready and not stop:
            continue  # idle: nothing new to say
        outbox.put(marshal.dumps(("step", accepted, refused, tokens, deltas, engine.stats(), failure)))
        spent["send"] += clock() - t2
    # Where the engine process's time went: a server that keeps the engine busy shows little idle time.
    total = sum(spent.values()) or 1.0
    print(f"kiln llm serve: engine process: {steps} steps; " + ", ".join(
        f"{k} {v:.2f} s ({v / total:.0%})" for k, v in spent.items()), file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains, then stops us
    fd_in, fd_out = int(argv[0]), int(argv[1])
    frame = _read_frame_blocking(fd_in, FrameReader(), [])
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
        write_frame(fd_out, marshal.dumps(("error", type(e).__name__, str(e))))
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
    write_frame(fd_out, marshal.dumps(("info", info)))
    try:
        _serve_engine(engine, fd_in, fd_out, config.get("step_profile"))
    except BrokenPipeError:
        pass
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
