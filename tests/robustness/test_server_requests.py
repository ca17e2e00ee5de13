"""Bad requests to a real `kiln llm serve` process on 127.0.0.1 (one server for every case): each gets a 4xx
answer in OpenAI's error shape naming the field at fault, the server keeps serving, and afterwards no request
is running and every KV block is free (/metrics)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from ..llm.tiny import make_tiny_llama
from ..serve.llm_server import ServerProcess, metrics, wait_for

MODEL = "tinyllm"
CONTEXT = 128
ARGS = ["--max-num-seqs", "8", "--num-kv-blocks", "64", "--max-model-len", str(CONTEXT), "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(make_tiny_llama(tmp_path_factory.mktemp("tinyllm")), *ARGS)
    yield s
    s.kill()


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


C, CH = "/v1/completions", "/v1/chat/completions"
# (id, path, body: dict | bytes, statuses allowed, words: the message names at least one)
CASES = [
    ("json-truncated", C, b'{"model": "tinyllm", "prompt": ', (400,), ("JSON",)),
    ("json-not-utf8", C, b'{"model": "\xff\xfe", "prompt": "hi"}', (400,), ("JSON", "UTF-8", "utf-8")),
    ("json-empty-body", C, b"", (400,), ("JSON", "body")),
    ("json-array-body", C, b"[1, 2]", (400,), ("object",)),
    ("json-string-body", C, b'"hello"', (400,), ("object",)),
    ("json-deep-nesting", C, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", (400, 413), ("JSON", "prompt")),
    ("json-nan", C, b'{"model": "tinyllm", "prompt": "hi", "temperature": NaN}', (400,), ("temperature", "JSON")),
    ("unknown-field", C, _completion(temperatur=0.5), (400,), ("temperatur",)),
    ("chat-unknown-field", CH, _chat(frobnicate=True), (400,), ("frobnicate",)),
    ("prompt-missing", C, {"model": MODEL, "max_tokens": 2}, (400,), ("prompt",)),
    ("prompt-dict", C, _completion(prompt={"a": 1}), (400,), ("prompt",)),
    ("prompt-number", C, _completion(prompt=7), (400,), ("prompt",)),
    ("prompt-empty", C, _completion(prompt=""), (400,), ("prompt",)),
    ("prompt-empty-list", C, _completion(prompt=[]), (400,), ("prompt",)),
    ("prompt-mixed-list", C, _completion(prompt=[1, "a"]), (400,), ("prompt",)),
    ("prompt-token-outside-vocab", C, _completion(prompt=[10**6]), (400,), ("vocabulary",)),
    ("prompt-token-negative", C, _completion(prompt=[-1]), (400,), ("vocabulary",)),
    ("prompt-longer-than-context", C, _completion(prompt=[5] * (CONTEXT + 10)), (400,), ("context",)),
    ("prompt-plus-max-tokens-over-context", C, _completion(prompt=[5] * 100, max_tokens=100), (400,), ("context",)),
    ("prompt-huge-text", C, _completion(prompt="pot " * 200000), (400, 413), ("context", "large")),
    ("prompt-7-MiB", C, _completion(prompt="pot " * 1_800_000), (400,), ("context",)),
    ("body-over-8-MiB", C, _completion(prompt="pot " * 2_200_000), (413,), ("Large", "large", "size")),
    ("max-tokens-0", C, _completion(max_tokens=0), (400,), ("max_tokens",)),
    ("max-tokens-negative", C, _completion(max_tokens=-5), (400,), ("max_tokens",)),
    ("max-tokens-string", C, _completion(max_tokens="ten"), (400,), ("max_tokens",)),
    ("max-tokens-float", C, _completion(max_tokens=2.5), (400,), ("max_tokens",)),
    ("max-tokens-bool", C, _completion(max_tokens=True), (400,), ("max_tokens",)),
    ("max-tokens-huge", C, _completion(max_tokens=10**30), (400,), ("max_tokens", "context")),
    ("n-0", C, _completion(n=0), (400,), ("'n'", "n")),
    ("n-negative", C, _completion(n=-1), (400,), ("'n'", "n")),
    ("n-huge", C, _completion(n=10**6), (400,), ("'n'", "n")),
    ("n-string", C, _completion(n="two"), (400,), ("'n'", "n")),
    ("temperature-string", C, _completion(temperature="hot"), (400,), ("temperature",)),
    ("temperature-negative", C, _completion(temperature=-1), (400,), ("temperature",)),
    ("top-p-0", C, _completion(top_p=0), (400,), ("top_p",)),
    ("top-p-list", C, _completion(top_p=[1]), (400,), ("top_p",)),
    ("stop-number", C, _completion(stop=5), (400,), ("stop",)),
    ("stream-string", C, _completion(stream="yes"), (400,), ("stream",)),
    ("seed-string", C, _completion(seed="x"), (400,), ("seed",)),
    ("model-unknown", C, _completion(model="gpt-4"), (404,), ("gpt-4",)),
    ("model-number", C, _completion(model=3), (400, 404), ("model",)),
    ("chat-messages-missing", CH, {"model": MODEL, "max_tokens": 2}, (400,), ("messages",)),
    ("chat-messages-string", CH, _chat(messages="hi"), (400,), ("messages",)),
    ("chat-messages-empty", CH, _chat(messages=[]), (400,), ("messages",)),
    ("chat-message-no-content", CH, _chat(messages=[{"role": "user"}]), (400,), ("content", "messages")),
    ("chat-message-bad-role", CH, _chat(messages=[{"role": "wizard", "content": "hi"}]), (400,), ("role", "wizard")),
    ("chat-message-content-number", CH, _chat(messages=[{"role": "user", "content": 5}]), (400,),
     ("content", "messages")),
    ("chat-max-tokens-0", CH, _chat(max_tokens=0), (400,), ("max_tokens",)),
    ("chat-model-unknown", CH, _chat(model="gpt-4"), (404,), ("gpt-4",)),
    ("chat-too-long", CH, _chat(messages=[{"role": "user", "content": "pot " * 400}]), (400,), ("context",)),
]


def _request(server, method: str, path: str, body: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _problem(server, case) -> str | None:
    name, path, body, statuses, words = case
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = _request(server, "POST", path, raw)
    try:
        err = json.loads(answer)["error"]
        message = err["message"]
        assert isinstance(message, str) and isinstance(err.get("type"), str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{name}: {status} without an OpenAI error object: {answer[:300]!r}"
    if status not in statuses:
        return f"{name}: status {status} (want {statuses}): {message[:300]}"
    if not any(w in message for w in words):
        return f"{name}: the message names none of {words}: {message[:300]}"
    if "Traceback" in message:
        return f"{name}: a traceback in the message"
    return None


def _idle(server):
    def check():
        m = metrics(server.url)
        return m if (m["kiln:kv_cache_blocks_free"] == m["kiln:kv_cache_blocks_total"]
                     and m["kiln:num_requests_running"] == 0 and m.get("kiln:num_requests_waiting", 0) == 0) else None
    return wait_for(check, timeout=15)


def test_bad_requests_get_openai_errors(server):
    problems = [p for case in CASES if (p := _problem(server, case))]
    status, _ = _request(server, "GET", C)
    if status not in (405,):
        problems.append(f"GET {C}: status {status}, want 405")
    status, _ = _request(server, "POST", "/v1/nowhere", b"{}")
    if status != 404:
        problems.append(f"POST /v1/nowhere: status {status}, want 404")
    assert not problems, f"{len(problems)} of {len(CASES) + 2} requests:\n" + "\n".join(problems)
    assert _idle(server), "after the bad requests, a request is running or KV blocks are held"
    assert server.proc.poll() is None and "Traceback" not in server.output(), server.output()[-3000:]


def _stream_then_drop(server, path: str, body: dict, lines: int) -> None:
    raw = json.dumps({**body, "stream": True, "max_tokens": 100, "ignore_eos": True, "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}"
              f"\r\n\r\n".encode() + raw)
    got = b""
    while got.count(b"data: ") < lines:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, not FIN
    s.close()


def test_clients_going_away_free_everything_and_the_server_keeps_serving(server):
    _stream_then_drop(server, C, _completion(), lines=2)
    _stream_then_drop(server, CH, _chat(), lines=2)
    _stream_then_drop(server, C, _completion(n=3), lines=1)
    # a client that sends half of its body and goes away
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 500\r\n\r\n{\"model\": \"tinyllm\", ")
    s.close()
    m = _idle(server)
    assert m, "after clients went away, a request is running or KV blocks are held"
    assert m["kiln:request_aborted_total"] >= 3
    status, answer = _request(server, "POST", C, json.dumps(_completion(prompt="still here", max_tokens=3)).encode())
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 3, answer
    assert _idle(server)
    assert server.proc.poll() is None and "Traceback" not in server.output(), server.output()[-3000:]
