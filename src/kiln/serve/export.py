"""`kiln export TARGET ENGINE`: an engine packaged for a serving system (today: Triton Inference Server)."""

from __future__ import annotations

import argparse

from ..tools.engine_args import add_verify_key_flag


def cmd_export_triton(a) -> int:
    from rich.console import Console

    from ..engine.serialize import read_manifest
    from ..tools.engine_args import verify_key_of
    from .triton_repo import export_triton

    key = verify_key_of(a)
    if key is not None:  # the file copied into the repository is the one whose signature was checked here
        read_manifest(a.engine, key)
    folder = export_triton(a.engine, a.repo, name=a.name, instances=a.instances, max_batch=a.max_batch)
    Console(highlight=False).print(f"Triton model '{folder.name}' written to {folder} "
                                   f"(start it with: tritonserver --model-repository={folder.parent})")
    return 0


def add_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="package an engine for a serving system (triton)")
    targets = p.add_subparsers(dest="target", required=True)
    t = targets.add_parser("triton", help="write a Triton Inference Server model repository (Python backend)")
    t.add_argument("engine", metavar="ENGINE", help="the engine file (.kiln)")
    t.add_argument("--repo", required=True, metavar="DIR", help="model repository folder (created if missing)")
    t.add_argument("--name", metavar="N", help="model name (default: the engine file's stem)")
    t.add_argument("--instances", type=int, default=1, metavar="K",
                   help="model instances (instance_group count; KIND_GPU for a GPU engine, KIND_CPU for a CPU one)")
    t.add_argument("--max-batch", dest="max_batch", type=int, default=None, metavar="B",
                   help="max_batch_size (default: the profiles' largest batch; 0 turns batching off)")
    add_verify_key_flag(t)
    t.set_defaults(func=cmd_export_triton)
    return p
