"""A real `kiln llm serve` process on 127.0.0.1 for the tests: started with --port 0 (or a given port), the
port read from the line it prints once listening."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"serving '.*' on http://127\.0\.0\.1:(\d+)")  # kiln llm serve's and kiln serve's line


class ServerProcess:
    def __init__(self, model: Path, *args: str, api_key: str | None = None, timeout: float = 120.0, port: int = 0,
                 command: list[str] | None = None):
        # One intra-op thread: on a small shared CPU, torch's OpenMP threads waiting for each other made the
        # CPU engine's prefill many times slower.
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("KILN_API_KEY", None)
        cmd = [sys.executable, "-m", "kiln", *(command or ["llm", "serve", str(model), "--device", "cpu"])]
        cmd += [str(model)] if command else []
        cmd += ["--port", str(port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.port = None
        ready = threading.Event()

        def pump():  # keep reading so the pipe never fills; the ready line gives the port
            for line in self.proc.stdout:
                self.lines.append(line)
                m = READY.search(line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or self.port is None:
            self.kill()
            raise RuntimeError("kiln llm serve did not start:\n" + "".join(self.lines[-40:]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return "".join(self.lines)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics as {name: value} (labels dropped: one model per server)."""
    import urllib.request

    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base = name.split("{")[0]
            out[base] = out.get(base, 0.0) + float(value)  # summed over label sets
    return out


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


async def read_completion_stream(chunks) -> tuple[list[int], str, object, str | None]:
    """A streamed /v1/completions answer (the openai client's chunks, asked with return_token_ids and usage):
    (token ids, text, usage, the last finish reason)."""
    tokens, text, usage, finish = [], "", None, None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            tokens += ch.model_extra["token_ids"]
            text += ch.text
            finish = ch.finish_reason or finish
    return tokens, text, usage, finish


def for_each_prompt(url: str, api_key: str, one, prompts) -> list:
    """asyncio.run of one(client, prompt) for every prompt at once, over one openai.AsyncOpenAI client."""
    import asyncio

    import openai

    async def all_of():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(c, p) for p in prompts))
        finally:
            await c.close()

    return asyncio.run(all_of())
