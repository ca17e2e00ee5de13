"""`kiln llm serve MODEL`: the OpenAI-compatible server (kiln/serve/openai_server.py) on one engine, or on N
engine replicas with --replicas N / --autoscale MIN:MAX (Ray Serve, kiln/serve/ray_serve.py).
--api-servers N runs N HTTP processes on the port in front of the one engine (kiln/serve/api_servers.py).

    kiln llm serve ./SmolLM2-135M --port 8000 --apiKey $KEY
    kiln llm serve ./SmolLM2-135M --api-servers 4
    curl -H "Authorization: Bearer $KEY" localhost:8000/v1/completions \\
         -d '{"model": "SmolLM2-135M", "prompt": "Hello", "max_tokens": 16}'

Binds 127.0.0.1 unless --host says otherwise. --apiKey (or KILN_API_KEY) makes every endpoint but /health
require `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import gc
import os


def cmd_serve(a) -> int:
    from kiln.engine.signing import load_key
    from kiln.errors import ConfigError
    from kiln.llm.cli import _engine_kwargs

    from . import cpu_placement
    from .api_servers import ApiServerPool
    from .engine_process import EngineProcess
    from .openai_server import OpenAIServer, run_server

    kw = _engine_kwargs(a)
    kw["seed"] = a.seed
    if a.api_servers < 1:
        raise ConfigError(f"--api-servers must be at least 1, not {a.api_servers}.")
    if a.replicas is not None or a.autoscale:
        if a.api_servers != 1:
            raise ConfigError("--api-servers is for the one-engine server; with --replicas/--autoscale Ray Serve's "
                              "proxy is the HTTP side.")
        return _serve_on_ray(a, kw)
    api_key = a.api_key or os.environ.get("KILN_API_KEY")
    pool = ApiServerPool(a.api_servers, a.host, a.port) if a.api_servers > 1 else None
    if pool:
        # Each process decodes only its share of a step's streams, a small batch, faster on the calling thread
        # than spread over the tokenizers library's thread pool; and N such pools would take cores from the engine.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = {"model_name": a.served_model_name, "api_key": api_key, "max_waiting": a.max_waiting,
                "drain_timeout": a.drain_timeout}
    engine = None
    try:
        placement = cpu_placement.placement(a.engine_cpu)
        engine = EngineProcess(a.model, kw, load_key(a.verify_key) if getattr(a, "verify_key", None) else None,
                               step_profile=a.step_profile, engine_cpu=a.engine_cpu, api_servers=a.api_servers,
                               max_waiting=a.max_waiting if pool else None,
                               on_spawn=pool and (lambda channels: pool.spawn(
                                   channels, {**settings, "cpus": sorted(placement[1]) if placement else None})))
        server = OpenAIServer(engine, **settings, metrics_dir=pool and pool.metrics_dir,
                              server_index=0 if pool else None)
        info = engine.info

        pinned = f", engine on CPU {min(engine.placement[0])}" if engine.placement else ""
        processes = f", {a.api_servers} HTTP processes" if pool else ""

        def ready(host, port):
            print(f"kiln llm serve: serving '{server.model_name}' on http://{host}:{port} "
                  f"({info.device}, {info.num_kv_blocks} KV blocks of {info.block_size} tokens, max_model_len "
                  f"{info.max_model_len}{pinned}{processes}{', API key required' if server.api_key else ''})",
                  flush=True)

        # What startup made (torch and the rest of Kiln are imported here too) lives until exit: out of the
        # collector's sight, its full passes while serving scan only what serving made. Without this, collections
        # took most of this process's time at a saturated stream rate (the per-token objects trigger them).
        gc.collect()
        gc.freeze()
        run_event_loop(run_server(server, a.host, a.port, ready, sock=pool and pool.sockets[0], pool=pool))
    finally:
        if engine is not None:
            engine.stop()
        if pool is not None:
            pool.close()
    return 0


def run_event_loop(main) -> None:
    """asyncio.run on uvloop's event loop where it is installed (kiln[serve]), else asyncio's own."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    if hasattr(uvloop, "run"):
        uvloop.run(main)
    else:  # uvloop before 0.18
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(main)


def _serve_on_ray(a, engine_kwargs: dict) -> int:
    from kiln.errors import ConfigError

    try:
        from . import ray_serve
    except ImportError as e:
        raise ConfigError(f"--replicas/--autoscale run on Ray Serve, which is not installed ({e}): "
                          "pip install 'kiln[ray]'.") from None
    autoscale = None
    if a.autoscale:
        try:
            lo, hi = (int(x) for x in a.autoscale.split(":"))
        except ValueError:
            raise ConfigError(f"--autoscale {a.autoscale!r}: write MIN:MAX replicas, e.g. 1:4.") from None
        if not 0 <= lo <= hi or hi < 1:
            raise ConfigError(f"--autoscale {a.autoscale!r}: need 0 <= MIN <= MAX and MAX >= 1.")
        autoscale = (lo, hi)
    elif a.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, not {a.replicas}.")
    if a.port == 0:
        raise ConfigError("--port 0 is not available with Ray Serve (its proxy needs a fixed port).")
    name = a.served_model_name or os.path.basename(os.path.normpath(a.model))
    api_key = a.api_key or os.environ.get("KILN_API_KEY")

    def ready(host, port):
        how = f"autoscaling {autoscale[0]}..{autoscale[1]}" if autoscale else f"{a.replicas}"
        print(f"kiln llm serve: serving '{name}' on http://{host}:{port} (Ray Serve, {how} replicas"
              f"{', API key required' if api_key else ''})", flush=True)

    ray_serve.run(a.model, engine_kwargs, host=a.host, port=a.port, replicas=a.replicas or 1,
                  ray_address=a.ray_address, ready=ready, model_name=name, api_key=api_key,
                  max_waiting=a.max_waiting, drain_timeout=a.drain_timeout, autoscale=autoscale)
    return 0


def add_llm_command(llm_sub) -> argparse.ArgumentParser:
    from kiln.llm.cli import _add_engine_options

    p = llm_sub.add_parser("serve", help="serve the model behind OpenAI's HTTP API (completions, chat, streaming)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $KILN_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL's name)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together (default 256)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests admitted beyond --maxNumSeqs before 429 (default 1024)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for admitted requests to finish (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-servers", type=int, default=1, metavar="N",
                   help="HTTP processes on the port, all in front of the one engine process, which batches their "
                        "requests together (default 1; more when one process's HTTP work cannot keep the engine's "
                        "batch full: many streams of a fast model)")
    p.add_argument("--engine-cpu", default="none", metavar="auto|none|N",
                   help="the engine process's step loop on a core of its own (auto: the last core; N: that CPU), "
                        "the HTTP process on the others (default none: the kernel places them)")
    p.add_argument("--step-profile", metavar="FILE", help="at exit, write every engine step's time, its phases and "
                   "its batch to FILE (JSON; kiln/serve/step_profile.py; bench/serve_load.py reads it)")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas on Ray Serve behind one endpoint (needs kiln[ray])")
    p.add_argument("--autoscale", metavar="MIN:MAX", help="Ray Serve autoscaling between MIN and MAX replicas")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one; "
                   "'auto' finds a running cluster)")
    p.set_defaults(func=cmd_serve)
    return p

