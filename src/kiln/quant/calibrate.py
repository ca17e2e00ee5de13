"""Post-training calibration: per-tensor activation statistics on an FP32 engine, then scales.

    cal = kiln.quant.calibrate("model.onnx", "calib.npz", method="entropy")
    cal.scales["relu1"]          # INT8 scale (amax / 127) of one tensor
    cal.save("model.calib")      # TensorRT's text cache; "model.calib.json" for the JSON form
    cal = kiln.quant.Calibration.load("model.calib")

The data: a .npz keyed by input name (batches are cut to fit the profile), a .npy
(single-input models), NAME:FILE.npy,..., a folder of .npz files, or any iterable
of {input name: array} dicts. The statistics are taken on an FP32 engine built
for the same target (or the FP32 engine you pass), on every input and every
device layer's output: the tensors the INT8 layers of that engine will read and
write (names are the engine's, after fusion: a fused Conv+Relu's output is the
Relu's output). Min/max take one pass over the data; the Entropy and Percentile
calibrators take a second pass that fills a histogram of |x| over [0, max |x|].
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, InputError, ShapeError
from ..ir import dtypes
from ..ir.shapes import fmt_shape
from ..progress import progress as show_progress
from ..samples import load_samples, split_to_profile
from .calibrators import (
    DEFAULT_BINS,
    WeightScale,
    fp8_e4m3_scale,
    get_calibrator,
    int8_scale,
    weight_scales,
)

MIN_SAMPLES = 100
DIVERSITY_ROWS = 4096  # rows of each input kept to measure how varied the calibration set is
DIVERSITY_ELEMENTS = 16_000_000  # ...and at most this many values


class CalibrationWarning(UserWarning):
    pass


# --- statistics ---------------------------------------------------------------------------------------


@dataclass
class TensorStats:
    """What calibration saw of one tensor, and the amax its calibrator chose."""

    name: str
    count: int = 0  # values seen (0 for a calibration read back from a TensorRT cache)
    min: float | None = None
    max: float | None = None
    sum: float = 0.0
    sumsq: float = 0.0
    zeros: int = 0
    nonfinite: int = 0  # NaN/Inf values, left out of every statistic
    hist: np.ndarray | None = None  # counts of |x| in num_bins equal bins over [0, hist_max]
    hist_max: float = 0.0
    amax: float | None = None

    @property
    def absmax(self) -> float | None:
        if self.min is None or self.max is None:
            return None
        return max(abs(self.min), abs(self.max))

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    @property
    def std(self) -> float | None:
        if not self.count:
            return None
        m = self.sum / self.count
        return math.sqrt(max(self.sumsq / self.count - m * m, 0.0))

    @property
    def zero_fraction(self) -> float | None:
        return self.zeros / self.count if self.count else None

    @property
    def scale(self) -> float:
        return int8_scale(self.amax or 0.0)

    @property
    def fp8_scale(self) -> float:
        return fp8_e4m3_scale(self.amax or 0.0)

    def clip_fraction(self) -> float | None:
        """Fraction of the calibration values with |x| > amax, read from the histogram (to one bin)."""
        if self.amax is not None and self.count and self.absmax is not None and self.amax >= self.absmax:
            return 0.0  # nothing the calibration saw lies beyond amax (always so for MinMax)
        if self.hist is None or self.amax is None or not self.hist.sum():
            return None if self.hist is None else 0.0
        if self.hist_max <= 0:
            return 0.0
        first = round(self.amax / self.hist_max * self.hist.size)
        return float(self.hist[first:].sum() / self.hist.sum())

    def summary(self) -> dict:
        return {"name": self.name, "amax": self.amax, "scale": self.scale, "fp8_scale": self.fp8_scale,
                "min": self.min, "max": self.max, "absmax": self.absmax, "mean": self.mean, "std": self.std,
                "zero_fraction": self.zero_fraction, "count": self.count, "nonfinite": self.nonfinite,
                "clip_fraction": self.clip_fraction()}


class _Collector:
    """Accumulates statistics of every float tensor it is shown.

    ranges=True: count/min/max/sum/sumsq/zeros. hist_ranges {name: top}: a histogram of |x| over
    [0, top] plus, as `over`, the count above top. thresholds {name: t}: counts of |x| > t.
    bounds {name: (lo, hi)}: counts of x outside [lo, hi]."""

    def __init__(self, num_bins: int = DEFAULT_BINS, ranges: bool = True, hist_ranges: dict | None = None,
                 thresholds: dict | None = None, bounds: dict | None = None,
                 stats: dict[str, TensorStats] | None = None):
        self.num_bins = num_bins
        self.ranges = ranges
        self.hist_ranges = hist_ranges
        self.thresholds = thresholds or {}
        self.bounds = bounds or {}
        self.stats: dict[str, TensorStats] = stats if stats is not None else {}
        self.over: dict[str, int] = {}
        self.above: dict[str, int] = {}
        self.outside: dict[str, int] = {}

    def add(self, name: str, t) -> None:
        if not name or not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
            return
        x = t.detach().float().reshape(-1)
        if self.ranges:
            s = self.stats.get(name)
            if s is None:
                s = self.stats[name] = TensorStats(name)
            bad, lo, hi, total, squares, zeros = _moments(x)  # one device sync per tensor
            if bad:
                x = x[torch.isfinite(x)]
                _, lo, hi, total, squares, zeros = _moments(x) if x.numel() else (0, None, None, 0.0, 0.0, 0)
            s.nonfinite += int(bad)
            if x.numel():
                s.min = lo if s.min is None else min(s.min, lo)
                s.max = hi if s.max is None else max(s.max, hi)
                s.sum += total
                s.sumsq += squares
                s.zeros += int(zeros)
                s.count += x.numel()
        elif not bool(torch.isfinite(x).all()):
            x = x[torch.isfinite(x)]
        if not x.numel():
            return
        a = None
        if self.hist_ranges is not None and name in self.hist_ranges:
            top = float(self.hist_ranges[name])
            a = x.abs()
            s = self.stats.get(name)
            if s is None:
                s = self.stats[name] = TensorStats(name)
            if s.hist is None:
                s.hist, s.hist_max = np.zeros(self.num_bins, np.int64), top
            if top <= 0:
                s.hist[0] += int((a == 0).sum())
                over = int((a > 0).sum())
            else:  # histc leaves out the values above top, which `over` counts
                counts = torch.histc(a, bins=self.num_bins, min=0.0, max=top)
                s.hist += counts.cpu().numpy().astype(np.int64)
                over = a.numel() - int(counts.sum(dtype=torch.float64))
            self.over[name] = self.over.get(name, 0) + over
        if name in self.thresholds:
            a = x.abs() if a is None else a
            self.above[name] = self.above.get(name, 0) + int((a > self.thresholds[name]).sum())
        if name in self.bounds:
            lo, hi = self.bounds[name]
            self.outside[name] = self.outside.get(name, 0) + int(((x < lo) | (x > hi)).sum())


def _moments(x: torch.Tensor) -> tuple:
    """(non-finite count, min, max, sum, sum of squares, zero count) of a 1-D float tensor, read back in one
    device sync (a sync per statistic made calibration's statistics cost as much as its forward passes)."""
    f64 = torch.float64
    wide = x.to(f64)  # squares of FP32 values past 1.8e19 (an additive mask's finfo.min) overflow FP32
    vals = torch.stack([(~torch.isfinite(x)).sum().to(f64), x.min().to(f64), x.max().to(f64), wide.sum(),
                        wide.square().sum(), (x == 0).sum().to(f64)]).tolist()
    return int(vals[0]), vals[1], vals[2], vals[3], vals[4], int(vals[5])


# --- the result ---------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Per-tensor activation amax/scales (INT8: amax/127, FP8 E4M3: amax/448) and per-channel weight scales."""

    method: str
    tensors: dict[str, TensorStats]
    weights: dict[str, WeightScale] = field(default_factory=dict)
    samples: int = 0
    percentile: float | None = None
    num_bins: int = DEFAULT_BINS
    inputs: dict[str, dict] = field(default_factory=dict)  # per engine input: how varied the set was
    engine: dict = field(default_factory=dict)  # what it was measured on: device, precision, inputs
    seconds: float | None = None

    @property
    def amax(self) -> dict[str, float]:
        return {k: s.amax for k, s in self.tensors.items() if s.amax is not None}

    @property
    def scales(self) -> dict[str, float]:
        """INT8 scale per tensor."""
        return {k: s.scale for k, s in self.tensors.items() if s.amax is not None}

    @property
    def fp8_scales(self) -> dict[str, float]:
        """FP8 E4M3 scale per tensor."""
        return {k: s.fp8_scale for k, s in self.tensors.items() if s.amax is not None}

    @property
    def weight_scales(self) -> dict[str, np.ndarray]:
        return {k: w.scales for k, w in self.weights.items()}

    def missing_for(self, engine) -> list[str]:
        """Float tensors an engine's device layers read or write (and its inputs) that have no scale here:
        empty when this calibration covers the engine (same model, same fusions)."""
        have = self.scales
        names = [v.name for v in engine.inputs if v.dtype is None or v.dtype.is_floating_point]
        for node in engine.graph.nodes:
            if node.placement == "device":
                names += [o for o in node.outputs if o]
        out_types = {v.name: v.dtype for v in engine.outputs}
        names = [n for n in dict.fromkeys(names)
                 if n not in engine.graph.initializers and (out_types.get(n) is None or out_types[n].is_floating_point)]
        return [n for n in names if n not in have]

    def histograms(self) -> list[dict]:
        """Per-tensor summary (range, mean/std, zero fraction, chosen amax, clipped fraction)."""
        return [s.summary() for s in self.tensors.values()]

    def save(self, path, format: str | None = None) -> None:
        """format "trt" (TensorRT's text cache) or "json"; by default JSON when the path ends in .json."""
        from .cache import save

        save(self, path, format)

    @classmethod
    def load(cls, path) -> Calibration:
        from .cache import load

        return load(path)

    def render(self) -> str:
        lines = [f"calibration: {self.method}"
                 + (f" ({self.percentile}th percentile)" if self.method == "percentile" else "")
                 + f", {self.samples} samples, {len(self.tensors)} tensors, {len(self.weights)} weights"]
        lines.append(f"  {'tensor':30} {'min':>10} {'max':>10} {'amax':>10} {'int8 scale':>12} {'clipped':>9}")
        for s in self.tensors.values():
            clip = s.clip_fraction()
            lines.append(f"  {s.name[:30]:30} {_num(s.min):>10} {_num(s.max):>10} {_num(s.amax):>10} "
                         f"{s.scale:12.5g} {('-' if clip is None else f'{100 * clip:.3f}%'):>9}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Calibration(method={self.method!r}, samples={self.samples}, tensors={len(self.tensors)}, "
                f"weights={len(self.weights)})")


def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"


# --- data ---------------------------------------------------------------------------------------------


def _as_array(x, name: str, where: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.detach().cpu().numpy()
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - anything numpy refuses
        raise InputError(f"{where}: input '{name}' cannot be read as an array ({e}).") from None
    if a.dtype.kind in "OUSV":
        raise InputError(f"{where}: input '{name}' holds {a.dtype} values, not numbers.")
    return a


def _torch_dtype(a: np.ndarray):
    try:
        return torch.from_numpy(np.empty(0, a.dtype)).dtype
    except TypeError:
        return None


def prepare_samples(data, inputs, what: str = "calibration data", engine=None, profile: int = 0):
    """Read and check samples. inputs: the model's input Values. Returns (feed dicts, sample rows).
    Errors name the input and the item: unknown/missing names, wrong dtype, wrong rank or a fixed
    dimension that differs, shapes outside the engine's profile, NaN/Inf."""
    names = [v.name for v in inputs]
    raw = load_samples(data, names, what)
    if not raw:
        raise InputError(f"{what}: no samples.")
    by_name = {v.name: v for v in inputs}
    samples, rows = [], 0
    for k, item in enumerate(raw):
        where = f"{what}, item {k}" if len(raw) > 1 else what
        unknown = [n for n in item if n not in by_name and n != "labels"]
        missing = [n for n in names if n not in item]
        if unknown or missing:
            parts = ([f"{unknown} are not inputs of the model"] if unknown else []) + \
                    ([f"inputs {missing} are missing"] if missing else [])
            raise InputError(f"{where}: {' and '.join(parts)}; the model's inputs are {names}.")
        feeds = {}
        for n in names:
            v = by_name[n]
            a = _as_array(item[n], n, where)
            got = _torch_dtype(a)
            if v.dtype is not None and got != v.dtype:
                want = dtypes.name_of(v.dtype)
                raise InputError(f"{where}: input '{n}' is {a.dtype} but the model expects {want}; convert it "
                                 f"first (e.g. array.astype(np.{want if want != 'bool' else 'bool_'})).")
            if v.shape is not None:
                if a.ndim != len(v.shape):
                    raise ShapeError(f"{where}: input '{n}' has rank {a.ndim} (shape {list(a.shape)}) but the "
                                     f"model expects rank {len(v.shape)} ({fmt_shape(v.shape)}).")
                for axis, (d, m) in enumerate(zip(a.shape, v.shape)):
                    if isinstance(m, int) and d != m:
                        raise ShapeError(f"{where}: input '{n}' axis {axis} is {d}, but the model fixes it at "
                                         f"{m} ({fmt_shape(v.shape)}).")
            if a.dtype.kind == "f" and a.size and not np.isfinite(a).all():
                raise InputError(f"{where}: input '{n}' contains NaN or Inf values; calibration ranges would "
                                 "be meaningless. Remove those samples.")
            feeds[n] = a
        first = feeds[names[0]] if names else None
        rows += int(first.shape[0]) if first is not None and first.ndim else 1
        samples.append(feeds)
    if engine is not None:
        samples = split_to_profile(engine, samples, profile)
        ctx = engine.create_execution_context(profile=profile, cuda_graphs=False)
        for k, feeds in enumerate(samples):
            for n, a in feeds.items():
                try:
                    ctx.check_shape(n, tuple(a.shape))
                except ShapeError as e:
                    raise ShapeError(f"{what}: {e}") from None
    return samples, rows


def rebatch(samples: list[dict], inputs, batch_size: int | None, model_or_engine, build_config) -> list[dict]:
    """Cut samples into batches of at most batch_size rows, where every input has a dynamic axis 0 and
    all of a sample's inputs share its length (the last batch may be smaller). Only for a model whose FP32
    engine Kiln profiles itself: an engine's, or the caller's own profiles, take the samples as they are."""
    if _is_engine(model_or_engine) or (build_config and (build_config.profiles or build_config.shapes)):
        return samples
    if not batch_size or not all(v.shape and not isinstance(v.shape[0], int) for v in inputs):
        return samples
    out = []
    for s in samples:
        ns = {a.shape[0] if a.ndim else None for a in s.values()}
        n = next(iter(ns))
        if len(ns) != 1 or n is None or n <= batch_size:
            out.append(s)
            continue
        out += [{k: a[i:i + batch_size] for k, a in s.items()} for i in range(0, n, batch_size)]
    return out


def diversity(samples: list[dict], inputs) -> dict[str, dict]:
    """How varied each float input is across sample rows (axis 0): rows, distinct rows, the mean over
    elements of the across-row std (`spread`), the std of all values, and their ratio (0: identical rows)."""
    out = {}
    for v in inputs:
        arrays = [s[v.name] for s in samples if v.name in s]
        if not arrays or arrays[0].dtype.kind != "f" or arrays[0].ndim == 0:
            continue
        if len({a.shape[1:] for a in arrays}) != 1:
            continue  # rows of different shapes cannot be compared element by element
        per_row = max(1, int(np.prod(arrays[0].shape[1:])))
        limit = min(DIVERSITY_ROWS, max(2, DIVERSITY_ELEMENTS // per_row))  # bounded memory for big inputs
        taken, n = [], 0
        for a in arrays:
            if n >= limit:
                break
            taken.append(a[:limit - n])
            n += len(taken[-1])
        x = np.concatenate(taken, axis=0).reshape(n, -1).astype(np.float64)
        distinct = len({r.tobytes() for r in x})
        spread = float(x.std(axis=0).mean()) if x.shape[0] > 1 else 0.0
        total = float(x.std())
        out[v.name] = {"rows": int(x.shape[0]), "distinct": distinct, "spread": spread, "std": total,
                       "spread_ratio": spread / total if total > 0 else 0.0}
    return out


# --- engines ------------------------------------------------------------------------------------------


def _is_engine(obj) -> bool:
    from ..engine.engine import Engine

    return isinstance(obj, Engine)


def model_inputs(model):
    """(graph or None, input Values) of a model path / ModelProto / Graph / Engine."""
    if _is_engine(model):
        return None, model.inputs
    from ..ir.graph import Graph

    if isinstance(model, Graph):
        return model, model.inputs
    import onnx

    from ..frontend.onnx_loader import load_onnx
    from ..ir.from_onnx import model_to_graph

    proto = model if isinstance(model, onnx.ModelProto) else load_onnx(model)
    g = model_to_graph(proto)
    return g, g.inputs


def fp32_engine(model, samples: list[dict], device: str = "auto", build_config=None, what: str = "calibration"):
    """The engine statistics are taken on: `model` itself if it is an FP32 engine, else an FP32 build of
    it whose profile spans the samples' shapes (or build_config's profiles)."""
    from ..builder.config import BuildConfig
    from ..engine.profile import Profile

    if _is_engine(model):
        if model.precision not in ("float32", "tf32"):
            raise ConfigError(f"{what} needs an FP32 engine, but this one was built for {model.precision}: its "
                              "activations differ from the model's. Pass the model (Kiln builds an FP32 engine "
                              "for the same target) or an FP32 engine.")
        return model
    graph, inputs = model_inputs(model)
    if build_config is not None:
        cfg = BuildConfig(**{k: getattr(build_config, k) for k in build_config.__dataclass_fields__})
        cfg.fp16 = cfg.bf16 = cfg.tf32 = False
    else:
        cfg = BuildConfig(device=device)
    cfg.progress = False
    # The engine only runs layer by layer, eagerly, on the calibration data: timing its tactics and a validation
    # run would cost build time (on a GPU, compiling and timing FP32 kernels no engine keeps) for nothing.
    cfg.int8 = cfg.fp8 = False
    cfg.optimization_level, cfg.validate = 0, False
    if not cfg.profiles and not cfg.shapes:
        shapes = {}
        for v in inputs:
            dims = [tuple(s[v.name].shape) for s in samples]
            lo = tuple(int(min(d[a] for d in dims)) for a in range(len(dims[0])))
            hi = tuple(int(max(d[a] for d in dims)) for a in range(len(dims[0])))
            shapes[v.name] = (lo, hi, hi)
        cfg.profiles = [Profile(shapes)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ..builder.builder import build_engine

        return build_engine(graph, cfg)


def run_pass(engine, samples: list[dict], col: _Collector, profile: int = 0, progress: bool = True,
             label: str = "kiln calibrate", step: str = "") -> None:
    """Run every sample through the engine, showing each input and device-layer output to `col`."""
    ctx = engine.create_execution_context(profile=profile, cuda_graphs=False)
    dev = engine.target.device
    display = show_progress(label, len(samples), step) if progress else contextlib.nullcontext()
    with display as bar:
        for feeds in samples:
            tensors = {k: dtypes.to_torch(a).to(dev) for k, a in feeds.items()}
            for k, t in tensors.items():
                col.add(k, t)

            def observer(node, outs):
                if outs is not None:
                    for name, t in zip(node.outputs, outs):
                        col.add(name, t)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ctx.run_layerwise(tensors, observer)
            if bar is not None:
                bar.advance(step)


# --- the entry point ----------------------------------------------------------------------------------


def calibrate(model_or_engine, data=None, method: str = "entropy", percentile: float = 99.99, *,
              cache=None, profile: int = 0, device: str = "auto", build_config=None,
              num_bins: int = DEFAULT_BINS, progress: bool = True, min_samples: int = MIN_SAMPLES,
              batch_size: int | None = 32) -> Calibration:
    """Calibrate: per-tensor amax/scales with `method` ("entropy", "minmax", "percentile").

    model_or_engine: an ONNX path / ModelProto / kiln Graph (an FP32 engine is built for `device`, or
    per `build_config` with its precision forced to FP32), or an FP32 Engine. data: see the module doc.
    With a model and no profiles of your own, samples run in batches of up to `batch_size` rows (the
    FP32 engine's profile spans them); an engine's samples are cut to fit its profile instead.
    Warns (CalibrationWarning) below `min_samples` sample rows.

    cache: a calibration cache path (TensorRT text, or JSON for a .json path). If it exists and was made
    with the same method, it is returned as is (data may then be None); otherwise calibration runs and
    writes it. Without data and without a usable cache: ConfigError (Kiln never invents scales)."""
    start = time.perf_counter()
    calibrator = get_calibrator(method, percentile)
    if cache is not None and Path(cache).is_file():
        from .cache import load

        cached = load(cache)
        if cached.method == calibrator.name:
            return cached
        if data is None:
            raise ConfigError(f"calibration cache '{cache}' was made with {cached.method} calibration, not "
                              f"{calibrator.name}, and no calibration data was given to redo it.")
        warnings.warn(f"calibration cache '{cache}' was made with {cached.method} calibration, not "
                      f"{calibrator.name}: calibrating again and overwriting it.", CalibrationWarning, stacklevel=2)
    if data is None:
        raise ConfigError("INT8/FP8 calibration needs data: pass 100 to 1000 representative input samples (a "
                          ".npz/.npy file, a folder of .npz files, or an iterable of {input: array} dicts) or an "
                          "existing calibration cache. Kiln never falls back to made-up scales.")
    if num_bins < 128:
        raise ConfigError("num_bins must be at least 128 (the INT8 levels the entropy search compares), "
                          f"got {num_bins}.")
    if _is_engine(model_or_engine):
        fp32_engine(model_or_engine, [])  # refuse an FP16/BF16 engine before reading any data
    _, inputs = model_inputs(model_or_engine)
    samples, rows = prepare_samples(data, inputs, engine=model_or_engine if _is_engine(model_or_engine) else None,
                                    profile=profile)
    if rows < min_samples:
        warnings.warn(f"calibration set has only {rows} samples; INT8/FP8 scales need {min_samples} to 1000 "
                      "representative samples, or they may clip or waste range on real inputs.",
                      CalibrationWarning, stacklevel=2)
    samples = rebatch(samples, inputs, batch_size, model_or_engine, build_config)
    engine = fp32_engine(model_or_engine, samples, device, build_config)
    if not _is_engine(model_or_engine):
        samples, _ = prepare_samples(samples, inputs, engine=engine, profile=profile)
    passes = 2 if calibrator.needs_histogram else 1
    ranges = _Collector(num_bins)
    run_pass(engine, samples, ranges, profile, progress, step=f"pass 1/{passes}: ranges")
    stats = ranges.stats
    if calibrator.needs_histogram:
        hist = _Collector(num_bins, ranges=False, hist_ranges={k: s.absmax or 0.0 for k, s in stats.items()},
                          stats=stats)
        run_pass(engine, samples, hist, profile, progress, step=f"pass 2/{passes}: histograms")
    for s in stats.values():
        if s.absmax is None:  # never a finite value
            continue
        s.amax = calibrator.amax(s.absmax, s.hist, s.hist_max)
    cal = Calibration(
        method=calibrator.name, tensors=stats, weights=weight_scales(engine.graph), samples=rows,
        percentile=percentile if calibrator.name == "percentile" else None, num_bins=num_bins,
        inputs=diversity(samples, engine.inputs),
        engine={"device": str(engine.target.device), "precision": engine.precision,
                "inputs": [v.name for v in engine.inputs]},
        seconds=time.perf_counter() - start)
    if cache is not None:
        cal.save(cache)
    return cal
