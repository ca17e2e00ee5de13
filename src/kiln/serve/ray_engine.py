"""Scale-out of a (non-LLM) Kiln engine on Ray Serve, speaking Triton's HTTP protocol (KServe v2).

    kiln serve model.kiln --replicas 4 --port 8000            # a local Ray cluster
    kiln serve model.kiln --replicas 8 --rayAddress auto     # an existing cluster; model.kiln on every node

Clients are Triton's own (tritonclient.http) or any KServe v2 client:
    GET  /v2/health/live, /v2/health/ready, /v2/models/NAME, /v2/models/NAME/ready
    POST /v2/models/NAME/infer        JSON tensors, or Triton's binary tensor extension (tritonclient's default)

`EngineReplica` (one GPU each for a CUDA engine, one CPU for a CPU one) loads the engine with kiln.load, so its
GPU, version and checksum checks apply on every replica, and batches concurrent requests with Ray Serve's own
`serve.batch` (up to the profiles' max batch; kiln/serve/batching.py merges them into few engine calls).
`EngineIngress` routes each request to a replica through a DeploymentHandle and sends it again to another
replica when its replica died before answering, so a killed replica loses no request.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import InputError, KilnError
from .ray_serve import REPLICA_GONE

# KServe v2 datatypes <-> numpy (BF16 travels as its 16-bit pattern).
V2_TYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
            "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
            "FP32": np.float32, "FP64": np.float64, "BF16": np.uint16}
_KILN_TO_V2 = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
               "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64", "float16": "FP16",
               "float32": "FP32", "float64": "FP64", "bfloat16": "BF16"}
HEADER_LENGTH = "Inference-Header-Content-Length"


class V2Error(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _to_torch(a: np.ndarray, datatype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if datatype == "BF16" else t


def _to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "BF16"
    a = t.numpy()
    for name, np_type in V2_TYPES.items():
        if name != "BF16" and a.dtype == np_type:
            return a, name
    raise V2Error(f"output dtype {a.dtype} has no KServe v2 datatype", 500)


def parse_infer_request(body: bytes, header_length: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(request JSON, inputs) of a v2 infer request, JSON data or binary tensors."""
    try:
        split = int(header_length) if header_length is not None else len(body)
        request = json.loads(body[:split])
    except (ValueError, UnicodeDecodeError) as e:
        raise V2Error(f"the request is not valid KServe v2 JSON: {e}") from None
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        raise V2Error("the request needs an 'inputs' list")
    blob, offset, feeds = body[split:], 0, {}
    for spec in request["inputs"]:
        try:
            name, datatype, shape = spec["name"], spec["datatype"], [int(d) for d in spec["shape"]]
        except (KeyError, TypeError, ValueError):
            raise V2Error("each input needs 'name', 'datatype' and 'shape'") from None
        if datatype not in V2_TYPES:
            raise V2Error(f"input '{name}': datatype {datatype!r} is not one of {sorted(V2_TYPES)}")
        np_type = V2_TYPES[datatype]
        size = (spec.get("parameters") or {}).get("binary_data_size")
        try:
            if size is not None:
                a = np.frombuffer(blob[offset:offset + size], dtype=np_type).reshape(shape)
                offset += size
            else:
                a = np.asarray(spec.get("data"), dtype=np_type).reshape(shape)
        except (ValueError, TypeError) as e:
            raise V2Error(f"input '{name}': its data does not fill shape {shape} of {datatype}: {e}") from None
        feeds[name] = _to_torch(a, datatype)
    return request, feeds


def infer_response(model: str, request: dict, outputs: dict[str, torch.Tensor]) -> Response:
    """The v2 response: binary outputs where the request asked for them (as tritonclient does), else JSON."""
    wanted = {o["name"]: (o.get("parameters") or {}) for o in request.get("outputs") or []}
    all_binary = bool((request.get("parameters") or {}).get("binary_data_output"))
    names = list(wanted) or list(outputs)
    entries, blobs = [], []
    for name in names:
        if name not in outputs:
            raise V2Error(f"output '{name}' does not exist; outputs are {list(outputs)}")
        a, datatype = _to_numpy(outputs[name])
        entry = {"name": name, "datatype": datatype, "shape": list(a.shape)}
        if wanted.get(name, {}).get("binary_data", all_binary):
            data = a.tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:
            entry["data"] = a.flatten().tolist()
        entries.append(entry)
    head = json.dumps({"model_name": model, "model_version": "1", "id": request.get("id", ""),
                       "outputs": entries}).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(head))})


