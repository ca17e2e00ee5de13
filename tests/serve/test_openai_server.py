"""`kiln llm serve`: a real server process on 127.0.0.1 with the tiny model, driven by the official openai client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from kiln.llm.engine import LLM, SamplingParams

from .llm_server import ServerProcess, for_each_prompt, metrics, read_completion_stream, wait_for

KEY = "test-key-123"
MODEL = "tinyllm"
ENGINE_ARGS = ["--max-num-seqs", "64", "--num-kv-blocks", "256", "--max-model-len", "512"]
PROMPTS = [f"Once upon a time {' the potter' * (i % 7)} number {i}" for i in range(64)]


@pytest.fixture(scope="module")
def server(tiny_llm):
    s = ServerProcess(tiny_llm, *ENGINE_ARGS, "--served-model-name", MODEL, api_key=KEY)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def offline(tiny_llm):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server process runs (tests/serve/llm_server.py)
    yield LLM(str(tiny_llm), device="cpu", max_num_seqs=64, num_kv_blocks=256, max_model_len=512)
    torch.set_num_threads(threads)


def client(server, key=KEY, **kw):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, **kw)


def post(url, body: bytes, key=KEY):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_64_concurrent_streams_equal_offline_generate(server, offline):
    max_tokens = 8

    async def one(c, prompt):
        stream = await c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        return await read_completion_stream(stream)

    served = for_each_prompt(server.url, KEY, one, PROMPTS)
    ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    for (tokens, text, usage, finish), r in zip(served, ref):
        assert tokens == r.outputs[0].token_ids
        assert text == r.outputs[0].text
        assert finish == "length"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(r.prompt_token_ids), max_tokens)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    m = metrics(server.url, KEY)
    assert m["kiln:time_to_first_token_seconds_count"] >= 64
    assert m["kiln:inter_token_latency_seconds_count"] >= 64 * (max_tokens - 1)
    assert m["kiln:e2e_request_latency_seconds_count"] >= 64
    assert m["kiln:generation_tokens_total"] >= 64 * max_tokens
    assert m["kiln:prefix_cache_queries_total"] > 0
    assert m["kiln:num_requests_running"] == 0


def test_completion_and_chat_follow_the_model(server, offline):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0,
                             extra_body={"return_token_ids": True})
    ref = offline.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    assert r.choices[0].text == ref.outputs[0].text and r.usage.completion_tokens == 6
    lp = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=3, temperature=0, logprobs=2).choices[0]
    assert len(lp.logprobs.tokens) == 3 and all(len(t) <= 2 for t in lp.logprobs.top_logprobs)
    assert all(v <= 0 for v in lp.logprobs.token_logprobs)

    messages = [{"role": "system", "content": "You are a potter."}, {"role": "user", "content": "what is a kiln?"}]
    tok = offline.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=5))
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] == prompt_ids == ref.prompt_token_ids
    assert r.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt_ids)
    lp = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, logprobs=True,
                                   top_logprobs=2).choices[0].logprobs.content
    assert len(lp) == 2 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_disconnect_aborts_and_frees_blocks(server):
    before = metrics(server.url, KEY)
    assert before["kiln:kv_cache_blocks_free"] == before["kiln:kv_cache_blocks_total"]
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = urllib.request.urlopen(req, timeout=30)
    for _ in range(3):
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    held = metrics(server.url, KEY)
    assert held["kiln:num_requests_running"] == 1 and held["kiln:kv_cache_blocks_free"] < held[
        "kiln:kv_cache_blocks_total"]
    resp.close()  # the client goes away mid-stream

    def freed():
        m = metrics(server.url, KEY)
        return m if m["kiln:kv_cache_blocks_free"] == m["kiln:kv_cache_blocks_total"] else None

    m = wait_for(freed, timeout=10)
    assert m, "the aborted request's KV blocks were not returned"
    assert m["kiln:num_requests_running"] == 0 and m["kiln:request_aborted_total"] >= 1
    generated = m["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"]
    assert generated < 400  # it stopped: 400 tokens were asked for
    time.sleep(0.3)
    assert metrics(server.url, KEY)["kiln:generation_tokens_total"] == m["kiln:generation_tokens_total"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url = f"{server.url}/v1/completions"
    status, body = post(url, b'{"model": "tinyllm", "prompt": ')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    c = client(server)
    cases = [
        (dict(prompt="hi", max_tokens=4, extra_body={"temperatur": 0.5}), "temperatur"),
        (dict(prompt=[5] * 600, max_tokens=4), "maximum context length"),
        (dict(prompt="hi", max_tokens=600), "maximum context length"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", max_tokens=4, n=0), "'n'"),
        (dict(prompt="hi", max_tokens=4, n=17), "'n'"),
        (dict(prompt="hi", max_tokens=4, temperature=-1), "temperature"),
        (dict(prompt=[10**6], max_tokens=4), "vocabulary"),
    ]
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, **kwargs)
        assert words in e.value.message, kwargs
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=2)

    before = metrics(server.url, KEY)["kiln:prompt_tokens_total"]
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    status, body = post(url, json.dumps({"model": MODEL, "prompt": "hi"}).encode(), key="")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    for path in ("/metrics", "/v1/models"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{server.url}{path}", timeout=10)
        assert e.value.code == 401
    assert metrics(server.url, KEY)["kiln:prompt_tokens_total"] == before  # no model was touched
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        assert r.status == 200

    r = c.completions.create(model=MODEL, prompt="still here", max_tokens=3, n=2, temperature=0.8, seed=1)
    assert sorted(ch.index for ch in r.choices) == [0, 1] and r.usage.completion_tokens == 6


def test_full_queue_gets_429_and_sigterm_drains(tiny_llm):
    s = ServerProcess(tiny_llm, "--max-num-seqs", "1", "--max-waiting", "1", "--num-kv-blocks", "64",
                      "--max-model-len", "512", "--served-model-name", MODEL)
    try:
        c = client(s, key="unused")
        long = dict(model=MODEL, prompt="Once upon a time", max_tokens=200, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
        first, second = c.completions.create(**long), c.completions.create(**long)
        next(iter(first))  # both admitted (one running, one waiting)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="one too many", max_tokens=2)
        assert e.value.response.headers["Retry-After"] == "1"
        assert e.value.body["code"] == "queue_full"

        s.terminate()  # SIGTERM while two requests are admitted: both finish, nothing new is taken
        assert wait_for(lambda: _health(s.url) == 503, timeout=10)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL, prompt="too late", max_tokens=2)
        assert e.value.status_code == 503
        for stream in (first, second):
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length"
        assert s.wait(timeout=30) == 0
        assert "drained" in s.output()
    finally:
        s.kill()


def _health(url):
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None
