"""The server's engine backends: the engine's own process (what `kiln llm serve` runs) and the in-process
thread (what the Ray Serve replicas run), with the tiny model on the CPU."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from kiln.llm.engine import LLM, LLMEngine, SamplingParams
from kiln.serve.engine_process import FrameReader
from kiln.serve.protocol import APIError
from kiln.serve.service import OpenAIService

from .llm_server import ServerProcess


def test_frames_survive_any_split():
    payloads = [b"", b"x", bytes(range(256)) * 300, b"last"]
    stream = b"".join(struct.pack("<I", len(p)) + p for p in payloads)
    for step in (1, 3, 4096, len(stream)):
        reader, got = FrameReader(), []
        for i in range(0, len(stream), step):
            got += reader.feed(stream[i:i + step])
        assert got == payloads


def _engine_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_dead_engine_process_fails_requests_and_health_not_the_server(tiny_llm):
    s = ServerProcess(tiny_llm, "--max-num-seqs", "4", "--num-kv-blocks", "64", "--max-model-len", "256",
                      "--served-model-name", "m")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=30)
        stream = c.completions.create(model="m", prompt="Once upon a time", max_tokens=200, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # the engine is generating
        os.kill(_engine_pid(s.proc.pid), signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process exited"):
            for _ in stream:
                pass
        assert _health(s.url) == (503, {"status": "engine stopped"})
        with pytest.raises(openai.InternalServerError, match="engine process exited"):
            c.completions.create(model="m", prompt="hello", max_tokens=4)
        assert s.proc.poll() is None  # the HTTP process still answers, and says why
        s.terminate()
        assert s.wait(30) == 0
    finally:
        s.kill()


def test_thread_backend_streams_offline_tokens(tiny_llm):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kw = dict(device="cpu", max_num_seqs=8, num_kv_blocks=64, max_model_len=256)
        ref = LLM(str(tiny_llm), **kw).generate(["Hello world", "The kiln"], SamplingParams(temperature=0,
                                                max_tokens=6, n=1), use_tqdm=False)
        service = OpenAIService(LLMEngine.from_model(str(tiny_llm), **kw), model_name="m")

        async def run():
            service.async_engine.start()
            try:
                body = {"model": "m", "prompt": ["Hello world", "The kiln"], "max_tokens": 6, "temperature": 0,
                        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
                chunks = [c async for c in await service.open_stream(service.parse("completion", body))]
                whole = await service.complete(service.parse("completion", {**body, "stream": False,
                                                                            "stream_options": None}))
                with pytest.raises(APIError, match="context length"):
                    service.parse("completion", {**body, "max_tokens": 300})
                return chunks, whole
            finally:
                service.async_engine.stop()

        chunks, whole = asyncio.run(run())
        assert chunks[-1] == b"data: [DONE]\n\n"
        events = [json.loads(c[6:]) for c in chunks[:-1]]
        ids, text = {0: [], 1: []}, {0: "", 1: ""}
        for e in events[:-1]:
            for ch in e["choices"]:
                ids[ch["index"]] += ch["token_ids"]
                text[ch["index"]] += ch["text"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == sum(
            len(r.outputs[0].token_ids) for r in ref)
        for i, r in enumerate(ref):
            assert ids[i] == r.outputs[0].token_ids and text[i] == r.outputs[0].text
            assert whole["choices"][i]["token_ids"] == r.outputs[0].token_ids
            assert whole["choices"][i]["text"] == r.outputs[0].text
            assert whole["choices"][i]["prompt_token_ids"] == r.prompt_token_ids
        assert service.async_engine.stats()["kv_blocks_free"] == 64
    finally:
        torch.set_num_threads(threads)
