"""`kiln llm serve MODEL`: the OpenAI-compatible server (kiln/serve/openai_server.py) on one engine.

    kiln llm serve ./SmolLM2-135M --port 8000 --api-key $KEY
    curl -H "Authorization: Bearer $KEY" localhost:8000/v1/completions \\
         -d '{"model": "SmolLM2-135M", "prompt": "Hello", "max_tokens": 16}'

Binds 127.0.0.1 unless --host says otherwise. --api-key (or KILN_API_KEY) makes every endpoint but /health
require `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import os


def cmd_serve(a) -> int:
    import asyncio

    from kiln.llm.cli import _engine_kwargs
    from kiln.llm.engine import LLMEngine

    from .openai_server import OpenAIServer, run_server

    kw = _engine_kwargs(a)
    kw["seed"] = a.seed
    engine = LLMEngine.from_model(a.model, **kw)
    server = OpenAIServer(engine, model_name=a.served_model_name, api_key=a.api_key or os.environ.get("KILN_API_KEY"),
                          max_waiting=a.max_waiting, drain_timeout=a.drain_timeout)

    def ready(host, port):
        print(f"kiln llm serve: serving '{server.model_name}' on http://{host}:{port} "
              f"({engine.device}, {engine.block_manager.num_blocks} KV blocks of {engine.block_manager.block_size}"
              f" tokens, max_model_len {engine.max_model_len}"
              f"{', API key required' if server.api_key else ''})", flush=True)

    asyncio.run(run_server(server, a.host, a.port, ready))
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
                   help="requests admitted beyond --max-num-seqs before 429 (default 1024)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for admitted requests to finish (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_serve)
    return p

