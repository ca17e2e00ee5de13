"""OpenAI's API over the engine, independent of any HTTP framework.

`OpenAIService` parses request bodies (kiln/serve/protocol.py), admits them against a bound, submits them to
the engine (its process, kiln/serve/engine_process.py, or a thread, kiln/serve/async_engine.py), and turns the
engine's deltas into OpenAI's response JSON or its server-sent-event chunks, observing the latency metrics on
the way. Each wakeup of a stream takes every delta that arrived since the last and writes one chunk. The aiohttp server
(kiln/serve/openai_server.py) and the Ray Serve replicas (kiln/serve/ray_serve.py) are thin layers on it.

Admission is bounded: at most max_num_seqs + max_waiting engine requests at once; past that, 429 with
Retry-After, and the request reaches no model. This process counts its own; an engine process serving several
HTTP processes (--api-servers) counts theirs together and refuses past the same bound, which is then a 429 too. A stream that is closed before its end (the client went away)
aborts its engine requests, which returns their KV blocks to the pool before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

from ..errors import KilnError
from .async_engine import (
    ACCEPTED,
    C_FINISH,
    C_IDS,
    C_INDEX,
    C_LOGPROBS,
    C_TEXT,
    CHOICES,
    FINISHED,
    PROMPT,
    RID,
    AsyncLLMEngine,
    EngineFailure,
    QueueFull,
    Sink,
)
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    GenerationRequest,
    chat_logprobs,
    completion_logprobs,
    parse_chat,
    parse_completion,
)
from .protocol import usage as usage_of


@dataclass
class _Progress:
    arrival: float
    last_token: dict = field(default_factory=dict)  # engine request id -> time its last token reached us
    first_token: float | None = None


class _ChoiceState:
    """What has been streamed of one choice so far."""

    __slots__ = ("started", "text_sent", "tokens_sent")

    def __init__(self):
        self.started, self.text_sent, self.tokens_sent = False, 0, 0


def _merged(deltas: list) -> list:
    """The choices of a batch of deltas, consecutive pieces of one choice joined:
    [(rid, prompt ids or None, index, text, token ids, finish_reason, logprobs or None)] in arrival order."""
    if len(deltas) == 1 and len(deltas[0][CHOICES]) == 1:  # the common case: one step's token of one choice
        d = deltas[0]
        c = d[CHOICES][0]
        return [(d[RID], d[PROMPT], c[C_INDEX], c[C_TEXT], c[C_IDS], c[C_FINISH], c[C_LOGPROBS])]
    merged: dict = {}
    for d in deltas:
        for c in d[CHOICES]:
            key = (d[RID], c[C_INDEX])
            m = merged.get(key)
            if m is None:
                merged[key] = [d[RID], d[PROMPT], c[C_INDEX], c[C_TEXT], list(c[C_IDS]), c[C_FINISH],
                               list(c[C_LOGPROBS]) if c[C_LOGPROBS] is not None else None]
            else:
                m[1] = m[1] if m[1] is not None else d[PROMPT]
                m[3] += c[C_TEXT]
                m[4] += c[C_IDS]
                m[5] = c[C_FINISH]
                if c[C_LOGPROBS] is not None:
                    m[6] = (m[6] or []) + list(c[C_LOGPROBS])
    return [tuple(m) for m in merged.values()]


def _queue_full(message: str) -> APIError:
    return APIError(message, status=429, type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def _ints(ids) -> str:
    return "[" + ", ".join(map(str, ids)) + "]"


class OpenAIService:
    def __init__(self, engine, *, model_name: str | None = None, max_waiting: int = 1024,
                 drain_timeout: float = 30.0, metrics_dir: str | None = None):
        """engine: an LLMEngine (stepped on a thread of this process) or an EngineProcess (its own process), or
        an EngineChannel to one. metrics_dir: the metric files shared by the server's HTTP processes."""
        self.async_engine = AsyncLLMEngine(engine) if hasattr(engine, "step") else engine
        self.info = info = self.async_engine.info
        self.model_name = model_name or info.model_name
        self.metrics = ServerMetrics(self.async_engine.stats, self.model_name, metrics_dir)
        self._ttft = self.metrics.ttft.labels(self.model_name)
        self._itl = self.metrics.itl.labels(self.model_name)
        self._e2e = self.metrics.e2e.labels(self.model_name)
        self._finished = {}
        self.max_admitted = info.max_num_seqs + max_waiting
        self.admitted = 0  # engine requests admitted and not yet finished (event-loop thread only)
        self.draining = False
        self.drain_timeout = drain_timeout
        self._drained = asyncio.Event()

    def parse(self, kind: str, body) -> GenerationRequest:
        i = self.info
        parse = parse_chat if kind == "chat" else parse_completion
        return parse(body, self.model_name, i.tokenizer, i.vocab_size, i.max_model_len)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "kiln", "max_model_len": self.info.max_model_len}]}

    async def complete(self, req: GenerationRequest) -> dict:
        """The whole response body of a non-streaming request."""
        async with self._submitted(req) as (rids, sink, early, unfinished, progress):
            return await self._collect(req, rids, sink, early, unfinished, progress)

    async def open_stream(self, req: GenerationRequest) -> _SSEStream:
        """Admit and submit a streaming request; refusals raise APIError here, before any byte is sent. Returns
        an async iterator of SSE chunks (bytes); closing it early aborts the request."""
        cm = self._submitted(req)
        state = await cm.__aenter__()
        stream = _SSEStream(cm)
        stream.chunks = self._stream(req, stream, *state)
        return stream

    # --- generation ---------------------------------------------------------------------------------------
    def _admit(self, count: int) -> None:
        if self.draining:
            raise APIError("the server is shutting down and takes no new requests.", status=503,
                           type_="server_error", headers={"Retry-After": "5"})
        if self.admitted + count > self.max_admitted:
            raise _queue_full(f"the server's queue is full ({self.admitted} requests admitted, at most "
                              f"{self.max_admitted}); retry later.")
        self.admitted += count

    def _release(self, count: int) -> None:
        self.admitted -= count
        if self.draining and self.admitted == 0:
            self._drained.set()

    @contextlib.asynccontextmanager
    async def _submitted(self, req: GenerationRequest):
        rids = [f"{req.id}-{i}" for i in range(len(req.prompts))]
        self._admit(len(rids))
        sink = Sink()
        progress = _Progress(time.perf_counter())
        unfinished = set()
        try:
            for rid, ids in zip(rids, req.prompts):
                self.async_engine.add(rid, ids, req.params, sink)
                unfinished.add(rid)
            early = await self._await_acceptance(sink, len(rids))
            yield rids, sink, early, unfinished, progress
        finally:
            for rid in unfinished:  # client gone, an error, or cancelled: free the blocks now
                self.async_engine.abort(rid)
            if unfinished:
                self.metrics.aborted.labels(self.model_name).inc()
            self._release(len(rids))

    async def _await_acceptance(self, sink: Sink, count: int) -> list:
        accepted, early = 0, []
        while accepted < count:
            for item in await sink.take():
                if item is ACCEPTED:
                    accepted += 1
                elif isinstance(item, QueueFull):
                    raise _queue_full(item.message)
                elif isinstance(item, KilnError):
                    raise APIError(str(item))
                elif isinstance(item, EngineFailure):
                    raise APIError(f"the engine failed: {item.message}", status=500, type_="server_error")
                else:
                    early.append(item)  # an output of a prompt accepted before the others
        return early

    def _observe(self, items: list, unfinished: set, progress: _Progress) -> None:
        """A wakeup's Deltas of one request: the latency histograms, finish reasons, what is still running."""
        now = time.perf_counter()
        last_token = progress.last_token
        for item in items:
            if isinstance(item, EngineFailure):
                raise APIError(f"the engine failed: {item.message}", status=500, type_="server_error")
            rid = item[RID]
            last = last_token.get(rid)
            if last is None:
                if progress.first_token is None:
                    progress.first_token = now
                    self._ttft.observe(now - progress.arrival)
            else:  # one delta per step: deltas that arrived together reached the client together (0 s)
                self._itl.observe(now - last)
            last_token[rid] = now
            for c in item[CHOICES]:
                if c[C_FINISH] is not None:
                    self._count_finished(c[C_FINISH])
            if item[FINISHED]:
                unfinished.discard(rid)
        if not unfinished:
            self._e2e.observe(now - progress.arrival)

    def _count_finished(self, reason: str) -> None:
        counter = self._finished.get(reason)
        if counter is None:
            counter = self._finished[reason] = self.metrics.finished.labels(self.model_name, reason)
        counter.inc()

    def _logprobs(self, req, ids, lps, offset: int) -> dict:
        tok = self.info.tokenizer
        return (chat_logprobs(tok, ids, lps, req.logprobs) if req.kind == "chat"
                else completion_logprobs(tok, ids, lps, offset))

    async def _collect(self, req, rids, sink, early, unfinished, progress):
        texts, ids, lps, finish, prompts = {}, {}, {}, {}, {}
        batch = early
        while unfinished:
            batch = batch or await sink.take()
            self._observe(batch, unfinished, progress)
            for d in batch:
                if d[PROMPT] is not None:
                    prompts[d[RID]] = d[PROMPT]
                for c in d[CHOICES]:
                    key = (d[RID], c[C_INDEX])
                    texts.setdefault(key, []).append(c[C_TEXT])
                    ids.setdefault(key, []).extend(c[C_IDS])
                    if c[C_LOGPROBS] is not None:
                        lps.setdefault(key, []).extend(c[C_LOGPROBS])
                    if c[C_FINISH] is not None:
                        finish[key] = c[C_FINISH]
            batch = []
        choices, prompt_tokens, completion_tokens = [], 0, 0
        n = req.params.n
        for i, rid in enumerate(rids):
            prompt_tokens += len(prompts.get(rid, ()))
            for k in range(n):
                key = (rid, k)
                token_ids, text = ids.get(key, []), "".join(texts.get(key, ()))
                completion_tokens += len(token_ids)
                choice = {"index": i * n + k, "finish_reason": finish.get(key)}
                if req.return_token_ids:
                    choice["token_ids"] = token_ids
                    choice["prompt_token_ids"] = list(prompts.get(rid, ()))
                choice["logprobs"] = (self._logprobs(req, token_ids, lps[key], 0)
                                      if req.logprobs is not None and key in lps else None)
                if req.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                choices.append(choice)
        return {"id": req.id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                "created": req.created, "model": req.model, "choices": choices,
                "usage": usage_of(prompt_tokens, completion_tokens)}

    async def _stream(self, req, stream: _SSEStream, rids, sink, early, unfinished, progress):
        """SSE chunks, one per wakeup (every delta that arrived since the last): the fixed parts encoded once,
        json.dumps only of the text. Ending, or being closed, releases the request (aborting what is unfinished)."""
        try:
            chat = req.kind == "chat"
            obj = "chat.completion.chunk" if chat else "text_completion"
            head = (f'data: {{"id": "{req.id}", "object": "{obj}", "created": {req.created}, '
                    f'"model": {json.dumps(req.model)}, "choices": [').encode()
            tail = (']' + (', "usage": null' if req.include_usage else '') + '}\n\n').encode()
            n = req.params.n
            index_of = {rid: i * n for i, rid in enumerate(rids)}
            states: dict[tuple, _ChoiceState] = {}
            prompts: dict[str, list] = {}
            want_ids, want_lps = req.return_token_ids, req.logprobs is not None
            batch = early
            try:
                while unfinished:
                    batch = batch or await sink.take()
                    self._observe(batch, unfinished, progress)
                    parts = []
                    for rid, prompt, index, text, ids, finish, lps in _merged(batch):
                        if prompt is not None:
                            prompts[rid] = prompt
                        st = states.get((rid, index))
                        if st is None:
                            st = states[(rid, index)] = _ChoiceState()
                        fr = "null" if finish is None else f'"{finish}"'
                        s = f'{{"index": {index_of[rid] + index}, "finish_reason": {fr}, '
                        if want_ids:
                            s += f'"token_ids": {_ints(ids)}, '
                            if not st.started:
                                s += f'"prompt_token_ids": {_ints(prompts.get(rid, ()))}, '
                        if want_lps and lps is not None:
                            s += f'"logprobs": {json.dumps(self._logprobs(req, ids, lps, st.text_sent))}, '
                        else:
                            s += '"logprobs": null, '
                        if chat:
                            role = '' if st.started else '"role": "assistant", '
                            s += f'"delta": {{{role}"content": {json.dumps(text)}}}}}'
                        else:
                            s += f'"text": {json.dumps(text)}}}'
                        st.started = True
                        st.text_sent += len(text)
                        st.tokens_sent += len(ids)
                        parts.append(s)
                    batch = []
                    if parts:
                        yield head + ", ".join(parts).encode() + tail
            except APIError as e:  # the engine failed mid-stream: the status line is gone, say it in the stream
                yield f"data: {json.dumps(e.body())}\n\n".encode()
                return
            if req.include_usage:
                completion = sum(s.tokens_sent for s in states.values())
                body = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [],
                        "usage": usage_of(sum(len(p) for p in prompts.values()), completion)}
                yield f"data: {json.dumps(body)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            await stream.release()

    # --- lifecycle ----------------------------------------------------------------------------------------
    async def drain(self) -> bool:
        """Stop admitting, wait for the admitted requests; False if drain_timeout passed first."""
        self.draining = True
        if self.admitted == 0:
            return True
        try:
            await asyncio.wait_for(self._drained.wait(), self.drain_timeout)
            return True
        except TimeoutError:
            return False


class _SSEStream:
    """A streaming response's chunks (`async for`), and `aclose()`, which aborts what is unfinished and releases
    the admission even when the chunks were never iterated (the client left before the first byte)."""

    def __init__(self, cm):
        self._cm, self._released = cm, False
        self.chunks = None

    def __aiter__(self):
        return self.chunks

    async def release(self) -> None:
        if not self._released:
            self._released = True
            await self._cm.__aexit__(None, None, None)

    async def aclose(self) -> None:
        try:
            await self.chunks.aclose()
        finally:
            await self.release()
