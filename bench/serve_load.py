"""Load test of `kiln llm serve`: N concurrent streaming clients over loopback, then offline LLM.generate.

    python bench/serve_load.py MODEL [--clients 256] [--requests 2000] [--time-limit 900] [--device cuda]
    python bench/serve_load.py --tiny --device cpu --clients 32 --requests 200 --max-output 32
    python bench/serve_load.py --tiny --device cpu --clients 256 --threads 1 --host-steps
    python bench/serve_load.py --suite --device cuda --out bench/results/H200-serve-load

Starts the server as its own process on 127.0.0.1 (`kiln llm serve --port 0 --api-servers N`, max_num_seqs =
clients; --api-servers, default 4, HTTP processes in front of its one engine process), then
N clients, each sending its next request as soon as the last one ended, take M requests off one list: prompts
of random token ids with ShareGPT-like input/output lengths (kiln.llm.benchmark.sharegpt_like_lengths, greedy,
ignore_eos so each output has its drawn length). Everything is bounded: past --time-limit no request starts and
those in flight are cancelled (counted as lost). Reports throughput, TTFT, TPOT and e2e p50/p99 as the
clients saw them, and errors. Then the server is stopped and the same requests run offline through one
LLMEngine with max_num_seqs = clients (kiln.llm.benchmark.run_requests) for the served/offline ratio.

--tiny serves the tiny test Llama (tests/llm/tiny.py, random weights) made in a temporary folder; there a
decode step is so short that the server's per-token host work shows. --random-model llama-1b serves a
random-weight BF16 model of Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 KV heads, FFN 8192,
vocabulary 128256; about 2.5 GB written to a temporary folder), whose step time is a real model's.

--host-steps measures no server: the engine's host CPU per full decode step (forward and token wait left out)
along offline generate's path, the server's engine process's and the thread backend's.

The clients run in --client-procs processes (each its own event loop and share of the clients, results
merged), and the report gives their CPU use beside the server's (its HTTP processes and its engine process), so
a reader can see the load generator was not the limit. The clients speak HTTP through aiohttp (no openai
package needed).

--suite runs, one after the other in processes of their own and each bounded in time, the served and offline
halves for the tiny model and for the random Llama-3.2-1B shape (where the GPU's step time dominates), then,
time left, the tiny model served with the tokenizers library's thread pool on in the HTTP processes; it writes
OUT.md and OUT.json (--out OUT).
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
from kiln.serve import cpu_placement, step_profile  # noqa: E402

READY = re.compile(r"serving '.*' on http://127\.0\.0\.1:(\d+)")


def start_server(model: Path, a) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "kiln", "llm", "serve", str(model), "--port", "0", "--device", a.device,
           "--max-num-seqs", str(a.clients), "--served-model-name", "bench", "--max-waiting", str(a.clients)]
    if a.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(a.num_kv_blocks)]
    if a.max_model_len:
        cmd += ["--max-model-len", str(a.max_model_len)]
    cmd += ["--step-profile", str(a.step_profile_file), "--engine-cpu", a.engine_cpu, "--api-servers",
            str(a.api_servers)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline, m = time.monotonic() + 600, None
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            m = READY.search(line)
            if m:
                return proc, int(m.group(1))
            if time.monotonic() > deadline:
                break
    finally:
        if proc.returncode is None and not m:
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
        server = r.headers.get("X-Kiln-Api-Server", "0")
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
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "server": server}


async def client_share(url: str, prompts, out_lens, clients: int, next_index, start, time_limit: float,
                       warmup=None) -> dict:
    """One client process's share: `clients` concurrent clients taking requests off the shared counter; first
    its share of the warm-up requests (not measured), then, all processes together, the measured ones."""
    import aiohttp

    results, errors = [], []

    def take():
        with next_index.get_lock():
            i = next_index.value
            if i >= len(prompts):
                return None
            next_index.value = i + 1
            return i

    async def client(session, deadline):
        while time.monotonic() < deadline:
            i = take()
            if i is None:
                return
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
        if warmup:
            w_prompts, w_lens, part, parts = warmup  # this process's every parts-th warm-up request, all at once
            await asyncio.gather(*(stream_one(session, url, w_prompts[i], w_lens[i])
                                   for i in range(part, len(w_prompts), parts)))
        start.wait()  # every process starts together
        cpu0, t0 = time.process_time(), time.perf_counter()
        deadline = time.monotonic() + time_limit
        await asyncio.gather(*(client(session, deadline) for _ in range(clients)))
        end = time.perf_counter()
    return {"results": results, "errors": errors, "end": end, "cpu_s": time.process_time() - cpu0,
            "wall_s": end - t0}


def _client_process(args, done) -> None:
    url, prompts, out_lens, clients, next_index, start, time_limit, warmup, cpus = args
    if cpus:  # off the engine's core, as the server's HTTP process
        cpu_placement.pin(cpus)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    done.put(asyncio.run(client_share(url, prompts, out_lens, clients, next_index, start, time_limit, warmup)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def server_processes(pid: int) -> tuple[list[int], list[int]]:
    """(the HTTP processes, the engine process) of the server whose first HTTP process is pid."""
    http, engine = [pid], []
    for child in child_pids(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        (engine if b"kiln.serve.engine_process" in cmd else http).append(child)
    return http, engine


def load(url: str, prompts, out_lens, clients: int, time_limit: float, procs: int, server_pid: int,
         warmup=None, cpus=None) -> dict:
    """The served run: `procs` client processes (each its own event loop and share of the clients), so the load
    generator's JSON parsing is not what limits the measured throughput; their CPU use is reported."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # the prompts are inherited, not copied through a pipe
    procs = max(1, min(procs, clients))
    shares = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    next_index, start = ctx.Value("l", 0), ctx.Barrier(procs + 1)
    http, engines = server_processes(server_pid)
    watched = [*http, *engines]
    done = ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=((url, prompts, out_lens, n, next_index, start,
                                                          time_limit, warmup and (*warmup, k, procs), cpus), done),
                           daemon=True) for k, n in enumerate(shares)]
    for w in workers:
        w.start()
    start.wait()
    t0, window_start = time.perf_counter(), time.monotonic()
    cpu0 = [cpu_seconds(p) for p in watched]
    parts = [done.get() for _ in workers]
    window_end = time.monotonic()
    cpu = [cpu_seconds(p) - c for p, c in zip(watched, cpu0)]
    for w in workers:
        w.join()
    wall = max(p["end"] for p in parts) - t0
    results = [r for p in parts for r in p["results"]]
    errors = [e for p in parts for e in p["errors"]]
    ms = 1000.0
    ttft, tpot, e2e = ([r[k] for r in results if r[k] is not None] for k in ("ttft", "tpot", "e2e"))
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "errors": len(errors), "not_started": max(0, len(prompts) - next_index.value),
            "error_kinds": sorted(set(errors))[:5], "wall_s": wall, "output_tokens": tokens,
            "output_tok_s": tokens / wall, "req_s": len(results) / wall,
            "ttft_ms_p50": percentile(ttft, 0.5) * ms, "ttft_ms_p99": percentile(ttft, 0.99) * ms,
            "tpot_ms_p50": percentile(tpot, 0.5) * ms, "tpot_ms_p99": percentile(tpot, 0.99) * ms,
            "e2e_ms_p50": percentile(e2e, 0.5) * ms, "e2e_ms_p99": percentile(e2e, 0.99) * ms,
            "client_processes": procs,
            "client_cpu_busiest": max(p["cpu_s"] / p["wall_s"] for p in parts),  # fraction of one core
            "client_cpu_cores": sum(p["cpu_s"] for p in parts) / wall,
            "server_cpu_cores": sum(cpu[:len(http)]) / wall,
            "http_cpu_cores_each": [c / wall for c in cpu[:len(http)]],
            "engine_cpu_cores": sum(cpu[len(http):]) / wall if engines else None,
            "requests_per_api_server": {k: sum(1 for r in results if r["server"] == k)
                                        for k in sorted({r["server"] for r in results}, key=int)},
            "window": (window_start, window_end)}  # on time.monotonic(): the engine process's steps in it


