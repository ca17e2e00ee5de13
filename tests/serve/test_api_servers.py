"""`kiln llm serve --api-servers 2`: two real HTTP processes on one port in front of one engine process, on
127.0.0.1 with the tiny model, driven by the official openai client (and urllib where each request must open
its own connection, so that it may land on either process)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from kiln.llm.engine import LLM, SamplingParams
from kiln.serve.api_servers import METRICS_PREFIX, metrics_folder

from .llm_server import ServerProcess, for_each_prompt, read_completion_stream, wait_for

KEY = "scale-out-key"
MODEL = "tinyllm"
SEQS, WAITING = 8, 8  # the admission bound of both processes together: 16
BOUND = SEQS + WAITING
PROMPTS = [f"Once upon a time {' the potter' * (i % 5)} fired pot {i}" for i in range(BOUND)]


@pytest.fixture(scope="module")
def server(tiny_llm):
    s = ServerProcess(tiny_llm, "--api-servers", "2", "--max-num-seqs", str(SEQS), "--max-waiting", str(WAITING),
                      "--num-kv-blocks", "256", "--max-model-len", "512", "--served-model-name", MODEL,
                      api_key=KEY)
    yield s
    s.kill()


def _children(pid: int) -> dict[int, str]:
    """The child processes of pid: {pid: command line}."""
    out = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            out[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


def _get(url: str, path: str) -> tuple[int, dict, bytes]:
    """One request on a connection of its own: (status, headers, body)."""
    req = urllib.request.Request(f"{url}{path}", headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _metrics_of_each(url: str) -> dict[str, dict[str, float]]:
    """/metrics of both HTTP processes, {process index: {name: value}}: scraped until each answered once."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(200):
        _, headers, body = _get(url, "/metrics")
        values: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                base = name.split("{")[0]
                values[base] = values.get(base, 0.0) + float(value)
        seen[headers["X-Kiln-Api-Server"]] = values
        if len(seen) == 2:
            return seen
    raise AssertionError(f"/metrics was answered by HTTP processes {sorted(seen)} only")


def test_streams_of_both_processes_are_batched_in_one_engine_and_equal_offline_generate(server, tiny_llm):
    children = _children(server.proc.pid)
    engines = [p for p, cmd in children.items() if "kiln.serve.engine_process" in cmd]
    others = [p for p, cmd in children.items() if "kiln.serve.api_servers" in cmd]
    assert len(engines) == 1 and len(others) == 1, children
    before = _metrics_of_each(server.url)
    max_tokens = 8

    async def one(c, prompt):
        raw = await c.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        tokens, text, usage, _ = await read_completion_stream(raw.parse())
        return int(raw.headers["X-Kiln-Api-Server-Pid"]), tokens, text, usage

    served = for_each_prompt(server.url, KEY, one, PROMPTS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server's engine runs (tests/serve/llm_server.py)
    try:
        offline = LLM(str(tiny_llm), device="cpu", max_num_seqs=SEQS, num_kv_blocks=256, max_model_len=512)
        ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    finally:
        torch.set_num_threads(threads)
    for (_, tokens, text, usage), r in zip(served, ref):
        assert tokens == r.outputs[0].token_ids
        assert text == r.outputs[0].text
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(r.prompt_token_ids), max_tokens)
    # The requests landed on both HTTP processes: the first one (the server's pid) and its other child.
    assert {pid for pid, *_ in served} == {server.proc.pid, others[0]}

    # Each process's /metrics counts every process's requests, and the same engine.
    after = _metrics_of_each(server.url)
    for index, m in after.items():
        def grew(name, m=m, b=before[index]):
            return m.get(name, 0.0) - b.get(name, 0.0)  # a labelled counter is absent until counted

        assert grew("kiln:time_to_first_token_seconds_count") == BOUND
        assert grew("kiln:e2e_request_latency_seconds_count") == BOUND
        assert grew("kiln:inter_token_latency_seconds_count") == BOUND * (max_tokens - 1)
        assert grew("kiln:request_success_total") == BOUND
        assert grew("kiln:generation_tokens_total") == BOUND * max_tokens
        assert m["kiln:num_requests_running"] == 0
    assert after["0"] == after["1"]


