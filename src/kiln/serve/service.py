"""OpenAI's API over the engine thread, independent of any HTTP framework.

`OpenAIService` parses request bodies (kiln/serve/protocol.py), admits them against a bound, submits them to
the engine thread (kiln/serve/async_engine.py), and turns engine outputs into OpenAI's response JSON or its
server-sent-event chunks, observing the latency metrics on the way. The aiohttp server
(kiln/serve/openai_server.py) and the Ray Serve replicas (kiln/serve/ray_serve.py) are thin layers on it.

Admission is bounded: at most max_num_seqs + max_waiting engine requests at once; past that, 429 with
Retry-After, and the request reaches no model. A stream that is closed before its end (the client went away)
aborts its engine requests, which returns their KV blocks to the pool before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

from ..errors import KilnError
from .async_engine import ACCEPTED, AsyncLLMEngine, EngineFailure
from .metrics import ServerMetrics
from .protocol import APIError, GenerationRequest, chat_logprobs, completion_logprobs, parse_chat, parse_completion
from .protocol import usage as usage_of


@dataclass
class _Choice:
    """What has been sent of one choice (one sequence) so far."""

    text_sent: int = 0
    tokens_sent: int = 0
    finish_reason: str | None = None
    started: bool = False  # chat: the role delta went out


@dataclass
class _Progress:
    arrival: float
    last_token: dict = field(default_factory=dict)  # engine request id -> time its last token reached us
    first_token: float | None = None


class OpenAIService:
    def __init__(self, engine, *, model_name: str | None = None, max_waiting: int = 1024,
                 drain_timeout: float = 30.0):
        self.engine = engine
        self.model_name = model_name or engine.model_name
        self.async_engine = AsyncLLMEngine(engine)
        self.metrics = ServerMetrics(self.async_engine.stats, self.model_name)
        self.max_admitted = engine.scheduler.max_num_seqs + max_waiting
        self.admitted = 0  # engine requests admitted and not yet finished (event-loop thread only)
        self.draining = False
        self.drain_timeout = drain_timeout
        self._drained = asyncio.Event()

    def parse(self, kind: str, body) -> GenerationRequest:
        e = self.engine
        parse = parse_chat if kind == "chat" else parse_completion
        return parse(body, self.model_name, e.tokenizer, e.model_config.vocab_size, e.max_model_len)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "kiln", "max_model_len": self.engine.max_model_len}]}

    async def complete(self, req: GenerationRequest) -> dict:
        """The whole response body of a non-streaming request."""
        async with self._submitted(req) as (rids, sink, early, unfinished, progress):
            return await self._collect(req, rids, sink, early, unfinished, progress)

    async def open_stream(self, req: GenerationRequest):
        """Admit and submit a streaming request; refusals raise APIError here, before any byte is sent. Returns
        an async iterator of SSE chunks (bytes); closing it early aborts the request."""
        cm = self._submitted(req)
        state = await cm.__aenter__()

        async def chunks():
            try:
                async for chunk in self._stream(req, *state):
                    yield chunk
            finally:
                await cm.__aexit__(None, None, None)

        return chunks()

    # --- generation ---------------------------------------------------------------------------------------
    def _admit(self, count: int) -> None:
        if self.draining:
            raise APIError("the server is shutting down and takes no new requests.", status=503,
                           type_="server_error", headers={"Retry-After": "5"})
        if self.admitted + count > self.max_admitted:
            raise APIError(f"the server's queue is full ({self.admitted} requests admitted, at most "
                           f"{self.max_admitted}); retry later.", status=429, type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        self.admitted += count

    def _release(self, count: int) -> None:
        self.admitted -= count
        if self.draining and self.admitted == 0:
            self._drained.set()

    @contextlib.asynccontextmanager
    async def _submitted(self, req: GenerationRequest):
        rids = [f"{req.id}-{i}" for i in range(len(req.prompts))]
        self._admit(len(rids))
        sink: asyncio.Queue = asyncio.Queue()
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

    async def _await_acceptance(self, sink, count: int) -> list:
        accepted, early = 0, []
        while accepted < count:
            item = await sink.get()
            if item is ACCEPTED:
                accepted += 1
            elif isinstance(item, KilnError):
                raise APIError(str(item))
            elif isinstance(item, EngineFailure):
                raise APIError(f"the engine failed: {item.message}", status=500, type_="server_error")
            else:
                early.append(item)  # an output of a prompt accepted before the others
        return early

    async def _outputs(self, sink, early: list, unfinished: set, progress: _Progress):
        """Engine outputs of this request until every prompt finished; observes the latency histograms."""
        items = list(early)
        while unfinished:
            item = items.pop(0) if items else await sink.get()
            if isinstance(item, EngineFailure):
                raise APIError(f"the engine failed: {item.message}", status=500, type_="server_error")
            now = time.perf_counter()
            last = progress.last_token.get(item.request_id)
            if last is None:
                if progress.first_token is None:
                    progress.first_token = now
                    self.metrics.ttft.labels(self.model_name).observe(now - progress.arrival)
            else:
                self.metrics.itl.labels(self.model_name).observe(now - last)
            progress.last_token[item.request_id] = now
            if item.finished:
                unfinished.discard(item.request_id)
                for c in item.outputs:
                    self.metrics.finished.labels(self.model_name, c.finish_reason or "stop").inc()
            yield item
        self.metrics.e2e.labels(self.model_name).observe(time.perf_counter() - progress.arrival)

    def _choice_extras(self, req, c, new_ids, prompt_ids, state: _Choice | None, offset: int) -> dict:
        extras = {}
        if req.return_token_ids:
            extras["token_ids"] = new_ids
            if state is None or not state.started:
                extras["prompt_token_ids"] = prompt_ids
        if req.logprobs is not None and c.logprobs is not None:
            lps = c.logprobs[len(c.token_ids) - len(new_ids):]
            tok = self.engine.tokenizer
            extras["logprobs"] = (chat_logprobs(tok, new_ids, lps, req.logprobs) if req.kind == "chat"
                                  else completion_logprobs(tok, new_ids, lps, offset))
        else:
            extras["logprobs"] = None
        return extras

    async def _collect(self, req, rids, sink, early, unfinished, progress):
        final = {}
        async for out in self._outputs(sink, early, unfinished, progress):
            if out.finished:
                final[out.request_id] = out
        choices, prompt_tokens, completion_tokens = [], 0, 0
        n = req.params.n
        for i, rid in enumerate(rids):
            out = final[rid]
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                extras = self._choice_extras(req, c, list(c.token_ids), out.prompt_token_ids, None, 0)
                choice = {"index": i * n + c.index, "finish_reason": c.finish_reason, **extras}
                if req.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                choices.append(choice)
        body = {"id": req.id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                "created": req.created, "model": req.model, "choices": choices,
                "usage": usage_of(prompt_tokens, completion_tokens)}
        return body

    async def _stream(self, req, rids, sink, early, unfinished, progress):
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        n = req.params.n
        states: dict[tuple[str, int], _Choice] = {}
        prompt_tokens = {}

        def chunk(choices, usage=None):
            body = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": choices}
            if req.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n".encode()

        try:
            async for out in self._outputs(sink, early, unfinished, progress):
                i = rids.index(out.request_id)
                prompt_tokens[out.request_id] = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    st = states.setdefault((out.request_id, c.index), _Choice())
                    new_text, new_ids = c.text[st.text_sent:], list(c.token_ids[st.tokens_sent:])
                    finishing = c.finish_reason is not None and st.finish_reason is None
                    if not new_text and not new_ids and not finishing:
                        continue
                    extras = self._choice_extras(req, c, new_ids, out.prompt_token_ids, st, st.text_sent)
                    choice = {"index": i * n + c.index, "finish_reason": c.finish_reason, **extras}
                    if req.kind == "chat":
                        choice["delta"] = {"content": new_text} if st.started else {"role": "assistant",
                                                                                   "content": new_text}
                    else:
                        choice["text"] = new_text
                    st.started = True
                    st.text_sent, st.tokens_sent, st.finish_reason = len(c.text), len(c.token_ids), c.finish_reason
                    choices.append(choice)
                if choices:
                    yield chunk(choices)
        except APIError as e:  # the engine failed mid-stream: the status line is gone, say it in the stream
            yield f"data: {json.dumps(e.body())}\n\n".encode()
            return
        if req.include_usage:
            completion = sum(s.tokens_sent for s in states.values())
            yield chunk([], usage_of(sum(prompt_tokens.values()), completion))
        yield b"data: [DONE]\n\n"

    # --- lifecycle ----------------------------------------------------------------------------------------
    async def drain(self) -> bool:
        """Stop admitting, wait for the admitted requests; False if drain_timeout passed first."""
        self.draining = True
        if self.admitted == 0:
            return True
        try:
            await asyncio.wait_for(self._drained.wait(), self.drain_timeout)
            return True
        except asyncio.TimeoutError:
            return False
