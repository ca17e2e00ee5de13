"""Load test of `kiln llm serve`: N concurrent streaming clients over loopback, then offline LLM.generate.

    python bench/serve_load.py MODEL [--clients 256] [--requests 2000] [--time-limit 900] [--device cuda]
    python bench/serve_load.py --tiny --device cpu --clients 32 --requests 200 --max-output 32

Starts the server as its own process on 127.0.0.1 (`kiln llm serve --port 0`, max_num_seqs = clients), then
N clients, each sending its next request as soon as the last one ended, take M requests off one list: prompts
of random token ids with ShareGPT-like input/output lengths (kiln.llm.benchmark.sharegpt_like_lengths, greedy,
ignore_eos so each output has its drawn length). Everything is bounded: past --time-limit no request starts and
those in flight are cancelled (counted as lost). Reports throughput, TTFT, TPOT and e2e p50/p99 as the
clients saw them, and errors. Then the server is stopped and the same requests run offline through one
LLMEngine with max_num_seqs = clients (kiln.llm.benchmark.run_requests) for the served/offline ratio.

--tiny serves the tiny test Llama (tests/llm/tiny.py, random weights) made in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kiln.llm.benchmark import percentile, random_prompts, run_requests, sharegpt_like_lengths  # noqa: E402

READY = re.compile(r"serving '.*' on http://127\.0\.0\.1:(\d+)")


def start_server(model: Path, a) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "kiln", "llm", "serve", str(model), "--port", "0", "--device", a.device,
           "--max-num-seqs", str(a.clients), "--served-model-name", "bench", "--max-waiting", str(a.clients)]
    if a.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(a.num_kv_blocks)]
    if a.max_model_len:
        cmd += ["--max-model-len", str(a.max_model_len)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        sys.stderr.write(line)
        m = READY.search(line)
        if m:
            return proc, int(m.group(1))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("the server did not start")


async def stream_one(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:200]}"}
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            n = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
            if n:
                last = time.perf_counter()
                first = first or last
                tokens += n
    if tokens != max_tokens:
        return {"error": f"{tokens} tokens streamed, {max_tokens} asked for"}
    return {"ttft": first - t0, "e2e": last - t0, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


async def load(url: str, prompts, out_lens, clients: int, time_limit: float) -> dict:
    import aiohttp

    todo = list(range(len(prompts)))
    results, errors = [], []
    deadline = time.monotonic() + time_limit

    async def client(session):
        while todo and time.monotonic() < deadline:
            i = todo.pop(0)
            try:
                r = await asyncio.wait_for(stream_one(session, url, prompts[i], out_lens[i]),
                                           max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                errors.append("cancelled at the time limit")
                continue
            except aiohttp.ClientError as e:
                r = {"error": f"{type(e).__name__}: {e}"}
            (errors if "error" in r else results).append(r.get("error", r))

    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(stream_one(session, url, prompts[0][:8], 4) for _ in range(2)))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = time.perf_counter() - t0
    ms = 1000.0
    ttft, tpot, e2e = ([r[k] for r in results if r[k] is not None] for k in ("ttft", "tpot", "e2e"))
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "errors": len(errors), "not_started": len(todo),
            "error_kinds": sorted(set(errors))[:5], "wall_s": wall, "output_tokens": tokens,
            "output_tok_s": tokens / wall, "req_s": len(results) / wall,
            "ttft_ms_p50": percentile(ttft, 0.5) * ms, "ttft_ms_p99": percentile(ttft, 0.99) * ms,
            "tpot_ms_p50": percentile(tpot, 0.5) * ms, "tpot_ms_p99": percentile(tpot, 0.99) * ms,
            "e2e_ms_p50": percentile(e2e, 0.5) * ms, "e2e_ms_p99": percentile(e2e, 0.99) * ms}


def offline(model: Path, a, prompts, out_lens) -> dict:
    from kiln.llm.engine import LLMEngine

    kw = dict(device=a.device, max_num_seqs=a.clients)
    if a.num_kv_blocks:
        kw["num_kv_blocks"] = a.num_kv_blocks
    if a.max_model_len:
        kw["max_model_len"] = a.max_model_len
    engine = LLMEngine.from_model(str(model), **kw)
    run_requests(engine, [prompts[0][:8]] * 2, [4, 4])  # warm-up, as the served run's
    return run_requests(engine, prompts, out_lens)


def render(r: dict) -> str:
    s, o = r["served"], r.get("offline")

    def f(v, fmt=".1f"):
        return "-" if v is None else format(v, fmt)

    rows = [("requests completed", f"{s['requests']} of {r['num_requests']}", f"{o['requests']}" if o else "-"),
            ("errors / lost", f"{s['errors']} / {s['not_started']} not started", "-"),
            ("wall time (s)", f(s["wall_s"], ".2f"), f(o["wall_s"], ".2f") if o else "-"),
            ("output tokens", str(s["output_tokens"]), str(o["output_tokens"]) if o else "-"),
            ("throughput (output tok/s)", f(s["output_tok_s"]), f(o["output_tok_s"]) if o else "-"),
            ("requests/s", f(s["req_s"], ".2f"), f(o["requests"] / o["wall_s"], ".2f") if o else "-"),
            ("TTFT p50 / p99 (ms)", f"{f(s['ttft_ms_p50'])} / {f(s['ttft_ms_p99'])}",
             f"{f(o['ttft_ms_p50'])} / {f(o['ttft_ms_p99'])}" if o else "-"),
            ("TPOT p50 / p99 (ms)", f"{f(s['tpot_ms_p50'], '.2f')} / {f(s['tpot_ms_p99'], '.2f')}",
             f"{f(o['tpot_ms_p50'], '.2f')} / {f(o['tpot_ms_p99'], '.2f')}" if o else "-"),
            ("e2e p50 / p99 (ms)", f"{f(s['e2e_ms_p50'])} / {f(s['e2e_ms_p99'])}",
             f"{f(o['e2e_ms_p50'])} / {f(o['e2e_ms_p99'])}" if o else "-")]
    lines = ["| | served (HTTP, streaming) | offline LLM.generate |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    if o:
        lines.append(f"\nServed / offline throughput: **{s['output_tok_s'] / o['output_tok_s']:.2f}**")
    if s["error_kinds"]:
        lines.append(f"\nErrors: {s['error_kinds']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="HF directory, .gguf or .kiln LLM engine")
    p.add_argument("--tiny", action="store_true", help="serve the tiny test Llama (tests/llm/tiny.py)")
    p.add_argument("--clients", type=int, default=256, help="concurrent clients, also max_num_seqs (default 256)")
    p.add_argument("--requests", type=int, default=2000, help="requests in all (default 2000)")
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds the served run may take (default 900)")
    p.add_argument("--max-output", type=int, help="cap on the drawn output lengths (a short run)")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--threads", type=int, help="torch intra-op threads of the server and the offline run alike "
                   "(OMP_NUM_THREADS; on a small shared CPU, 1 avoids OpenMP oversubscription)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    a = p.parse_args(argv)
    if bool(a.model) == a.tiny:
        p.error("give MODEL or --tiny")
    tmp = None
    if a.tiny:
        sys.path.insert(0, str(ROOT))
        from tests.llm.tiny import make_tiny_llama

        tmp = tempfile.TemporaryDirectory()
        model = make_tiny_llama(Path(tmp.name) / "tiny")
    else:
        model = Path(a.model)
    cfg = json.loads((model / "config.json").read_text()) if model.is_dir() else {}
    max_len = a.max_model_len or cfg.get("max_position_embeddings", 2048)
    pairs = sharegpt_like_lengths(a.requests, max_len)
    if a.max_output:
        pairs = [(i, min(o, a.max_output)) for i, o in pairs]
    prompts = random_prompts(cfg.get("vocab_size", 32000), [i for i, _ in pairs])
    out_lens = [o for _, o in pairs]
    if a.threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the server process inherits it
        torch.set_num_threads(a.threads)
    proc, port = start_server(model, a)
    try:
        served = asyncio.run(load(f"http://127.0.0.1:{port}", prompts, out_lens, a.clients, a.time_limit))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python", "bench/serve_load.py", *(argv or sys.argv[1:])]),
              "model": "tiny Llama (tests/llm/tiny.py)" if a.tiny else str(model), "device": a.device,
              "clients": a.clients, "num_requests": a.requests, "threads": a.threads,
              "mean_input_len": sum(len(x) for x in prompts) / len(prompts),
              "mean_output_len": sum(out_lens) / len(out_lens), "served": served}
    if not a.skip_offline:
        result["offline"] = offline(model, a, prompts, out_lens)
        result["offline"].pop("cuda_graphs", None)
        result["offline"].pop("cuda_graph_error", None)
    print(render(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if tmp:
        tmp.cleanup()
    return 0 if served["errors"] == 0 and served["not_started"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