def engine_kwargs(a) -> dict:
    """The engine's settings of both runs (those `kiln llm serve` gets from start_server's flags)."""
    kw = {"device": a.device, "max_num_seqs": a.clients}
    if a.num_kv_blocks:
        kw["num_kv_blocks"] = a.num_kv_blocks
    if a.max_model_len:
        kw["max_model_len"] = a.max_model_len
    return kw


def direct(model: Path, a, prompts, out_lens, warmup=None) -> tuple[dict, tuple]:
    """--direct: the engine process of `kiln llm serve` without the HTTP side. This process drives it over its
    pipe (EngineProcess) with `clients` closed-loop submitters, each sending its next request when its last
    ended, as the HTTP clients do; returns the served-run fields and the measured window (time.monotonic())."""
    from kiln.llm.sampling import SamplingParams
    from kiln.serve.async_engine import C_IDS, CHOICES, FINISHED, Sink
    from kiln.serve.engine_process import EngineProcess

    engine = EngineProcess(str(model), engine_kwargs(a), step_profile=str(a.step_profile_file),
                           engine_cpu=a.engine_cpu)
    results: list[dict] = []
    ms = 1000.0

    async def one(rid, prompt, n) -> dict:
        sink, t0, first, last, tokens = Sink(), time.perf_counter(), None, None, 0
        engine.add(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), sink)
        while True:
            for item in await sink.take():
                if not isinstance(item, tuple):
                    if isinstance(item, Exception) or hasattr(item, "message"):
                        raise RuntimeError(f"request {rid}: {item}")
                    continue  # ACCEPTED
                k = sum(len(c[C_IDS]) for c in item[CHOICES])
                if k:
                    last = time.perf_counter()
                    first = first or last
                    tokens += k
                if item[FINISHED]:
                    return {"ttft": first - t0, "e2e": last - t0, "tokens": tokens,
                            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}

    async def main():
        engine.start()
        await asyncio.gather(*(one(f"w{k}", prompts[0][:8], 4) for k in range(2)))
        if warmup:
            await asyncio.gather(*(one(f"wu{i}", p, n) for i, (p, n) in enumerate(zip(*warmup))))
        todo = iter(range(len(prompts)))

        async def client():
            for i in todo:
                results.append(await one(f"r{i}", prompts[i], out_lens[i]))

        cpu0 = cpu_seconds(engine.proc.pid)
        start, t0 = time.monotonic(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(a.clients)))
        wall = time.perf_counter() - t0
        return wall, (start, time.monotonic()), cpu_seconds(engine.proc.pid) - cpu0

    try:
        wall, window, cpu = asyncio.run(main())
    finally:
        engine.stop()
    ttft, tpot, e2e = ([r[k] for r in results if r[k] is not None] for k in ("ttft", "tpot", "e2e"))
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "errors": 0, "not_started": len(prompts) - len(results), "error_kinds": [],
            "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "req_s": len(results) / wall,
            "ttft_ms_p50": percentile(ttft, 0.5) * ms, "ttft_ms_p99": percentile(ttft, 0.99) * ms,
            "tpot_ms_p50": percentile(tpot, 0.5) * ms, "tpot_ms_p99": percentile(tpot, 0.99) * ms,
            "e2e_ms_p50": percentile(e2e, 0.5) * ms, "e2e_ms_p99": percentile(e2e, 0.99) * ms,
            "engine_cpu_cores": cpu / wall}, window


