"""Calibration representativeness: does the calibration set cover what the model will see?

    report = kiln.quant.check_coverage(cal, "model.onnx", "validation.npz")
    print(report.render()); report.flags

Runs a validation set through the same FP32 engine and compares, per tensor:

* clip rate: the fraction of validation values with |x| > the calibrated amax
  (they saturate in INT8), next to the same fraction on the calibration set
  (Entropy and Percentile clip a little on purpose; MinMax clips nothing).
  Flagged when clearly above the calibration set's, or above 1% outright
  (Entropy on a degenerate set can choose an amax that clips most values);
* out-of-range rate: the fraction of validation values outside the range the
  calibration set reached [min, max];
* histogram distance: the Jensen-Shannon divergence (bits, 0..1) between the
  calibration and validation histograms of |x| (64 bins over the calibration
  range, plus one bin for everything beyond it).

And for the set as a whole: too small (fewer than 100 sample rows) and too
uniform (few distinct rows, or rows that barely differ from one another:
per-element spread across rows tiny next to the values' spread, or far below
the validation set's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .calibrate import (
    MIN_SAMPLES,
    _Collector,
    diversity,
    fp32_engine,
    model_inputs,
    prepare_samples,
    rebatch,
    run_pass,
)

COARSE_BINS = 64


@dataclass
class TensorCoverage:
    name: str
    amax: float
    calib_min: float | None
    calib_max: float | None
    val_min: float | None
    val_max: float | None
    count: int  # validation values seen
    clip_rate: float  # validation |x| > amax
    calib_clip_rate: float | None  # calibration |x| > amax (from its histogram), None if unknown
    out_of_range_rate: float | None  # validation x outside [calib_min, calib_max]
    hist_distance: float | None  # Jensen-Shannon divergence of |x| histograms, bits
    flags: list[str] = field(default_factory=list)


@dataclass
class CoverageReport:
    method: str
    calib_samples: int
    val_samples: int
    tensors: list[TensorCoverage]
    flags: list[str]  # every problem found, one sentence each (set-level first)
    too_small: bool = False
    too_uniform: bool = False
    missing: list[str] = field(default_factory=list)  # calibrated tensors the engine does not produce
    inputs: dict = field(default_factory=dict)  # per input: calibration vs validation diversity

    @property
    def ok(self) -> bool:
        return not self.flags

    @property
    def flagged(self) -> list[TensorCoverage]:
        return [t for t in self.tensors if t.flags]

    def tensor(self, name: str) -> TensorCoverage:
        return next(t for t in self.tensors if t.name == name)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def render(self) -> str:
        head = (f"calibration coverage ({self.method}): {self.calib_samples} calibration vs {self.val_samples} "
                f"validation samples, {len(self.flagged)} of {len(self.tensors)} tensors flagged")
        columns = (f"  {'tensor':30} {'amax':>10} {'val |x| max':>12} {'clip':>9} {'calib clip':>10} "
                   f"{'out of range':>12} {'JS':>6}")
        lines = [head, columns]
        for t in self.tensors:
            vmax = None if t.val_min is None else max(abs(t.val_min), abs(t.val_max))
            lines.append(f"  {t.name[:30]:30} {t.amax:10.4g} {_f(vmax, '12.4g')} {_pct(t.clip_rate):>9} "
                         f"{_pct(t.calib_clip_rate):>10} {_pct(t.out_of_range_rate):>12} {_f(t.hist_distance, '6.3f')}"
                         + ("  <- " + "; ".join(t.flags) if t.flags else ""))
        lines += [f"  ! {f}" for f in self.flags] or ["  the calibration set covers the validation set"]
        return "\n".join(lines)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.3f}%"


def _f(v, spec) -> str:
    return f"{'-':>{spec.split('.')[0]}}" if v is None else format(v, spec)


def js_divergence(p, q) -> float:
    """Jensen-Shannon divergence (base 2, in [0, 1]) between two count vectors."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if p.sum() == 0 or q.sum() == 0:
        return 0.0 if p.sum() == q.sum() else 1.0
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a):
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return max(0.0, min(1.0, (kl(p) + kl(q)) / 2))


