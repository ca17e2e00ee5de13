"""Scale-out on Ray Serve: N engine replicas behind one OpenAI endpoint.

    kiln llm serve MODEL --replicas 4                      # a local Ray cluster on this machine
    kiln llm serve MODEL --replicas 8 --ray-address auto   # an existing cluster (`ray start --head` / workers)

Two Ray Serve deployments make one application:
- `LLMReplica` (num_replicas N, one GPU each on a CUDA device, or one CPU): one LLMEngine and its engine thread
  behind kiln/serve/service.py, so a replica answers exactly what `kiln llm serve` answers. Ray's health check
  calls `check_health`, which fails once the engine thread is gone; Ray then replaces the replica.
- `OpenAIIngress`: the HTTP routes (on Ray Serve's proxy), the API key, and the routing of each request to a
  replica through a DeploymentHandle (Ray's power-of-two-choices router). A request whose replica dies before
  answering (non-streaming, or streaming before its first byte) is sent again to another replica, so killing a
  replica loses no request; a stream already under way ends with the replica.

Every replica loads MODEL from the same path: on a multi-node cluster that path must exist on every node (a
shared filesystem, or the same files copied). Responses carry `x-kiln-replica` (the replica's id) and
`x-kiln-replica-pid`. /metrics is not served here: each replica keeps its own Prometheus registry, and Ray
exports its cluster's metrics itself (`ray metrics launch-prometheus`).
"""

from __future__ import annotations

import asyncio
import json
import os

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .protocol import APIError

REPLICA_GONE = (RayActorError, ActorUnavailableError)


class LLMReplica:
    def __init__(self, model: str, engine_kwargs: dict, model_name: str | None, max_waiting: int):
        from kiln.llm.engine import LLMEngine

        from .service import OpenAIService

        self.service = OpenAIService(LLMEngine.from_model(model, **engine_kwargs), model_name=model_name,
                                     max_waiting=max_waiting)
        self.service.async_engine.start()
        self.headers = {"x-kiln-replica": serve.get_replica_context().replica_id.unique_id,
                        "x-kiln-replica-pid": str(os.getpid())}

    def check_health(self) -> None:
        if not self.service.async_engine.is_alive():
            raise RuntimeError("the engine thread stopped")

    def models(self) -> dict:
        return self.service.models()

    async def complete(self, kind: str, body) -> tuple[int, dict, dict]:
        try:
            req = self.service.parse(kind, body)
            return 200, await self.service.complete(req), self.headers
        except APIError as e:
            return e.status, e.body(), {**e.headers, **self.headers}

    async def stream(self, kind: str, body):
        """First item: (status, error body or None, headers); then the SSE chunks."""
        try:
            chunks = await self.service.open_stream(self.service.parse(kind, body))
        except APIError as e:
            yield e.status, e.body(), {**e.headers, **self.headers}
            return
        yield 200, None, self.headers
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()


class OpenAIIngress:
    def __init__(self, replicas, api_key: str | None, retries: int = 3):
        self.replicas, self.api_key, self.retries = replicas, api_key, retries

    def _authorized(self, request: Request) -> bool:
        import hmac

        given = request.headers.get("authorization", "")
        return not self.api_key or hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    async def __call__(self, request: Request):
        path = request.url.path.rstrip("/")
        if path == "/health":
            return JSONResponse({"status": "ok"})
        if not self._authorized(request):
            e = APIError("Incorrect API key provided: send 'Authorization: Bearer <key>'.", status=401,
                         code="invalid_api_key", type_="authentication_error")
            return JSONResponse(e.body(), status_code=401)
        if path == "/v1/models" and request.method == "GET":
            return JSONResponse(await self.replicas.models.remote())
        kinds = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
        if path not in kinds or request.method != "POST":
            e = APIError(f"no route {request.method} {request.url.path}", status=404)
            return JSONResponse(e.body(), status_code=404)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            e = APIError(f"the request body is not valid JSON: {err}.")
            return JSONResponse(e.body(), status_code=400)
        stream = isinstance(body, dict) and body.get("stream") is True
        for attempt in range(self.retries + 1):
            try:
                if stream:
                    return await self._stream(kinds[path], body)
                status, out, headers = await self.replicas.complete.remote(kinds[path], body)
                return JSONResponse(out, status_code=status, headers=headers)
            except REPLICA_GONE:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))  # let the router see the replica is gone

    async def _stream(self, kind: str, body):
        gen = self.replicas.options(stream=True).stream.remote(kind, body)
        status, error, headers = await gen.__anext__()  # a replica dying before this is retried by the caller
        if error is not None:
            return JSONResponse(error, status_code=status, headers=headers)

        async def chunks():
            async for chunk in gen:
                yield chunk

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=headers)


def application(model: str, engine_kwargs: dict, *, replicas: int, model_name: str | None = None,
                api_key: str | None = None, max_waiting: int = 1024, drain_timeout: float = 30.0,
                autoscale: tuple[int, int] | None = None):
    """The Ray Serve application (bind it with serve.run)."""
    gpu = str(engine_kwargs.get("device", "auto")).startswith("cuda")
    scaling = ({"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                       "target_ongoing_requests": engine_kwargs.get("max_num_seqs", 256)}}
               if autoscale else {"num_replicas": replicas})
    replica = serve.deployment(
        LLMReplica, name="LLMReplica", ray_actor_options={"num_gpus": 1} if gpu else {"num_cpus": 1},
        max_ongoing_requests=engine_kwargs.get("max_num_seqs", 256) + max_waiting,
        health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=drain_timeout, **scaling)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000, graceful_shutdown_timeout_s=drain_timeout)
    return ingress.bind(replica.bind(model, engine_kwargs, model_name, max_waiting), api_key)


def run(model: str, engine_kwargs: dict, *, host: str, port: int, replicas: int, ray_address: str | None,
        ready, **kw) -> None:
    """Start (or join) a Ray cluster, deploy, call ready(host, port), and serve until SIGTERM/SIGINT."""
    import signal
    import threading

    import ray

    ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(model, engine_kwargs, replicas=replicas, **kw), name="kiln", route_prefix="/")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready(host, port)
    stop.wait()
    serve.shutdown()  # Ray drains each replica for up to graceful_shutdown_timeout_s
    ray.shutdown()