def offline(model: Path, a, prompts, out_lens, warmup=None, before_measure=None) -> dict:
    """before_measure(): called once the engine is loaded and warmed up, just before the measured run."""
    from kiln.llm.engine import LLMEngine

    engine = LLMEngine.from_model(str(model), **engine_kwargs(a))
    run_requests(engine, [prompts[0][:8]] * 2, [4, 4])  # warm-up, as the served run's
    if warmup:
        run_requests(engine, *warmup)
    if before_measure is not None:
        before_measure()
    profile = step_profile.StepProfile(engine)  # the phases the engine process records, for the offline run
    result = run_requests(engine, prompts, out_lens)
    result["step_records"] = profile.records
    return result


def host_steps(model: Path, a) -> None:
    """--host-steps: the engine's host CPU per full decode step (this thread's CPU time, the forward and the wait
    for its tokens left out), `clients` sequences of 16-token prompts and 48-token outputs, along each path:
    offline generate's (output_kind final_only, text made), the server's engine process's (kiln/serve/
    step_frames.py: no text, plain streams read off their sequences, the frame marshalled) and the thread
    backend's (output_kind delta, text made, a DeltaMaker's Deltas marshalled)."""
    import dataclasses
    import marshal
    import random
    import statistics

    from kiln.llm.engine import LLMEngine
    from kiln.llm.sampling import SamplingParams
    from kiln.serve.async_engine import DeltaMaker
    from kiln.serve.step_frames import StepEncoder

    clock, inner = time.thread_time, [0.0]  # CPU time inside the wrapped calls of the step under way

    def timed(fn):
        def call(*args):
            t = clock()
            try:
                return fn(*args)
            finally:
                inner[0] += clock() - t
        return call

    for path in ("offline", "engine process", "thread backend"):
        kw = engine_kwargs(a)
        kw.setdefault("num_kv_blocks", a.clients * 6 + 16)  # room for each sequence's 64 tokens in 16-token blocks
        engine = LLMEngine.from_model(str(model), **kw)
        runner = engine.runner
        runner.run_inputs, runner.collect = timed(runner.run_inputs), timed(runner.collect)
        streams, make, rng = StepEncoder(engine), DeltaMaker(), random.Random(0)
        for i in range(a.clients):
            p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, detokenize=path != "engine process")
            fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "extra"}
            kind = {"offline": "final_only", "thread backend": "delta"}.get(path) or streams.output_kind(fields)
            engine.add_request(f"r{i}", [rng.randrange(16, 300) for _ in range(16)],
                               dataclasses.replace(p, output_kind=kind))
            if path == "engine process":
                streams.add(f"r{i}", fields)
        host = []
        while engine.has_unfinished_requests():
            running = engine.scheduler.running
            full = len(running) == a.clients and all(s.num_computed_tokens >= s.prompt_len for s in running)
            inner[0], t = 0.0, clock()
            outs = engine.step()
            if path == "engine process":
                marshal.dumps(("step", [], [], *streams.encode(outs)[0], engine.stats(), None))
            elif path == "thread backend":
                marshal.dumps([make(o) for o in outs])
            if full:
                host.append(clock() - t - inner[0])
        print(f"{path:15s} host CPU per decode step of {a.clients} sequences: median "
              f"{statistics.median(host) * 1e3:.3f} ms, mean {statistics.mean(host) * 1e3:.3f} ms ({len(host)} steps)",
              flush=True)