def _coarse(hist: np.ndarray, over: int = 0) -> np.ndarray:
    n = hist.size
    k = max(1, n // COARSE_BINS)
    c = hist[: (n // k) * k].reshape(-1, k).sum(axis=1)
    return np.append(c, over)


def check_coverage(calibration, model_or_engine, validation, *, profile: int = 0, device: str = "auto",
                   build_config=None, clip_tolerance: float = 2e-3, out_of_range_tolerance: float = 5e-3,
                   max_clip_rate: float = 0.01, drift_threshold: float = 0.1, min_samples: int = MIN_SAMPLES,
                   min_spread_ratio: float = 0.05,
                   min_distinct_fraction: float = 0.5, spread_vs_validation: float = 0.25,
                   batch_size: int | None = 32, progress: bool = False) -> CoverageReport:
    """Compare `calibration` (a Calibration) with a validation set run through the same FP32 engine.

    A tensor is flagged when validation clips more than the calibration set did by over clip_tolerance
    (a fraction) or clips over max_clip_rate at all, when over out_of_range_tolerance of its validation values
    fall outside the calibration
    set's range, or when the histogram distance exceeds drift_threshold. The tolerances leave room for
    sampling noise: a representative set of N samples still leaves about 1/(N+1) of new samples' extremes
    beyond its range."""
    from .calibrate import _is_engine

    if _is_engine(model_or_engine):
        fp32_engine(model_or_engine, [], what="the coverage check")
    _, inputs = model_inputs(model_or_engine)
    samples, rows = prepare_samples(validation, inputs, what="validation data",
                                    engine=model_or_engine if _is_engine(model_or_engine) else None,
                                    profile=profile)
    samples = rebatch(samples, inputs, batch_size, model_or_engine, build_config)
    engine = fp32_engine(model_or_engine, samples, device, build_config, what="the coverage check")
    if not _is_engine(model_or_engine):
        samples, _ = prepare_samples(samples, inputs, what="validation data", engine=engine, profile=profile)
    cal_tensors = {k: s for k, s in calibration.tensors.items() if s.amax is not None}
    col = _Collector(
        calibration.num_bins,
        hist_ranges={k: s.hist_max for k, s in cal_tensors.items() if s.hist is not None},
        thresholds={k: s.amax for k, s in cal_tensors.items()},
        bounds={k: (s.min, s.max) for k, s in cal_tensors.items() if s.min is not None and s.max is not None})
    run_pass(engine, samples, col, profile, progress, label="kiln coverage", step="validation pass")

    flags: list[str] = []
    too_small = calibration.samples < min_samples
    if too_small:
        flags.append(f"calibration set too small: {calibration.samples} samples (use {min_samples} to 1000).")
    val_div = diversity(samples, engine.inputs)
    too_uniform = False
    inputs_cmp = {}
    for name, d in calibration.inputs.items():
        v = val_div.get(name)
        inputs_cmp[name] = {"calibration": d, "validation": v}
        reasons = []
        if d["rows"] > 1 and d["distinct"] / d["rows"] < min_distinct_fraction:
            reasons.append(f"only {d['distinct']} distinct of {d['rows']} rows")
        if d["rows"] > 1 and d["spread_ratio"] < min_spread_ratio:
            reasons.append(f"rows barely differ (across-row spread {d['spread_ratio']:.3g} of the values' std)")
        if v is not None and v["spread"] > 0 and d["spread"] < spread_vs_validation * v["spread"]:
            reasons.append(f"rows vary {v['spread'] / max(d['spread'], 1e-30):.3g}x less than the validation set's")
        if reasons:
            too_uniform = True
            flags.append(f"calibration set too uniform for input '{name}': {'; '.join(reasons)}.")

    missing = [k for k in cal_tensors if k not in col.stats]
    if missing:
        flags.append(f"{len(missing)} calibrated tensor(s) are not produced by this engine (another model or "
                     f"another build?): {missing[:10]}")
    rows_out = []
    for name, cs in cal_tensors.items():
        vs = col.stats.get(name)
        if vs is None or not vs.count:
            continue
        clip = col.above.get(name, 0) / vs.count
        calib_clip = cs.clip_fraction()
        oor = col.outside[name] / vs.count if name in col.bounds else None
        dist = None
        if cs.hist is not None and vs.hist is not None:
            dist = js_divergence(_coarse(cs.hist), _coarse(vs.hist, col.over.get(name, 0)))
        t = TensorCoverage(name, float(cs.amax), cs.min, cs.max, vs.min, vs.max, vs.count, clip, calib_clip, oor,
                           dist)
        if clip > (calib_clip or 0.0) + clip_tolerance or clip > max_clip_rate:
            t.flags.append(f"validation clips {100 * clip:.3g}% of values at amax {cs.amax:.4g}"
                           f" (calibration: {'?' if calib_clip is None else f'{100 * calib_clip:.3g}'}%)")
        if oor is not None and oor > out_of_range_tolerance:
            t.flags.append(f"{100 * oor:.3g}% of validation values fall outside the calibration range "
                           f"[{cs.min:.4g}, {cs.max:.4g}] (validation: [{vs.min:.4g}, {vs.max:.4g}])")
        if dist is not None and dist > drift_threshold:
            t.flags.append(f"histogram differs from calibration (JS divergence {dist:.3f} bits)")
        rows_out.append(t)
    bad = [t for t in rows_out if t.flags]
    if bad:
        flags.append(f"{len(bad)} tensor(s) are not covered by the calibration set: "
                     + ", ".join(t.name for t in bad[:10]) + (" ..." if len(bad) > 10 else ""))
    return CoverageReport(calibration.method, calibration.samples, rows, rows_out, flags, too_small, too_uniform,
                          missing, inputs_cmp)
