"""The timing cache: tactic timings keyed by GPU, software versions and layer signature.

A JSON file (--timingCacheFile), so rebuilds skip timing layers they have seen.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import ConfigError
from ..fileio import atomic_write_bytes

VERSION = 3  # 2: only what each tactic did on the layer (not build-dependent exclusions); 3: weights out of L2


def layer_key(target, versions: dict, node, args: list) -> str:
    attrs = {k: v for k, v in sorted(node.attrs.items()) if isinstance(v, (int, float, str, list))}
    sig = {
        "gpu": [target.name, target.capability],
        "versions": [versions.get(k) for k in ("kiln", "torch", "triton", "cuda", "cudnn")],
        "op": [node.domain, node.op_type, node.precision], "attrs": attrs,
        "inputs": [None if a is None else [list(a.shape), str(a.dtype), list(a.stride())]
                   for a in args if a is None or isinstance(a, torch.Tensor)],
    }
    return hashlib.sha256(json.dumps(sig, sort_keys=True, default=str).encode()).hexdigest()[:32]


class TimingCache:
    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.entries: dict[str, dict] = {}
        self.hits = self.misses = 0
        if self.path and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
                raise ConfigError(f"--timingCacheFile '{self.path}' is not a Kiln timing cache ({e}); "
                                  "delete it or pass another path.") from None
            if data.get("version") == VERSION:
                self.entries = data.get("entries", {})

    def get(self, key: str) -> dict | None:
        hit = self.entries.get(key)
        if hit is None:
            self.misses += 1
        else:
            self.hits += 1
        return hit

    def put(self, key: str, value: dict) -> None:
        self.entries[key] = value

    def save(self) -> None:
        if not self.path:
            return
        atomic_write_bytes(self.path, json.dumps({"version": VERSION, "entries": self.entries}).encode())