def steps_report(records: list) -> dict:
    """Steps, mean ms per step and per phase, and mean batch, for decode-only steps and steps with prompt tokens."""
    out = {"steps": len(records), "step_s": sum(r[step_profile.TOTAL] for r in records)}
    for kind, rs in (("decode_only", [r for r in records if r[step_profile.DECODE]]),
                     ("with_prompt", [r for r in records if not r[step_profile.DECODE]])):
        out[kind] = {"steps": len(rs), "ms": step_profile.phase_means(rs) if rs else None,
                     "mean_seqs": sum(r[step_profile.N_SEQS] for r in rs) / len(rs) if rs else None,
                     "mean_tokens": sum(r[step_profile.N_TOKENS] for r in rs) / len(rs) if rs else None}
    return out


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
    lines = [f"| | {'engine process, no HTTP' if r.get('direct') else 'served (HTTP, streaming)'} | offline "
             "LLM.generate |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    if o:
        lines.append(f"\nServed / offline throughput: **{s['output_tok_s'] / o['output_tok_s']:.2f}**")
    if r.get("direct"):
        lines.append(f"\nDirect: the engine process driven over its pipe by {r['clients']} closed-loop submitters in this "
                     "process (no HTTP, no client processes); engine process CPU "
                     f"{s['engine_cpu_cores']:.2f} cores")
        return "\n".join(lines)
    busiest = f"{s['client_cpu_busiest'] * 100:.0f}%"
    each = s.get("http_cpu_cores_each") or [s["server_cpu_cores"]]
    http = (f"HTTP process {s['server_cpu_cores']:.2f} cores" if len(each) == 1 else
            f"{len(each)} HTTP processes {s['server_cpu_cores']:.2f} cores ({' / '.join(f'{c:.2f}' for c in each)})")
    lines.append(f"\nLoad generator: {s['client_processes']} client processes, {s['client_cpu_cores']:.2f} cores in "
                 f"all, the busiest at {busiest} of a core. Server CPU: {http}"
                 + (f", engine process {s['engine_cpu_cores']:.2f}" if s.get("engine_cpu_cores") is not None else ""))
    if len(s.get("requests_per_api_server") or {}) > 1:
        lines.append("\nRequests per HTTP process: " + ", ".join(
            f"{k}: {v}" for k, v in s["requests_per_api_server"].items()))
    if s["error_kinds"]:
        lines.append(f"\nErrors: {s['error_kinds']}")
    return "\n".join(lines)


def versions(device: str) -> dict:
    """What ran: Python, torch, Triton, and the GPU's name where one was used."""
    import platform

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if device != "cpu" and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


# The --suite runs: (name, serve_load.py arguments, seconds it may take). The tiny model's decode step is so short
# that the server's per-token host work shows; the 1B shape's step is a real model's. Each run's served half is
# bounded by --time-limit, its offline half by the request count.
SUITE = [
    ("tiny", ["--tiny", "--clients", "256", "--warmup", "256", "--requests", "1000", "--time-limit", "12"], 60.0),
    ("llama-1b", ["--random-model", "llama-1b", "--clients", "256", "--warmup", "256", "--requests", "500",
                  "--max-output", "128", "--time-limit", "15"], 90.0),
]
# Then, time left: the tiny model served with the tokenizers library's thread pool on in the HTTP processes (kiln
# llm serve turns it off there when it runs several), served half only.
SUITE_EXTRA = ("tiny, tokenizers' thread pool on", ["--tiny", "--clients", "256", "--warmup", "256", "--requests",
                                                    "1000", "--time-limit", "12", "--skip-offline"], 40.0,
               {"TOKENIZERS_PARALLELISM": "true"})


def suite(a) -> int:
    """--suite: each run in a process of its own (the GPU's memory freed between them), cut at its seconds
    (less if the budget has less left); its JSON kept even when the offline half was cut. OUT.md and OUT.json
    are rewritten after every run, so a suite cut from outside keeps what it finished."""
    began = time.monotonic()
    common = ["--device", a.device]
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": " ".join(["python", "bench/serve_load.py", *sys.argv[1:]]), "runs": []}
    runs = doc["runs"]
    extra_name, extra_args, extra_s, extra_env = SUITE_EXTRA
    for name, args, seconds, env in [*((n, x, t, {}) for n, x, t in SUITE), (extra_name, extra_args, extra_s,
                                                                            extra_env)]:
        args = [*args, "--api-servers", str(a.api_servers)]
        left = a.budget - (time.monotonic() - began) - 6  # a cut run gets 5 s to stop
        if left < (seconds if name == extra_name else 20):
            print(f"== {name}: not run, {left:.0f} s left of the budget", flush=True)
            if name != extra_name:
                runs.append({"name": name, "args": [*args, *common], "env": env, "skipped": True})
            continue
        limit = min(seconds, left)
        out = Path(tempfile.mkdtemp()) / "run.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *args, *common, "--json", str(out)]
        shown = " ".join([*(f"{k}={v}" for k, v in env.items()), "python bench/serve_load.py", *args, *common])
        print(f"== {name}: {shown} (at most {limit:.0f} s)", flush=True)
        t = time.monotonic()
        # Its own process group: a cut stops its server too.
        proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **env})
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
        run = {"name": name, "args": [*args, *common], "env": env, "rc": rc, "seconds": time.monotonic() - t}
        if out.exists():
            run["result"] = json.loads(out.read_text())
        runs.append(run)
        print(f"== {name}: {'cut at its time limit' if rc is None else f'exit {rc}'} after {run['seconds']:.0f} s",
              flush=True)
        Path(f"{a.out}.json").write_text(json.dumps(doc, indent=1))
        Path(f"{a.out}.md").write_text(suite_markdown(doc))
    Path(f"{a.out}.json").write_text(json.dumps(doc, indent=1))
    Path(f"{a.out}.md").write_text(suite_markdown(doc))
    print(f"wrote {a.out}.md and {a.out}.json", flush=True)
    return 0 if all(r.get("rc") == 0 for r in runs if not r.get("skipped")) else 1


