"""Ray Serve scale-out: `kiln llm serve --replicas 2` (two LLM engine replicas behind one OpenAI endpoint) and
`kiln serve ENGINE --replicas 2` (two Kiln engine replicas behind Triton's HTTP protocol), on a local cluster.

Skipped when Ray Serve is not installed (it is the optional extra kiln[ray]; CI does not install it).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'kiln[ray]')")

import openai  # noqa: E402
import torch  # noqa: E402

from kiln.llm.engine import LLM, SamplingParams  # noqa: E402

from .llm_server import ServerProcess  # noqa: E402

MODEL = "tinyllm"
ARGS = ["--replicas", "2", "--max-num-seqs", "16", "--num-kv-blocks", "128", "--max-model-len", "512",
        "--served-model-name", MODEL]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_replicas_spread_requests_and_lose_none_when_one_dies(tiny_llm):
    s = ServerProcess(tiny_llm, *ARGS, port=free_port(), timeout=300)
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [f"Once upon a time, potter {i}" for i in range(24)]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the replicas run
        try:
            ref = LLM(str(tiny_llm), device="cpu", max_num_seqs=16, num_kv_blocks=128, max_model_len=512).generate(
                prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        finally:
            torch.set_num_threads(threads)

        def ask(i):
            r = c.completions.with_raw_response.create(
                model=MODEL, prompt=prompts[i], max_tokens=32, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            out = r.parse()
            return int(r.headers["x-kiln-replica-pid"]), out.choices[0].model_extra["token_ids"]

        seen = collections.Counter(ask(i % len(prompts))[0] for i in range(12))
        assert len(seen) == 2, f"requests did not spread over both replicas: {seen}"

        answered = []
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(ask, i) for i in range(len(prompts))]
            for f in futures[:2]:
                answered.append(f.result()[0])
            victim = answered[0]
            os.kill(victim, signal.SIGKILL)  # one replica dies with requests in flight
            results = [f.result() for f in futures]  # every request still answers
        for (pid, tokens), r in zip(results, ref):
            assert tokens == r.outputs[0].token_ids
        assert any(pid != victim for pid, _ in results[2:])
    finally:
        s.terminate()
        try:
            s.wait(timeout=90)
        except Exception:
            s.kill()


def test_engine_replicas_answer_tritons_http_protocol_and_survive_a_kill(tmp_path):
    import json
    import urllib.request

    import numpy as np

    import kiln

    from ..models import mlp

    path = tmp_path / "mlp.kiln"
    kiln.build(mlp(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (16, 8))})], device="cpu",
                                       progress=False)).save(path)
    direct = kiln.load(path, device="cpu").create_execution_context()
    port = free_port()
    s = ServerProcess(path, "--replicas", "2", port=port, timeout=300, command=["serve"])
    try:
        url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"

        def ask(x):  # JSON tensors, as any KServe v2 client sends them
            body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                           "data": x.flatten().tolist()}]}).encode()
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as r:
                out = json.loads(r.read())["outputs"][0]
                return int(r.headers["x-kiln-replica-pid"]), np.array(out["data"], np.float32).reshape(out["shape"])

        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((1 + i % 4, 8)).astype(np.float32) for i in range(48)]
        assert len({ask(xs[i])[0] for i in range(12)}) == 2  # both replicas answer
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, x) for x in xs]
            victim = futures[0].result()[0]
            os.kill(victim, signal.SIGKILL)
            results = [f.result() for f in futures]
        for (pid, y), x in zip(results, xs):
            np.testing.assert_allclose(y, direct.run({"x": x})["y"], rtol=1e-6, atol=1e-6)

        tritonclient = pytest.importorskip("tritonclient.http")  # Triton's own client, binary tensors
        client = tritonclient.InferenceServerClient(f"127.0.0.1:{port}")
        inp = tritonclient.InferInput("x", [3, 8], "FP32")
        inp.set_data_from_numpy(xs[2])
        np.testing.assert_allclose(client.infer("mlp", [inp]).as_numpy("y"), direct.run({"x": xs[2]})["y"],
                                   rtol=1e-6, atol=1e-6)
    finally:
        s.terminate()
        try:
            s.wait(timeout=90)
        except Exception:
            s.kill()