class EngineReplica:
    def __init__(self, path: str, device: str, max_batch: int):
        from ..engine.serialize import load
        from .batching import BatchRunner

        self.engine = load(path, device=device)
        self.runner = BatchRunner(self.engine, self.engine.target.device, batching=max_batch > 0,
                                  max_rows=max_batch or None)
        self._batched.set_max_batch_size(max(1, max_batch))
        self.pid = os.getpid()

    def metadata(self) -> dict:
        b = self.engine.bindings()
        row = lambda x: {"name": x["name"], "datatype": _KILN_TO_V2.get(x["dtype"], x["dtype"]),  # noqa: E731
                         "shape": x["shape"]}
        return {"inputs": [row(x) for x in b if x["io"] == "input"],
                "outputs": [row(x) for x in b if x["io"] == "output"]}

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002)
    async def _batched(self, feeds: list[dict]) -> list:
        return await asyncio.to_thread(self.runner.run_many, feeds)

    async def infer(self, feeds: dict) -> tuple[dict | None, str | None, int]:
        """(outputs, None, pid) or (None, the refusal, pid)."""
        out = await self._batched(feeds)
        if isinstance(out, KilnError):
            return None, str(out), self.pid
        return out, None, self.pid


class EngineIngress:
    def __init__(self, replicas, name: str, retries: int = 3):
        self.replicas, self.name, self.retries = replicas, name, retries
        self._metadata = None

    async def __call__(self, request: Request):
        path = request.url.path.rstrip("/")
        model_path = f"/v2/models/{self.name}"
        try:
            if path in ("/v2/health/live", "/v2/health/ready", f"{model_path}/ready",
                        f"{model_path}/versions/1/ready"):
                return Response(status_code=200)
            if path in (model_path, f"{model_path}/versions/1") and request.method == "GET":
                if self._metadata is None:
                    self._metadata = await self.replicas.metadata.remote()
                return JSONResponse({"name": self.name, "versions": ["1"], "platform": "kiln", **self._metadata})
            if path in (f"{model_path}/infer", f"{model_path}/versions/1/infer") and request.method == "POST":
                req, feeds = parse_infer_request(await request.body(), request.headers.get(HEADER_LENGTH))
                outputs, refusal, pid = await self._infer(feeds)
                if refusal is not None:
                    raise V2Error(refusal)
                response = infer_response(self.name, req, outputs)
                response.headers["x-kiln-replica-pid"] = str(pid)
                return response
            raise V2Error(f"no route {request.method} {request.url.path} (the model is '{self.name}')", 404)
        except V2Error as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)

    async def _infer(self, feeds):
        for attempt in range(self.retries + 1):
            try:
                return await self.replicas.infer.remote(feeds)
            except REPLICA_GONE:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))  # let the router see the replica is gone


def application(path: str, *, name: str, replicas: int, max_batch: int | None = None):
    """The Ray Serve application for one engine file (bind it with serve.run)."""
    from .batching import batch_limit

    manifest_max, gpu = batch_limit(path)
    if max_batch is None:
        max_batch = manifest_max
    elif max_batch > manifest_max:
        raise InputError(f"--maxBatch {max_batch}: the engine's profiles accept batches up to {manifest_max}.")
    replica = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=replicas,
        ray_actor_options={"num_gpus": 1} if gpu else {"num_cpus": 1},
        health_check_period_s=5, max_ongoing_requests=max(64, 4 * max(1, max_batch)))
    ingress = serve.deployment(EngineIngress, name="EngineIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(path, "cuda" if gpu else "cpu", max_batch), name)
