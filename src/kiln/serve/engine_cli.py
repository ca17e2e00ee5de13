"""`kiln serve ENGINE --replicas N`: a (non-LLM) engine on Ray Serve, speaking Triton's HTTP protocol.

    kiln serve model.kiln --replicas 2 --port 8000
    python -c "import tritonclient.http as h; ..."   # any KServe v2 / Triton HTTP client

See kiln/serve/ray_engine.py. For Triton Inference Server itself, use `kiln export triton`; for LLMs,
`kiln llm serve`.
"""

from __future__ import annotations

import argparse


def cmd_serve(a) -> int:
    import signal
    import threading
    from pathlib import Path

    from ..errors import ConfigError

    try:
        import ray
        from ray import serve

        from .ray_engine import application
    except ImportError as e:
        raise ConfigError(f"kiln serve runs on Ray Serve, which is not installed ({e}): pip install 'kiln[ray]'.") \
            from None
    if a.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, not {a.replicas}.")
    path = str(Path(a.engine).resolve())
    name = a.name or Path(a.engine).stem
    app = application(path, name=name, replicas=a.replicas, max_batch=a.max_batch)
    ray.init(address=a.ray_address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": a.host, "port": a.port})
    serve.run(app, name=f"kiln-{name}", route_prefix="/")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"kiln serve: serving '{name}' on http://{a.host}:{a.port} (Ray Serve, {a.replicas} replicas; "
          f"KServe v2 / Triton HTTP protocol)", flush=True)
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


def add_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve an engine on Ray Serve replicas (Triton's HTTP protocol)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", metavar="ENGINE", help="the engine file (.kiln); the same path on every node")
    p.add_argument("--replicas", type=int, default=1, metavar="N", help="engine replicas (default 1)")
    p.add_argument("--name", help="model name in the API (default: the engine file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", dest="max_batch", type=int, default=None,
                   help="rows Ray Serve batches per engine call (default: the profiles' largest batch)")
    p.add_argument("--ray-address", default=None, help="Ray cluster to join (default: start a local one)")
    p.set_defaults(func=cmd_serve)
    return p
