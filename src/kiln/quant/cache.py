"""Calibration caches: TensorRT's text format and Kiln's JSON form.

TensorRT's cache (what `IInt8Calibrator.writeCalibrationCache` writes and trtexec
`--calib=` reads):

    TRT-8601-EntropyCalibration2
    image: 3c010204
    relu1: 3d8f5c29

The first line names the TensorRT version (8601 = 8.6.1) and the calibrator;
then one line per tensor, "name: " and the big-endian hex of the float32 INT8
scale (amax / 127). Reading it back gives the same float32 scales. It holds
activation scales only: weights, statistics and histograms live in the JSON form
(a ".json" path), which round-trips everything Kiln measured.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..fileio import atomic_write_bytes
from .calibrators import DEFAULT_BINS, INT8_MAX, WeightScale

TRT_VERSION = "8601"
JSON_FORMAT = "kiln-calibration"
JSON_VERSION = 1
_METHOD_OF_TRT = {"EntropyCalibration2": "entropy", "EntropyCalibration": "entropy",
                  "MinMaxCalibration": "minmax", "PercentileCalibration": "percentile",
                  "LegacyCalibration": "legacy"}
_TRT_OF_METHOD = {"entropy": "EntropyCalibration2", "minmax": "MinMaxCalibration",
                  "percentile": "PercentileCalibration", "legacy": "LegacyCalibration"}
_HEADER = re.compile(r"^TRT-(\d+)-(\w+)$")


def float_to_hex(x: float) -> str:
    """float32 bits as 8 hex digits, most significant first (TensorRT's cache encoding)."""
    return struct.pack(">f", float(x)).hex()


def hex_to_float(text: str) -> float:
    h = text.strip().lower()
    h = h.removeprefix("0x")
    if not re.fullmatch(r"[0-9a-f]{1,8}", h):
        raise ValueError(f"'{text}' is not the hex of a float32")
    return struct.unpack(">f", bytes.fromhex(h.rjust(8, "0")))[0]


# --- TensorRT text ------------------------------------------------------------------------------------


def to_trt_text(cal, version: str = TRT_VERSION) -> str:
    lines = [f"TRT-{version}-{_TRT_OF_METHOD.get(cal.method, 'EntropyCalibration2')}"]
    for name, scale in cal.scales.items():
        if "\n" in name or "\r" in name:
            raise ConfigError(f"tensor name {name!r} cannot be written to a TensorRT calibration cache.")
        lines.append(f"{name}: {float_to_hex(scale)}")
    return "\n".join(lines) + "\n"


def from_trt_text(text: str, source: str = "calibration cache"):
    from .calibrate import Calibration, TensorStats

    lines = [ln.rstrip("\r") for ln in text.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise ConfigError(f"{source}: the file is empty; expected a TensorRT calibration cache "
                          "(first line like TRT-8601-EntropyCalibration2).")
    m = _HEADER.match(lines[0].strip())
    if not m:
        raise ConfigError(f"{source}: first line '{lines[0][:80]}' is not a TensorRT calibration cache header "
                          "(like TRT-8601-EntropyCalibration2).")
    version, algo = m.groups()
    tensors = {}
    for no, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        if ": " not in line:
            raise ConfigError(f"{source}, line {no}: '{line[:80]}' should be 'tensor_name: <hex float32 scale>'.")
        name, h = line.rsplit(": ", 1)
        try:
            scale = hex_to_float(h)
        except ValueError:
            raise ConfigError(f"{source}, line {no}: '{h.strip()[:40]}' is not the hex of a float32 scale.") from None
        if not np.isfinite(scale) or scale < 0:
            raise ConfigError(f"{source}, line {no}: tensor '{name}' has scale {scale}; scales are finite and >= 0.")
        s = TensorStats(name)
        s.amax = float(np.float32(scale)) * INT8_MAX  # exact: the scale re-derived from it is the same float32
        tensors[name] = s
    method = _METHOD_OF_TRT.get(algo, algo)
    return Calibration(method=method, tensors=tensors, engine={"trt_version": version, "trt_calibrator": algo})


# --- JSON ---------------------------------------------------------------------------------------------


def to_json(cal, histograms: bool = True) -> dict:
    tensors = {}
    for name, s in cal.tensors.items():
        d = {"amax": s.amax, "scale": s.scale if s.amax is not None else None,
             "fp8_scale": s.fp8_scale if s.amax is not None else None,
             "count": s.count, "min": s.min, "max": s.max, "sum": s.sum, "sumsq": s.sumsq, "zeros": s.zeros,
             "nonfinite": s.nonfinite, "hist_max": s.hist_max}
        if histograms and s.hist is not None:
            d["hist"] = [int(c) for c in s.hist]
        tensors[name] = d
    return {
        "format": JSON_FORMAT, "version": JSON_VERSION, "method": cal.method, "percentile": cal.percentile,
        "num_bins": cal.num_bins, "samples": cal.samples, "seconds": cal.seconds, "engine": cal.engine,
        "inputs": cal.inputs, "tensors": tensors,
        "weights": {k: w.to_json() for k, w in cal.weights.items()},
    }


def from_json(d: dict, source: str = "calibration file"):
    from .calibrate import Calibration, TensorStats

    if not isinstance(d, dict) or d.get("format") != JSON_FORMAT:
        raise ConfigError(f"{source}: not a Kiln calibration JSON (no \"format\": \"{JSON_FORMAT}\").")
    if d.get("version", 0) > JSON_VERSION:
        raise ConfigError(f"{source}: written by a newer Kiln (calibration format {d['version']}, this Kiln "
                          f"reads up to {JSON_VERSION}).")
    try:
        tensors = {}
        for name, t in d["tensors"].items():
            s = TensorStats(name, count=int(t.get("count", 0)), min=t.get("min"), max=t.get("max"),
                            sum=float(t.get("sum", 0.0)), sumsq=float(t.get("sumsq", 0.0)),
                            zeros=int(t.get("zeros", 0)), nonfinite=int(t.get("nonfinite", 0)),
                            hist_max=float(t.get("hist_max", 0.0)), amax=t.get("amax"))
            if t.get("hist") is not None:
                s.hist = np.asarray(t["hist"], dtype=np.int64)
            tensors[name] = s
        weights = {k: WeightScale.from_json(k, w) for k, w in d.get("weights", {}).items()}
        return Calibration(method=d["method"], tensors=tensors, weights=weights, samples=int(d.get("samples", 0)),
                           percentile=d.get("percentile"), num_bins=int(d.get("num_bins", DEFAULT_BINS)),
                           inputs=d.get("inputs", {}), engine=d.get("engine", {}), seconds=d.get("seconds"))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{source}: malformed calibration JSON ({type(e).__name__}: {e}).") from None


# --- files --------------------------------------------------------------------------------------------


def save(cal, path, format: str | None = None, histograms: bool = True) -> None:
    fmt = (format or ("json" if str(path).lower().endswith(".json") else "trt")).lower()
    if fmt == "trt":
        text = to_trt_text(cal)
    elif fmt == "json":
        text = json.dumps(to_json(cal, histograms), indent=1, allow_nan=False) + "\n"
    else:
        raise ConfigError(f"calibration cache format must be 'trt' or 'json', not '{format}'.")
    atomic_write_bytes(path, text.encode())


def load(path):
    """A calibration from a TensorRT text cache or Kiln's JSON form (told apart by content)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"calibration cache '{path}' does not exist.")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"calibration cache '{path}' cannot be read as text ({e}).") from None
    if text.lstrip().startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"calibration cache '{path}': invalid JSON ({e}).") from None
        return from_json(d, f"calibration cache '{path}'")
    return from_trt_text(text, f"calibration cache '{path}'")