def test_a_disconnected_client_frees_its_blocks_seen_from_both_processes(server):
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = urllib.request.urlopen(req, timeout=30)
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    held = _metrics_of_each(server.url)
    for m in held.values():  # the other process sees the engine hold the stream's blocks too
        assert m["kiln:num_requests_running"] == 1
        assert m["kiln:kv_cache_blocks_free"] < m["kiln:kv_cache_blocks_total"]
    resp.close()  # the client goes away mid-stream

    def freed():
        each = _metrics_of_each(server.url)
        return each if all(m["kiln:kv_cache_blocks_free"] == m["kiln:kv_cache_blocks_total"]
                           for m in each.values()) else None

    each = wait_for(freed, timeout=10)
    assert each, "the aborted request's KV blocks were not returned"
    assert all(m["kiln:num_requests_running"] == 0 and m["kiln:request_aborted_total"] >= 1 for m in each.values())
    generated = [m["kiln:generation_tokens_total"] - held["0"]["kiln:generation_tokens_total"] for m in each.values()]
    assert max(generated) < 400  # it stopped: 400 tokens were asked for


def _refusals(url: str, holding: dict[str, int]) -> bool:
    """Requests past the bound, each on a connection of its own: every one a 429 wherever it lands; True once
    one was refused by a process that holds fewer than the bound itself (so by the engine's global count)."""
    body = json.dumps({"model": MODEL, "prompt": "one too many", "max_tokens": 2}).encode()
    for _ in range(20):
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        err = e.value
        assert err.code == 429 and err.headers["Retry-After"] == "1"
        assert json.loads(err.read())["error"]["code"] == "queue_full"
        if holding[err.headers["X-Kiln-Api-Server"]] < BOUND:
            return True
    return False


def test_the_queue_bound_is_global_and_sigterm_drains_every_process(server):
    worker = next(p for p, cmd in _children(server.proc.pid).items() if "kiln.serve.api_servers" in cmd)

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        try:
            # As many long streams as the bound, at once (a connection each): admitted once their headers came.
            raws = await asyncio.gather(*(c.completions.with_raw_response.create(
                model=MODEL, prompt=p, max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True})
                for p in PROMPTS))
            holding = {k: sum(1 for r in raws if r.headers["X-Kiln-Api-Server"] == k) for k in ("0", "1")}
            assert _refusals(server.url, holding), holding

            server.terminate()  # SIGTERM to the first process: both stop admitting, finish what they admitted
            assert wait_for(lambda: _get(server.url, "/health")[0] == 503, timeout=10)
            with pytest.raises(openai.APIStatusError) as e:
                await c.completions.create(model=MODEL, prompt="too late", max_tokens=2)
            assert e.value.status_code == 503

            async def finish(raw):
                last = None
                async for chunk in raw.parse():
                    last = chunk
                return last.choices[0].finish_reason

            assert await asyncio.gather(*(finish(r) for r in raws)) == ["length"] * BOUND
        finally:
            await c.close()

    asyncio.run(run())
    assert server.wait(timeout=30) == 0
    out = server.output()
    assert "API server 0: drained" in out and "API server 1: drained" in out
    assert not Path(f"/proc/{worker}").exists()  # the first process reaped it


def test_a_killed_servers_metrics_folder_is_removed_by_the_next_server():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{int(gone.stdout)}-")  # as a SIGKILLed server leaves it
    Path(dead, "histogram_1.db").write_bytes(b"\0" * 64)
    live = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getppid()}-")  # a running server's
    try:
        mine = metrics_folder()
        assert not os.path.exists(dead) and os.path.isdir(live)
        assert os.path.basename(mine).startswith(f"{METRICS_PREFIX}{os.getpid()}-")
        os.rmdir(mine)
    finally:
        os.rmdir(live)