def suite_markdown(doc: dict) -> str:
    results = [r["result"] for r in doc["runs"] if "result" in r]
    v = next((r["versions"] for r in results if "versions" in r), {})
    gpu = v.get("gpu", "the CPU")
    lines = [f"# Served against offline throughput on {gpu}", "",
             f"{doc['date']}, torch {v.get('torch', '?')}, Triton {v.get('triton', '-')}, Python "
             f"{v.get('python', '?')}; the server's engine in its own process, streaming clients on loopback "
             "(kiln llm serve --api-servers N: N HTTP processes in front of it). Target: served >= 90% of offline.",
             "", f"`{doc['command']}`", ""]
    for run in doc["runs"]:
        r = run.get("result")
        cmd = "`" + " ".join([*(f"{k}={v}" for k, v in run.get("env", {}).items()), "python bench/serve_load.py",
                              *run["args"]]) + "`"
        if r is None:
            why = ("not run (budget)" if run.get("skipped") else "cut at its time limit before a result"
                   if run.get("rc") is None else f"no result (exit {run['rc']})")
            lines += [f"## {run['name']}: {why}", "", cmd, ""]
            continue
        s, o = r["served"], r.get("offline")
        ratio = f"served / offline {s['output_tok_s'] / o['output_tok_s']:.2f}" if o else "served only"
        http = f"{r['api_servers']} HTTP process{'es' if r['api_servers'] != 1 else ''}"
        cut = "" if run.get("rc") == 0 else (" (cut at its time limit)" if run.get("rc") is None
                                              else f" (exit {run['rc']})")
        env = ", ".join(f"{k}={v}" for k, v in run.get("env", {}).items())
        lines += [f"## {r['model']}, {http}, {r['clients']} clients{f' ({env})' if env else ''}: {ratio}{cut}", "",
                  cmd, ""]
        lines += [r["markdown"] if "markdown" in r else render(r), ""]
    return "\n".join(lines)


