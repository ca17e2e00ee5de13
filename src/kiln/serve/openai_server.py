"""The OpenAI-compatible HTTP server for a Kiln LLM engine, on aiohttp.

    POST /v1/completions        text completion (prompt: string, token ids, or a list of either)
    POST /v1/chat/completions   chat, through the model's own chat template
    GET  /v1/models             the served model
    GET  /health                200 while serving, 503 while draining or once the engine stopped (never needs
                                the API key)
    GET  /metrics               Prometheus text (kiln/serve/metrics.py)

Streaming responses are server-sent events (`data: {...}` chunks, then `data: [DONE]`); with
`stream_options.include_usage` every chunk carries `"usage": null` and a last chunk with no choices carries the
token counts, as OpenAI sends them.

What a request means (parsing, admission and its 429, engine submission, response JSON and SSE chunks) is
kiln/serve/service.py's; this module is the HTTP layer: routes, the API key, error bodies, streaming writes,
and the process lifecycle. With --api-servers N, N such processes share the port and the one engine process
(kiln/serve/api_servers.py); each response then names its process in `X-Kiln-Api-Server` (its index) and
`X-Kiln-Api-Server-Pid`. A client that goes away mid-stream cancels its handler (aiohttp's handler
cancellation), which closes the stream and so aborts its request. SIGTERM (or SIGINT) stops admissions (503),
lets the admitted requests finish (up to drain_timeout seconds), then exits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import sys

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .protocol import APIError
from .service import OpenAIService

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def _not_json(constant: str):
    """NaN, Infinity and -Infinity: Python's json reads them, JSON (and OpenAI's API) has no such values."""
    raise json.JSONDecodeError(f"{constant} is not a JSON value", constant, 0)


class OpenAIServer:
    def __init__(self, engine, *, model_name: str | None = None, api_key: str | None = None,
                 max_waiting: int = 1024, drain_timeout: float = 30.0, metrics_dir: str | None = None,
                 server_index: int | None = None):
        """metrics_dir, server_index: this process's share of a scaled-out server (kiln/serve/api_servers.py)."""
        self.service = OpenAIService(engine, model_name=model_name, max_waiting=max_waiting,
                                     drain_timeout=drain_timeout, metrics_dir=metrics_dir)
        self.engine = engine
        self.model_name = self.service.model_name
        self.api_key = api_key or None
        self.server_index = server_index
        self._who = None if server_index is None else {"X-Kiln-Api-Server": str(server_index),
                                                       "X-Kiln-Api-Server-Pid": str(os.getpid())}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=8 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        if self._who is not None:
            app.on_response_prepare.append(self._name_process)
        return app

    async def _name_process(self, request, response) -> None:
        response.headers.update(self._who)

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except APIError as e:
            self.service.metrics.rejected.labels(self.model_name, str(e.status)).inc()
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = APIError(e.reason, status=e.status, type_="invalid_request_error")
            return web.json_response(err.body(), status=e.status)

    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise APIError("Incorrect API key provided: send 'Authorization: Bearer <key>' with the server's "
                               "--apiKey.", status=401, code="invalid_api_key", type_="authentication_error")
        return await handler(request)

    async def _json(self, request) -> dict:
        raw = await request.read()
        try:
            return json.loads(raw, parse_constant=_not_json)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}.") from None
        except RecursionError:
            raise APIError("the request body is not valid JSON here: it nests arrays or objects too deeply.") from None

    async def health(self, request):
        if self.service.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.service.async_engine.is_alive():
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request):
        return web.json_response(self.service.models())

    async def prometheus(self, request):
        return web.Response(body=generate_latest(self.service.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request):
        return await self._generate(request, self.service.parse("completion", await self._json(request)))

    async def chat_completions(self, request):
        return await self._generate(request, self.service.parse("chat", await self._json(request)))

    async def _generate(self, request, req):
        if not req.stream:
            return web.json_response(await self.service.complete(req))
        chunks = await self.service.open_stream(req)
        try:
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            async for chunk in chunks:
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client went away: closing the stream below aborts what is unfinished
        finally:
            await chunks.aclose()
        return resp


async def run_server(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, ready=None, *,
                     sock=None, pool=None, parent=None) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop. `ready(host, port)` is called once listening.

    sock: a listening socket to serve on instead of binding host:port. pool (the first of several HTTP
    processes, kiln/serve/api_servers.py): ready waits for the others, SIGTERM is passed on to them and the
    engine stops once they have drained. parent (one of the others): told when listening; its going away stops
    this process as SIGTERM does."""
    loop = asyncio.get_running_loop()
    service = server.service
    service.async_engine.start()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    if sock is not None:
        site = web.SockSite(runner, sock, backlog=2048)
    else:
        site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    bound = (sock or site._server.sockets[0]).getsockname()[1] if port == 0 or sock is not None else port
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if parent is not None:
        parent.listening(stop.set)
    if pool is not None:
        await pool.started()
    if ready is not None:
        ready(host, bound)
    await stop.wait()
    if pool is not None:
        pool.terminate()
    drained = await service.drain()
    who = "" if server.server_index is None else f"API server {server.server_index}: "
    print(f"kiln llm serve: {who}{'drained' if drained else 'drain timed out with'} "
          f"{service.admitted} requests in flight; stopping.", file=sys.stderr, flush=True)
    if pool is not None:
        await pool.wait(service.drain_timeout + 5.0)
    await runner.cleanup()
    service.async_engine.stop()
