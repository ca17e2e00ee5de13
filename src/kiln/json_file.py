"""JSON files of results (reports, comparisons, inspections): numpy and torch values converted, NaN and
infinities written as strings (JSON has neither), the file written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .fileio import atomic_write_bytes


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _finite_json(o):
    """JSON has no NaN/Infinity: write them as strings so any parser reads the file."""
    if isinstance(o, float) and not np.isfinite(o):
        return "NaN" if np.isnan(o) else ("Infinity" if o > 0 else "-Infinity")
    if isinstance(o, dict):
        return {k: _finite_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite_json(v) for v in o]
    return o


def to_json_text(obj) -> str:
    """obj as indented JSON: numpy and torch values converted, NaN and infinities as strings."""
    return json.dumps(_finite_json(json.loads(json.dumps(obj, default=_json_default))), indent=2) + "\n"


def atomic_write_json(path, obj) -> None:
    atomic_write_bytes(path, to_json_text(obj).encode("utf-8"))