# Random-weight checkpoints of real models' shapes, so the served/offline ratio sees a real step time.
RANDOM_MODELS = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                     tie_word_embeddings=True),  # Llama-3.2-1B's shape
}


def write_word_tokenizer(out: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json of a word-level vocabulary covering every id of the model ("<unk>",
    "<s>", "</s>", then "w3", "w4", ...), so every generated token decodes to a word and the detokenizer moves on
    as with a real tokenizer (ids outside a smaller vocabulary decode to nothing, and an incremental detokenizer
    then re-decodes a window that grows with the output)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"w{i}": i for i in range(len(specials), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "unk_token": "<unk>", "add_bos_token": False}))


def make_random_model(name: str, out: Path, max_positions: int = 2048) -> Path:
    """An HF Llama directory with random BF16 weights of RANDOM_MODELS[name]'s shape (made on the GPU when there
    is one) and a word-level tokenizer of its vocabulary (write_word_tokenizer): prompts are random token ids."""
    import torch
    from safetensors.torch import save_file

    from kiln.llm.config import ModelConfig
    from kiln.llm.model import expected_shapes
    out.mkdir(parents=True, exist_ok=True)
    shape = RANDOM_MODELS[name]
    write_word_tokenizer(out, shape["vocab_size"])
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
           "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, **shape}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)
    tensors = {}
    for key, shape in expected_shapes(ModelConfig.from_hf(cfg)).items():
        if len(shape) == 1:  # norm weights
            t = torch.ones(shape, dtype=torch.bfloat16, device=dev)
        else:
            t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        tensors[key] = t.cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors, t
    if dev == "cuda":
        torch.cuda.empty_cache()  # the server measures the free memory for its KV pool
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="HF directory, .gguf or .kiln LLM engine")
    p.add_argument("--tiny", action="store_true", help="serve the tiny test Llama (tests/llm/tiny.py)")
    p.add_argument("--random-model", choices=sorted(RANDOM_MODELS),
                   help="serve a random-weight BF16 model of this shape, written to a temporary folder")
    p.add_argument("--clients", type=int, default=256, help="concurrent clients, also max_num_seqs (default 256)")
    p.add_argument("--requests", type=int, default=2000, help="requests in all (default 2000)")
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds the served run may take (default 900)")
    p.add_argument("--max-output", type=int, help="cap on the drawn output lengths (a short run)")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--threads", type=int, help="torch intra-op threads of the server and the offline run alike "
                   "(OMP_NUM_THREADS; on a small shared CPU, 1 avoids OpenMP oversubscription)")
    p.add_argument("--client-procs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                   help="client processes the clients are spread over (default: a quarter of the cores, at most 4)")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="N unmeasured requests of the same length law, all at once, before the served and the "
                        "offline runs (first-use kernel compiles out of the measurement; default 0)")
    p.add_argument("--engine-cpu", default="none", metavar="auto|none|N",
                   help="kiln llm serve --engineCpu: the engine's step loop on a core of its own, the HTTP process "
                        "and the clients on the others; the offline run then steps on that core too (default none)")
    p.add_argument("--direct", action="store_true",
                   help="drive the server's engine process from this process, without HTTP or client processes "
                        "(the same closed-loop clients): is a slower served step the engine process's or the HTTP "
                        "side's?")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--host-steps", action="store_true",
                   help="only the engine's host CPU per full decode step along offline generate's path, the "
                        "server engine process's and the thread backend's (no server, no clients)")
    p.add_argument("--api-servers", type=int, default=4, metavar="N",
                   help="kiln llm serve --api-servers: HTTP processes in front of the one engine process (default 4)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--suite", action="store_true",
                   help="the tiny model and the random Llama-3.2-1B shape, served and offline, each bounded in "
                        "time (SUITE below), then, time left, the tiny model served with tokenizers' thread pool on; "
                        "writes OUT.md and OUT.json")
    p.add_argument("--out", metavar="OUT", help="--suite: the results' path without .md / .json")
    p.add_argument("--budget", type=float, default=160.0,
                   help="--suite: seconds for all its runs (a run that does not fit is not started; default 160)")
    a = p.parse_args(argv)
    if a.suite:
        if not a.out:
            p.error("--suite needs --out OUT")
        return suite(a)
    began = time.perf_counter()  # the served and offline lines say when they ended: where a bounded run's time goes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the server below
    if sum(map(bool, (a.model, a.tiny, a.random_model))) != 1:
        p.error("give one of MODEL, --tiny or --random-model")
    if a.tiny or a.random_model:
        sys.path.insert(0, str(ROOT))
    tmp = tempfile.TemporaryDirectory()
    a.step_profile_file = Path(tmp.name) / "engine-steps.json"
    if a.tiny:
        from tests.llm.tiny import make_tiny_llama

        model = make_tiny_llama(Path(tmp.name) / "tiny")
    elif a.random_model:
        t = time.perf_counter()
        model = make_random_model(a.random_model, Path(tmp.name) / a.random_model, a.max_model_len or 2048)
        print(f"random {a.random_model} written in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    else:
        model = Path(a.model)
    cfg = json.loads((model / "config.json").read_text()) if model.is_dir() else {}
    max_len = a.max_model_len or cfg.get("max_position_embeddings", 2048)
    pairs = sharegpt_like_lengths(a.requests, max_len)
    if a.max_output:
        pairs = [(i, min(o, a.max_output)) for i, o in pairs]
    prompts = random_prompts(cfg.get("vocab_size", 32000), [i for i, _ in pairs])
    out_lens = [o for _, o in pairs]
    warmup = None
    if a.warmup:  # other requests of the same law: the kernels the load needs are compiled before the clock runs
        w_pairs = [(i, min(o, a.max_output or o)) for i, o in sharegpt_like_lengths(a.warmup, max_len, seed=1)]
        warmup = (random_prompts(cfg.get("vocab_size", 32000), [i for i, _ in w_pairs], seed=1),
                  [o for _, o in w_pairs])
    if a.threads:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the server process inherits it
        torch.set_num_threads(a.threads)
    if a.host_steps:
        host_steps(model, a)
        tmp.cleanup()
        return 0
    placement = cpu_placement.placement(a.engine_cpu)  # the server makes the same choice
    def at() -> str:
        return f"[{time.perf_counter() - began:.0f} s into the run]"

    server = None  # told to stop once the clients are done; it exits while the offline engine loads

    def server_gone() -> None:
        nonlocal server
        if server is None:
            return
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        sys.stderr.write(server.stdout.read())  # the server's last lines (drain, the engine process's time)
        print(f"server exited {at()}", file=sys.stderr, flush=True)
        server = None

    if a.direct:
        served, window = direct(model, a, prompts, out_lens, warmup)
    else:
        server, port = start_server(model, a)
        print(f"server ready {at()}", file=sys.stderr, flush=True)
        try:
            served = load(f"http://127.0.0.1:{port}", prompts, out_lens, a.clients, a.time_limit, a.client_procs,
                          server.pid, warmup, placement and placement[1])
        finally:
            server.send_signal(signal.SIGTERM)
        window = served.pop("window")
    # Said now, so that a run cut short later still reports the served one.
    http_each = served.get("http_cpu_cores_each") or []
    print(f"served: {served['output_tok_s']:.1f} output tok/s, {served['requests']} requests in "
          f"{served['wall_s']:.2f} s, {served['errors']} errors; {len(http_each) or 1} HTTP process(es) "
          f"{served.get('server_cpu_cores') or 0:.2f} cores, engine process {served.get('engine_cpu_cores') or 0:.2f} "
          f"{at()}", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python", "bench/serve_load.py", *(argv or sys.argv[1:])]),
              "model": ("tiny Llama (tests/llm/tiny.py)" if a.tiny else f"random-weight {a.random_model} (BF16)"
                        if a.random_model else str(model)), "device": a.device,
              "clients": a.clients, "num_requests": a.requests, "threads": a.threads, "warmup": a.warmup,
              "engine_cpu": a.engine_cpu, "direct": a.direct, "api_servers": None if a.direct else a.api_servers,
              "mean_input_len": sum(len(x) for x in prompts) / len(prompts),
              "mean_output_len": sum(out_lens) / len(out_lens), "served": served}
    if a.json:  # the served half, kept should the offline half be cut
        Path(a.json).write_text(json.dumps(result, indent=1))
    offline_steps = []
    if not a.skip_offline:
        if placement:  # the offline engine steps where the served one did
            cpu_placement.pin(placement[0])
        result["offline"] = offline(model, a, prompts, out_lens, warmup, before_measure=server_gone)
        graphs, error = result["offline"].pop("cuda_graphs", None), result["offline"].pop("cuda_graph_error", None)
        if graphs or error:
            import torch

            print(f"offline engine: {torch.get_num_threads()} torch threads, CUDA graphs for decode batches {graphs}"
                  + (f"; capture failed: {error}" if error else ""), file=sys.stderr)
        offline_steps = result["offline"].pop("step_records")
        result["offline_steps"] = steps_report(offline_steps)
        print(f"offline: {result['offline']['output_tok_s']:.1f} output tok/s; served / offline "
              f"{served['output_tok_s'] / result['offline']['output_tok_s']:.2f} {at()}", flush=True)
    server_gone()
    # The engine process's steps while the clients were measured (not the warm-up's); the server wrote them at exit.
    served_steps = step_profile.load(a.step_profile_file) if a.step_profile_file.exists() else []
    served_steps = [r for r in served_steps if window[0] <= r[step_profile.START] <= window[1]]
    result["served_steps"] = steps_report(served_steps)
    result["versions"] = versions(a.device)
    body = [render(result),
            f"\nEngine steps, the server's engine process (measured window): {step_profile.summary(served_steps)}"]
    if not a.skip_offline:
        body.append(f"Engine steps, offline: {step_profile.summary(offline_steps)}")
        body.append("\nStep time by batch (ms per step; phases " + " / ".join(step_profile.PHASES) + "):\n")
        body.append(step_profile.comparison_table(served_steps, offline_steps))
    result["markdown"] = "\n".join(body)
    print(result["markdown"])
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    tmp.cleanup()
    return 0 if served["errors"] == 0 and served["not_started"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
