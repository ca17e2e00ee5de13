"""`kiln compare REF ENGINE`: the engine's outputs against a reference, Polygraphy style.

REF is the ONNX model run by onnxruntime on the CPU (the API also takes a
torch.nn.Module, or MODULE:FACTORY on the command line). Both run on the same
inputs, in this order of preference: --loadInputs (a .npz, a folder of .npz
samples, or Polygraphy's JSON); the calibration data the engine was built with, when its file is still
there; else synthetic inputs drawn to look like data (token ids over the embedding's
rows, masks as masks, --valRange NAME:LO,HI), and the report says they are synthetic.

Per output: absolute and relative error (max, mean, median, p99), NaN/Inf checks, an
error histogram, the minimum tolerance that would pass, and a verdict. An element
passes when |engine - ref| <= atol + rtol * |ref| (numpy.allclose's rule).

Default tolerances scale with each output: atol = f x RMS(ref) (the output's own
magnitude, over all samples) and rtol = f, where f follows the build precision's
arithmetic:
  FP32 1e-4  (same format as the reference; only the order of sums differs)
  TF32, FP16 1e-2  (10-bit mantissa: a rounding is 2^-11 = 4.9e-4; ~20 of them)
  BF16 4e-2  (7-bit mantissa: 2^-8 = 3.9e-3; ~10 roundings)
  INT8 1e-1  (127 levels per tensor: one step is ~1/127 of a tensor's range,
              several % of its RMS, and steps add up over the layers)
  FP8  1.5e-1 (E4M3, 3-bit mantissa: 2^-4 = 6.3e-2 per value, averaged in each sum)
  INT4 2e-1  (weights only, 15 levels per group)
Integer and boolean outputs are compared exactly. An --atol/--rtol given on the
command line is absolute.

Verdicts: PASSED; FAILED (exit 1); INCONCLUSIVE (exit 3) when the check is vacuous:
the tolerance is so wide against the output's spread that an engine returning one
constant (the midpoint of the reference's range) would pass it too, so it proves
nothing (--acceptVacuous counts it as passed, still with the warning).

--layerwise also compares every engine layer output that exists in the ONNX graph
and names the first layer whose error leaves the tolerance: where accuracy is lost.

Several backends at once (Polygraphy's `polygraphy run --trt --onnxrt`): `kiln compare model.onnx
--runners kiln-fp16,kiln-int8,onnxruntime,torch --torch MODULE:FACTORY` builds and runs each on the same
inputs and prints one table (kiln/tools/runners.py). --saveInputs, --loadInputs FILE.json and
--saveOutputs read and write Polygraphy's JSON (kiln/tools/polygraphy_json.py), in both modes.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..console import console
from ..errors import ConfigError, InputError
from ..ir import dtypes
from ..ir.shapes import fmt_shape
from ..json_file import atomic_write_json
from ..samples import check_feeds_in_profile, load_samples, split_to_profile
from .engine_args import (
    add_verify_key_flag,
    load_engine,
    parse_shapes_arg,
    verify_key_of,
)
from .references import (
    OnnxReference,
    TorchReference,
    check_bindings,
    make_reference,
    onnx_node_outputs,
)

# The default tolerance fraction f by the engine's build precision: atol = f x RMS(ref), rtol = f.
# Derived from each format's rounding (the module docstring gives the arithmetic).
DEFAULT_FRACTION = {
    "float32": 1e-4,
    "tf32": 1e-2,
    "float16": 1e-2,
    "bfloat16": 4e-2,
    "int8": 1e-1,
    "fp8": 1.5e-1,
    "int4": 2e-1,
}
EXIT_FAILED, EXIT_INCONCLUSIVE = 1, 3


def engine_precision(engine) -> str:
    """The build precision that sets default tolerances (the loosest of the enabled modes)."""
    cfg = engine.build_config
    for key in ("int4", "int8", "fp8"):
        if cfg.get(key) or cfg.get("precision") == key:
            return key
    return cfg.get("precision", "float32")


def default_fraction(engine) -> float:
    """f of the engine's precision: the default atol is f x RMS(ref) and the default rtol f."""
    return DEFAULT_FRACTION.get(engine_precision(engine), DEFAULT_FRACTION["float32"])


# --- statistics --------------------------------------------------------------------------------------


def _stats(x: np.ndarray) -> dict:
    if x.size == 0:
        return {"max": 0.0, "mean": 0.0, "median": 0.0, "p99": 0.0}
    return {"max": float(np.max(x)), "mean": float(np.mean(x)), "median": float(np.median(x)),
            "p99": float(np.percentile(x, 99))}


def error_histogram(absdiff: np.ndarray, exact: int = 0) -> list[dict]:
    """Counts of absolute error per decade: [{"lo", "hi", "count"}]; lo=0 for exact matches."""
    bins = []
    if exact:
        bins.append({"lo": 0.0, "hi": 0.0, "count": int(exact)})
    nz = absdiff[absdiff > 0]
    if nz.size:
        lo = math.floor(math.log10(float(nz.min())))
        hi = math.floor(math.log10(float(nz.max()))) + 1
        clipped = hi - lo > 12
        lo = hi - 12 if clipped else lo
        edges = [10.0 ** k for k in range(lo, hi + 1)]
        if clipped:
            edges[0] = 0.0  # the first bin also holds everything smaller
        edges[0] = min(edges[0], float(nz.min()))
        edges[-1] = max(edges[-1], float(nz.max()))
        counts, _ = np.histogram(nz, bins=edges)
        for a, b, c in zip(edges[:-1], edges[1:], counts):
            bins.append({"lo": float(a), "hi": float(b), "count": int(c)})
    return bins


def render_histogram(bins: list[dict], width: int = 40) -> list[str]:
    if not bins:
        return []
    top = max(b["count"] for b in bins) or 1
    lines = []
    for b in bins:
        label = "exact (0)" if b["hi"] == 0 else f"[{b['lo']:.0e}, {b['hi']:.0e})" if b["lo"] else f"(0, {b['hi']:.0e})"
        bar = "#" * (math.ceil(width * b["count"] / top) if b["count"] else 0)
        lines.append(f"{label:>18} | {b['count']:>9} | {bar}")
    return lines


@dataclass
class OutputResult:
    name: str
    passed: bool
    atol: float
    rtol: float
    atol_basis: str = ""  # how a scale-relative default atol was reached, e.g. "0.01 x RMS(ref) 3.2"
    shape: list | None = None
    engine_dtype: str | None = None
    reference_dtype: str | None = None
    elements: int = 0
    mismatches: int = 0
    abs_err: dict = field(default_factory=dict)
    rel_err: dict = field(default_factory=dict)
    rel_excluded: int = 0  # elements where the reference is 0 (relative error undefined)
    min_atol: float | None = None  # the smallest atol that passes at this rtol
    min_rtol: float | None = None  # the smallest rtol that passes at this atol
    engine_nan: int = 0
    engine_inf: int = 0
    ref_nan: int = 0
    ref_inf: int = 0
    nonfinite_mismatch: int = 0
    worst: dict | None = None
    histogram: list = field(default_factory=list)
    reference_stats: dict = field(default_factory=dict)
    engine_stats: dict = field(default_factory=dict)
    reason: str = ""
    # The check cannot fail on this output: a constant (`constant_that_passes`) would pass it too.
    vacuous: bool = False
    constant_that_passes: float | None = None
    accept_vacuous: bool = False

    @property
    def verdict(self) -> str:
        if self.mismatches or self.reason.startswith("shape differs"):
            return "FAILED"
        return "INCONCLUSIVE" if self.vacuous and not self.accept_vacuous else "PASSED"

    def to_json(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def _as_f64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = dtypes.to_numpy(x.float() if x.dtype.is_floating_point else x)
    x = np.asarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.int8)
    return x.astype(np.float64)


def compare_arrays(name: str, ref_list: list, out_list: list, atol: float, rtol: float,
                   of_scale: bool = False, accept_vacuous: bool = False) -> OutputResult:
    """Error statistics of engine outputs against reference outputs (one array per sample).

    of_scale: atol is a fraction of the reference's RMS (the output's own magnitude).
    accept_vacuous: a check no engine could fail (see `vacuous`) counts as passed.
    """
    res = OutputResult(name=name, passed=False, atol=atol, rtol=rtol, accept_vacuous=accept_vacuous)
    refs, outs, sample_shapes = [], [], []
    for i, (r, o) in enumerate(zip(ref_list, out_list)):
        r_shape, o_shape = list(np.shape(r)), list(np.shape(o))
        res.shape = res.shape or o_shape  # the first sample's (samples may differ in batch)
        sample_shapes.append(o_shape)
        res.engine_dtype = _dtype_name(o)
        res.reference_dtype = _dtype_name(r)
        if r_shape != o_shape:
            res.reason = (f"shape differs: the engine returns {fmt_shape(o_shape)}, the reference "
                          f"{fmt_shape(r_shape)}" + (f" (sample {i})" if len(ref_list) > 1 else ""))
            return res
        refs.append(_as_f64(r).ravel())
        outs.append(_as_f64(o).ravel())
    ref = np.concatenate(refs) if refs else np.zeros(0)
    out = np.concatenate(outs) if outs else np.zeros(0)
    res.elements = int(ref.size)
    res.engine_nan, res.engine_inf = int(np.isnan(out).sum()), int(np.isinf(out).sum())
    res.ref_nan, res.ref_inf = int(np.isnan(ref).sum()), int(np.isinf(ref).sum())
    fin_r, fin_o = np.isfinite(ref), np.isfinite(out)
    both = fin_r & fin_o
    same_nonfinite = ~fin_r & ~fin_o & ((np.isnan(ref) & np.isnan(out)) | (ref == out))
    res.nonfinite_mismatch = int((~both & ~same_nonfinite).sum())
    r, o = ref[both], out[both]
    if r.size:
        res.reference_stats = {"mean": float(r.mean()), "std": float(r.std()),
                               "min": float(r.min()), "max": float(r.max())}
        res.engine_stats = {"mean": float(o.mean()), "std": float(o.std()),
                            "min": float(o.min()), "max": float(o.max())}
    absdiff = np.abs(o - r)
    mag = np.abs(r)
    if of_scale and mag.size:
        rms = float(np.sqrt(np.mean(mag * mag)))
        res.atol_basis = f"{atol:g} x RMS(ref) {rms:.4g}"
        atol = res.atol = atol * rms
    res.vacuous, res.constant_that_passes = vacuous(r, atol, rtol)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(mag > 0, absdiff / np.where(mag > 0, mag, 1), 0.0)
    zero_ref = mag == 0
    res.rel_excluded = int((zero_ref & (absdiff > 0)).sum())
    res.abs_err = _stats(absdiff)
    res.rel_err = _stats(rel[~zero_ref])
    bad = absdiff > atol + rtol * mag
    res.mismatches = int(bad.sum()) + res.nonfinite_mismatch
    if absdiff.size:
        res.min_atol = float(np.max(np.maximum(absdiff - rtol * mag, 0)))
        need = absdiff > atol
        if (need & zero_ref).any():
            res.min_rtol = math.inf
        elif need.any():
            res.min_rtol = float(np.max((absdiff[need] - atol) / mag[need]))
        else:
            res.min_rtol = 0.0
        excess = absdiff - (atol + rtol * mag)
        k = int(np.argmax(excess))
        idx_full = int(np.flatnonzero(both)[k])
        ends = np.cumsum([int(np.prod(sh)) for sh in sample_shapes])
        sample = int(np.searchsorted(ends, idx_full, side="right"))
        flat = idx_full - (int(ends[sample - 1]) if sample else 0)
        shp = sample_shapes[sample]
        res.worst = {"index": [int(i) for i in np.unravel_index(flat, shp)] if shp else [],
                     "sample": sample, "engine": float(o[k]), "reference": float(r[k]),
                     "abs_err": float(absdiff[k])}
    res.histogram = error_histogram(absdiff, exact=int((absdiff == 0).sum()))
    if res.nonfinite_mismatch:
        res.reason = (f"{res.nonfinite_mismatch} element(s) are NaN/Inf in one of engine and reference but not "
                      f"the other (engine: {res.engine_nan} NaN, {res.engine_inf} Inf; reference: {res.ref_nan} NaN, "
                      f"{res.ref_inf} Inf)")
    elif res.mismatches:
        res.reason = (f"{res.mismatches}/{res.elements} elements ({100 * res.mismatches / max(res.elements, 1):.3g}%) "
                      f"exceed the tolerance")
    res.passed = res.verdict == "PASSED"
    return res


def vacuous(ref: np.ndarray, atol: float, rtol: float) -> tuple[bool, float | None]:
    """Whether an engine returning one constant, the midpoint of the reference's range, would pass:
    then the tolerance is at least the output's spread and the check proves nothing. A constant
    reference (range 0) is not vacuous: the check is then an exact one."""
    if ref.size == 0:
        return False, None
    lo, hi = float(ref.min()), float(ref.max())
    if hi <= lo:
        return False, None
    mid = (lo + hi) / 2
    return bool(np.all(np.abs(ref - mid) <= atol + rtol * np.abs(ref))), mid


def _dtype_name(x) -> str:
    if isinstance(x, torch.Tensor):
        return dtypes.name_of(x.dtype)
    return str(np.asarray(x).dtype)


# --- the comparison ----------------------------------------------------------------------------------


@dataclass
class LayerResult:
    index: int
    layer: str
    op_type: str
    precision: str
    tensor: str
    passed: bool
    max_abs: float
    max_rel: float
    mismatches: int
    elements: int


@dataclass
class CompareResult:
    reference: str
    engine_target: str
    precision: str
    samples: int
    outputs: list[OutputResult]
    layers: list[LayerResult] = field(default_factory=list)
    layers_skipped: int = 0
    first_bad_layer: LayerResult | None = None
    # Where the inputs came from: "--loadInputs PATH", "calibration data PATH", "given samples" or
    # "synthetic"; for synthetic ones, how each input was drawn (kiln/engine/synthetic.py).
    inputs: str = "given samples"
    synthetic_rules: dict = field(default_factory=dict)
    # Per sample {output: array} of each side, for --save-outputs (not in to_json: the statistics are).
    reference_kind: str = "reference"
    engine_outputs: list = field(default_factory=list, repr=False)
    reference_outputs: list = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def verdict(self) -> str:
        verdicts = {o.verdict for o in self.outputs}
        return "FAILED" if "FAILED" in verdicts else "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts else "PASSED"

    @property
    def synthetic(self) -> bool:
        return self.inputs == "synthetic"

    def to_json(self) -> dict:
        return {
            "passed": self.passed, "verdict": self.verdict, "reference": self.reference,
            "engine_target": self.engine_target, "precision": self.precision, "samples": self.samples,
            "inputs": self.inputs, "synthetic_rules": self.synthetic_rules,
            "outputs": [o.to_json() for o in self.outputs],
            "layers": [asdict(x) for x in self.layers], "layers_skipped": self.layers_skipped,
            "first_bad_layer": asdict(self.first_bad_layer) if self.first_bad_layer else None,
        }


def tolerances_for(engine, names: list[str], atol=None, rtol=None, per_atol=None, per_rtol=None) -> dict:
    """{output: (atol, rtol, atol a fraction of RMS(ref))} from the precision defaults and the overrides.
    Integer and boolean outputs default to an exact match."""
    f = default_fraction(engine)
    per_atol, per_rtol = per_atol or {}, per_rtol or {}
    for flag, per in (("--atol", per_atol), ("--rtol", per_rtol)):
        unknown = [k for k in per if k not in names]
        if unknown:
            raise ConfigError(f"{flag}: {unknown} are not outputs of the engine; its outputs are {names}.")
    dtype = {v.name: v.dtype for v in engine.outputs}
    out = {}
    for n in names:
        d = f if dtype.get(n) is None or dtype[n].is_floating_point else 0.0
        a = per_atol.get(n, d if atol is None else atol)
        out[n] = (a, per_rtol.get(n, d if rtol is None else rtol), atol is None and n not in per_atol and d > 0)
    return out


def calibration_samples(engine, profile: int = 0, limit: int = 8) -> tuple[list[dict], str] | None:
    """The calibration data the engine was built with, as input samples (at most `limit` batches),
    or None when the engine records no file or the file is gone."""
    from pathlib import Path

    calib = engine.build_config.get("calibration")
    path = calib.get("data") if isinstance(calib, dict) else None
    if not path or not Path(path).exists():
        return None
    samples = split_to_profile(engine, load_samples(path, [v.name for v in engine.inputs], what="calibration data"),
                               profile)
    return samples[:limit], f"calibration data {path}" + (f" (first {limit} batches)" if len(samples) > limit else "")


def synthetic_samples(engine, profile: int = 0, seed: int = 0, count: int = 1, shapes: dict | None = None,
                      val_range: dict | None = None) -> list[dict]:
    """Seeded synthetic samples as numpy arrays (bfloat16 stays a torch tensor: numpy has no bfloat16)."""
    out = []
    for i in range(count):
        feeds = engine.random_inputs(profile, pick=1, shapes=shapes, seed=seed + i, val_range=val_range)
        out.append({k: x if x.dtype == torch.bfloat16 else dtypes.to_numpy(x) for k, x in feeds.items()})
    return out


def compare(reference, engine, samples: list[dict] | None = None, *, seed: int = 0, profile: int = 0,
            shapes: dict | None = None, atol: float | None = None, rtol: float | None = None,
            per_output_atol: dict | None = None, per_output_rtol: dict | None = None,
            layerwise: bool = False, device: str = "auto", val_range: dict | None = None,
            inputs: str | None = None, accept_vacuous: bool = False) -> CompareResult:
    """Run `reference` and `engine` on the same inputs and compare every output.

    reference: path to .onnx, onnx.ModelProto, torch.nn.Module or 'module:factory'.
    engine: an Engine or a .kiln path. samples: list of {input: array}; default the engine's calibration
    data when its file is still there, else one seeded synthetic sample (val_range: {input or None:
    (lo, hi)}, as --valRange). inputs: where given samples came from, for the report.
    """
    engine = load_engine(engine, device)
    names_out = [v.name for v in engine.outputs]
    tol = tolerances_for(engine, names_out, atol, rtol, per_output_atol, per_output_rtol)
    extra = None
    if layerwise and not isinstance(reference, (torch.nn.Module, TorchReference, OnnxReference)):
        def extra(proto):  # engine layer outputs that are also tensors of the ONNX graph
            available = set(onnx_node_outputs(proto))
            return [o for n in engine.graph.nodes if n.placement == "device" for o in n.outputs
                    if o in available and o not in names_out]
    ref = make_reference(reference, engine, extra_outputs=extra)
    check_bindings(ref, engine)
    rules = {}
    if samples is None:
        from_calib = None if shapes or val_range else calibration_samples(engine, profile)
        if from_calib:
            samples, inputs = from_calib
        else:
            samples, inputs = synthetic_samples(engine, profile, seed, 1, shapes, val_range), "synthetic"
    if inputs == "synthetic":
        from ..engine.synthetic import describe

        rules = describe(engine, val_range)
    if not samples:
        raise InputError("no input samples to compare on.")
    ctx = engine.create_execution_context(profile=profile)
    ref_outs, eng_outs = {n: [] for n in names_out}, {n: [] for n in names_out}
    for i, feeds in enumerate(samples):
        check_feeds_in_profile(engine, feeds, profile, f"input sample {i}" if len(samples) > 1 else "the inputs")
        _check_dtypes(engine, feeds)
        r = ref.run(feeds, names_out)
        e = ctx.run(feeds)
        for n in names_out:
            ref_outs[n].append(r[n])
            eng_outs[n].append(e[n])
    outputs = [compare_arrays(n, ref_outs[n], eng_outs[n], *tol[n], accept_vacuous=accept_vacuous)
               for n in names_out]
    result = CompareResult(reference=ref.describe(), engine_target=engine.target.describe(),
                           precision=engine_precision(engine), samples=len(samples), outputs=outputs,
                           inputs=inputs or "given samples", synthetic_rules=rules,
                           reference_kind=getattr(ref, "kind", "reference"),
                           engine_outputs=[{n: eng_outs[n][i] for n in names_out} for i in range(len(samples))],
                           reference_outputs=[{n: ref_outs[n][i] for n in names_out} for i in range(len(samples))])
    if layerwise:
        _layerwise(result, ref, engine, samples[0], profile, list(getattr(ref, "extra_outputs", [])), tol)
    return result


def _check_dtypes(engine, feeds):
    for v in engine.inputs:
        x = feeds[v.name]
        got = dtypes.name_of(x.dtype) if isinstance(x, torch.Tensor) else str(np.asarray(x).dtype)
        want = dtypes.name_of(v.dtype) if v.dtype is not None else None
        if want and got != want:
            raise InputError(f"input '{v.name}' is {got} in the given data but the engine expects {want}; "
                             "convert it before comparing.")


def _layerwise(result: CompareResult, ref, engine, feeds: dict, profile: int, extra: list[str], tol: dict) -> None:
    if not isinstance(ref, OnnxReference):
        raise ConfigError("--layerwise needs an ONNX reference (intermediate tensors are matched by name in the "
                          "ONNX graph); a PyTorch module has no named intermediate tensors.")
    f = default_fraction(engine)
    a0 = min((t[0] for t in tol.values()), default=f)
    r0 = min((t[1] for t in tol.values()), default=f)
    scaled = all(t[2] for t in tol.values())  # intermediate tensors: scale-relative unless --atol was given
    wanted = set(extra) | set(tol)
    ref_vals = ref.run(feeds, [o.name for o in ref.outputs] + extra) if wanted else {}
    captured: dict[str, tuple] = {}

    def observer(node, outs):
        if outs is None:
            return
        for name, t in zip(node.outputs, outs):
            if name in wanted and isinstance(t, torch.Tensor):
                captured[name] = (node, t.detach().to("cpu", copy=True))

    ctx = engine.create_execution_context(profile=profile, cuda_graphs=False)
    ctx.run_layerwise(feeds, observer)
    idx = {id(n): i for i, n in enumerate(engine.graph.nodes)}
    skipped = 0
    for i, node in enumerate(engine.graph.nodes):
        if node.placement != "device":
            continue
        outs = [o for o in node.outputs if o in captured and o in ref_vals]
        if not outs:
            skipped += 1
            continue
        for o in outs:
            n, t = captured[o]
            a, r, of_scale = tol.get(o, (a0, r0, scaled))
            ref_o, scale = ref_vals[o], _y_scale(engine, n)
            if scale is not None:  # 8-bit values handed to the next quantized layer: compare on that grid
                ref_o, t = _on_the_8bit_grid(n, scale, ref_o), t.float() * scale
            cmp = compare_arrays(o, [ref_o], [t], a, r, of_scale, accept_vacuous=True)
            lr = LayerResult(index=idx[id(n)], layer=layer_name(n), op_type=n.op_type, precision=n.precision,
                             tensor=o, passed=cmp.passed, max_abs=cmp.abs_err.get("max", math.nan),
                             max_rel=cmp.rel_err.get("max", math.nan), mismatches=cmp.mismatches,
                             elements=cmp.elements)
            if cmp.reason.startswith("shape differs"):
                lr.max_abs = lr.max_rel = math.nan
            result.layers.append(lr)
            if not lr.passed and result.first_bad_layer is None:
                result.first_bad_layer = lr
    result.layers_skipped = skipped


def _y_scale(engine, node) -> torch.Tensor | None:
    """The scale of a layer that writes 8-bit values for the quantized layer after it, or None."""
    from ..builder.quantized_io import output_scale

    name = output_scale(node)
    return engine.graph.initializers[name].float().cpu() if name else None


def _on_the_8bit_grid(node, scale, ref) -> torch.Tensor:
    """Reference values quantized with `scale` as the layer does (the ONNX graph's Q/DQ pair after it), scaled back."""
    from ..ops.fused import quantize

    return quantize(node, torch.as_tensor(np.asarray(ref)), scale).float() * scale


def layer_name(node) -> str:
    """A fused layer's name joins its source ONNX nodes with ' + ' (TensorRT's habit)."""
    return " + ".join(node.sources) if node.sources else (node.name or node.label)


# --- text report -------------------------------------------------------------------------------------


def _g(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.4g}"


def render(result: CompareResult, con, histogram: bool = True) -> None:
    con.print(f"[I] Reference: {result.reference}")
    con.print(f"[I] Engine:    {result.engine_target}, precision {result.precision}; "
              f"{result.samples} input sample(s)")
    if result.synthetic:
        con.print("[W] Inputs: SYNTHETIC, not data. A check on them says little about real inputs: pass "
                  "--loadInputs with real samples.")
        for name, how in result.synthetic_rules.items():
            con.print(f"[W]     {name}: {how}")
        if result.precision in ("int8", "fp8", "int4"):
            con.print(f"[W]     An {result.precision.upper()} engine's scales were calibrated on data: synthetic "
                      "values outside that data's range are clipped, so a FAILED here may not hold on real inputs, "
                      "and a PASSED does not prove it.")
    else:
        con.print(f"[I] Inputs:    {result.inputs}")
    for o in result.outputs:
        con.print(f"[I] Comparing output '{o.name}' (engine {o.engine_dtype} {fmt_shape(o.shape or [])}, "
                  f"reference {o.reference_dtype})")
        basis = f" = {o.atol_basis}" if o.atol_basis else ""
        con.print(f"[I]     Tolerance: atol={o.atol:.4g}{basis}, rtol={o.rtol:g} "
                  "(pass when |engine - ref| <= atol + rtol*|ref|)")
        if o.reference_stats:
            rs = o.reference_stats
            widest = o.atol + o.rtol * max(abs(rs["min"]), abs(rs["max"]))
            con.print(f"[I]     Tolerance against the output: up to {widest:.4g} at the largest |ref|; the reference "
                      f"spans {rs['max'] - rs['min']:.4g} ([{rs['min']:.5g}, {rs['max']:.5g}])")
        if o.reason.startswith("shape differs"):
            con.print(f"[E]     FAILED | Output: '{o.name}' | {o.reason}")
            continue
        if o.reference_stats:
            rs, es = o.reference_stats, o.engine_stats
            con.print(f"[I]     Reference: mean={rs['mean']:.5g}, std-dev={rs['std']:.5g}, "
                      f"range=[{rs['min']:.5g}, {rs['max']:.5g}]")
            con.print(f"[I]     Engine:    mean={es['mean']:.5g}, std-dev={es['std']:.5g}, "
                      f"range=[{es['min']:.5g}, {es['max']:.5g}]")
        a, r = o.abs_err, o.rel_err
        con.print(f"[I]     Absolute error: max={_g(a.get('max'))}, mean={_g(a.get('mean'))}, "
                  f"median={_g(a.get('median'))}, p99={_g(a.get('p99'))}")
        con.print(f"[I]     Relative error: max={_g(r.get('max'))}, mean={_g(r.get('mean'))}, "
                  f"median={_g(r.get('median'))}, p99={_g(r.get('p99'))}"
                  + (f" ({o.rel_excluded} element(s) where the reference is 0 left out)" if o.rel_excluded else ""))
        con.print(f"[I]     NaN/Inf: engine {o.engine_nan} NaN, {o.engine_inf} Inf; reference {o.ref_nan} NaN, "
                  f"{o.ref_inf} Inf")
        con.print(f"[I]     Minimum tolerance that would pass: atol >= {_g(o.min_atol)} (at rtol={o.rtol:g}) "
                  f"or rtol >= {_g(o.min_rtol)} (at atol={o.atol:g})")
        if histogram and o.histogram:
            con.print("[I]     Absolute error histogram:")
            for line in render_histogram(o.histogram):
                con.print(f"[I]       {line}")
        if o.vacuous:
            con.print(f"[W]     VACUOUS CHECK: an engine returning the constant {o.constant_that_passes:.5g} "
                      "everywhere would pass this tolerance too; it is wider than the output's spread and proves "
                      "nothing. Tighten --atol/--rtol (the default is relative to the output's RMS).")
        if o.verdict == "INCONCLUSIVE":
            con.print(f"[E]     INCONCLUSIVE | Output: '{o.name}' | within tolerance, but the check is vacuous "
                      "(--acceptVacuous counts it as passed)")
        elif o.passed:
            con.print(f"[I]     PASSED | Output: '{o.name}' | Difference is within tolerance "
                      f"(atol={o.atol:.4g}, rtol={o.rtol:g})" + (" (a vacuous check, accepted)" if o.vacuous else ""))
        else:
            w = o.worst or {}
            worst = ((f"; worst at index {tuple(w['index'])}"
                      + (f" of sample {w['sample']}" if result.samples > 1 else "")
                      + f": engine={w['engine']:.6g}, reference={w['reference']:.6g}")
                     if w and not o.nonfinite_mismatch else "")
            con.print(f"[E]     FAILED | Output: '{o.name}' | {o.reason}{worst}")
    if result.layers or result.layers_skipped:
        con.print(f"[I] Layer-wise: {len(result.layers)} layer output(s) compared, {result.layers_skipped} layer(s) "
                  "without a tensor of the same name in the ONNX graph (fused internals) skipped")
        for lr in result.layers:
            mark = "ok  " if lr.passed else "FAIL"
            con.print(f"[I]   {mark} #{lr.index:<4} {lr.layer} ({lr.op_type}, {lr.precision}) -> '{lr.tensor}': "
                      f"max abs {_g(lr.max_abs)}, max rel {_g(lr.max_rel)}")
        if result.first_bad_layer:
            b = result.first_bad_layer
            con.print(f"[E] First layer whose error leaves tolerance: #{b.index} {b.layer} ({b.op_type}, "
                      f"{b.precision}) output '{b.tensor}': {b.mismatches}/{b.elements} elements out of tolerance, "
                      f"max abs error {_g(b.max_abs)}. Layers before it are within tolerance.")
        else:
            con.print("[I] Every compared layer output is within tolerance.")
    names = [o.name for o in result.outputs]
    on = " (on synthetic inputs)" if result.synthetic else ""
    if result.verdict == "PASSED":
        con.print(f"[I] PASSED | All outputs matched{on} | Outputs: {names}")
    elif result.verdict == "INCONCLUSIVE":
        bad = [o.name for o in result.outputs if o.verdict == "INCONCLUSIVE"]
        con.print(f"[E] INCONCLUSIVE | Vacuous checks on outputs: {bad}{on} | Outputs: {names}")
    else:
        bad = [o.name for o in result.outputs if o.verdict == "FAILED"]
        con.print(f"[E] FAILED | Mismatched outputs: {bad}{on} | Outputs: {names}")


# --- command line ------------------------------------------------------------------------------------


def add_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare", help="compare an engine's outputs with the ONNX model run by onnxruntime (Polygraphy style)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", metavar="REF", help="the ONNX model (run by onnxruntime), or MODULE:FACTORY for a "
                   "PyTorch module")
    p.add_argument("engine", metavar="ENGINE", nargs="?", help="the engine file (.kiln); leave it out with --runners")
    p.add_argument("--runners", metavar="LIST", help="compare several backends on the same inputs instead of one "
                   "engine: kiln-fp32,kiln-tf32,kiln-fp16,kiln-bf16,kiln-int8,kiln-fp8,onnxruntime,torch")
    p.add_argument("--reference-runner", metavar="NAME", help="with --runners: the runner the others are compared "
                   "with (default onnxruntime when listed, else the first)")
    p.add_argument("--torch", metavar="MODULE:FACTORY", help="with --runners: the PyTorch module of the 'torch' runner")
    p.add_argument("--calib", metavar="DATA", help="with --runners: calibration data for kiln-int8/kiln-fp8 (default: "
                   "the compared inputs, and the report says so)")
    p.add_argument("--save-inputs", dest="save_inputs", metavar="FILE.json", help="write the inputs used, in "
                   "Polygraphy's --save-inputs JSON")
    p.add_argument("--save-outputs", dest="save_outputs", metavar="FILE.json", help="write every runner's outputs, "
                   "in Polygraphy's RunResults JSON (--save-outputs)")
    p.add_argument("--loadInputs", "--load-inputs", metavar="PATH", help="inputs: a .npz keyed by input name, a "
                   "folder of .npz samples, NAME:FILE.npy,..., or Polygraphy's --save-inputs JSON (FILE.json)")
    p.add_argument("--seed", type=int, default=0, help="seed for synthetic inputs (default 0)")
    p.add_argument("--samples", type=int, default=1, help="number of synthetic input samples (default 1)")
    p.add_argument("--shapes", default="", metavar="SPEC", help="synthetic input shapes, x:4x3x224x224,...")
    p.add_argument("--valRange", nargs="+", metavar="NAME:LO,HI", help="value range of synthetic inputs "
                   "(Polygraphy's spelling), e.g. input_ids:0,30521 pixel:[0,1]; LO,HI alone for every input")
    p.add_argument("--profile", type=int, default=0, help="optimization profile to run with")
    p.add_argument("--atol", action="append", metavar="[OUT:]TOL", help="absolute tolerance; repeat or use "
                   "OUT:TOL for one output (default f x RMS of each output, f by precision: fp32 1e-4, "
                   "tf32/fp16 1e-2, bf16 4e-2, int8 1e-1, fp8 1.5e-1, int4 2e-1; integer outputs exact)")
    p.add_argument("--rtol", action="append", metavar="[OUT:]TOL", help="relative tolerance (same forms; "
                   "default f)")
    p.add_argument("--acceptVacuous", "--accept-vacuous", dest="accept_vacuous", action="store_true",
                   help="count a vacuous check (one a constant output "
                   "would pass) as passed instead of INCONCLUSIVE (exit 3); the warning stays")
    p.add_argument("--layerwise", action="store_true", help="also compare every layer output that exists in the "
                   "ONNX graph; report the first one out of tolerance")
    p.add_argument("--no-histogram", action="store_true", help="leave out the error histograms")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu (where the engine runs)")
    add_verify_key_flag(p)
    p.set_defaults(func=run)
    return p


def _run_runners(args, con) -> int:
    from ..engine.synthetic import parse_val_range
    from . import runners

    if args.engine:
        raise ConfigError("--runners builds its own engines from the model: leave out ENGINE (or drop --runners to "
                          f"compare {args.engine} with the model).")
    names = runners.parse_runners(args.runners)
    atol, per_atol = parse_named_floats(args.atol, "--atol")
    rtol, per_rtol = parse_named_floats(args.rtol, "--rtol")
    if per_atol or per_rtol:
        raise ConfigError("--runners takes one --atol/--rtol for every output (OUT:TOL is for an engine compare).")
    from ..engine.profile import parse_shapes

    shapes = parse_shapes(args.shapes or "", "--shapes")
    samples, inputs = None, ""
    model_inputs = runners.input_names(args.reference)
    if args.loadInputs:
        samples, inputs = load_inputs(args.loadInputs, model_inputs), f"--loadInputs {args.loadInputs}"
    result = runners.run_runners(args.reference, names, samples=samples, inputs=inputs, shapes=shapes,
                                 torch_module=args.torch, calib=args.calib, reference_runner=args.reference_runner,
                                 device=args.device, seed=args.seed, count=args.samples,
                                 val_range=parse_val_range(args.valRange, model_inputs), atol=atol, rtol=rtol,
                                 accept_vacuous=args.accept_vacuous, build=args.build)
    runners.render(result, con)
    _save_polygraphy(args, con, result.samples_used, result.outputs, result.runtimes)
    if args.json:
        atomic_write_json(args.json, result.to_json())
        con.print(f"[I] Results written to {args.json}")
    return {"PASSED": 0, "FAILED": EXIT_FAILED, "INCONCLUSIVE": EXIT_INCONCLUSIVE}[result.verdict]


def load_inputs(path: str, input_names: list[str]) -> list[dict]:
    """--loadInputs: Polygraphy's --save-inputs JSON (a .json file), else what load_samples reads."""
    if path.lower().endswith(".json"):
        from . import polygraphy_json

        return polygraphy_json.load_inputs(path, input_names, what="--loadInputs")
    return load_samples(path, input_names)


def _save_polygraphy(args, con, samples, outputs: dict, runtimes: dict | None = None) -> None:
    from . import polygraphy_json

    if args.save_inputs:
        polygraphy_json.save_inputs(args.save_inputs, samples)
        con.print(f"[I] Inputs written to {args.save_inputs} (Polygraphy --save-inputs JSON)")
    if args.save_outputs:
        polygraphy_json.save_outputs(args.save_outputs, outputs, runtimes)
        con.print(f"[I] Outputs written to {args.save_outputs} (Polygraphy RunResults JSON)")


def run(args) -> int:
    con = console()
    if args.runners and args.verifyKey:
        raise ConfigError("--verifyKey checks an engine file: it goes with ENGINE, not --runners (which build "
                          "their engines).")
    if args.runners:
        return _run_runners(args, con)
    if not args.engine:
        raise ConfigError("kiln compare needs ENGINE (the .kiln file to check against REF), or --runners LIST to build "
                          "and compare several backends.")
    for flag, value in (("--torch", args.torch), ("--calib", args.calib), ("--referenceRunner", args.reference_runner)):
        if value:
            raise ConfigError(f"{flag} goes with --runners.")
    engine = load_engine(args.engine, args.device, verify_key=verify_key_of(args))
    atol, per_atol = parse_named_floats(args.atol, "--atol")
    rtol, per_rtol = parse_named_floats(args.rtol, "--rtol")
    from ..engine.synthetic import parse_val_range

    shapes = parse_shapes_arg(args.shapes, engine)
    val_range = parse_val_range(args.valRange, [v.name for v in engine.inputs])
    if args.samples < 1:
        raise ConfigError("--samples must be at least 1.")
    calib = None if (args.loadInputs or shapes or val_range) else calibration_samples(engine, args.profile)
    if args.loadInputs:
        samples = split_to_profile(engine, load_inputs(args.loadInputs, [v.name for v in engine.inputs]), args.profile)
        inputs = f"--loadInputs {args.loadInputs}"
    elif calib:
        samples, inputs = calib
    else:
        samples = synthetic_samples(engine, args.profile, args.seed, args.samples, shapes, val_range)
        inputs = "synthetic"
    result = compare(args.reference, engine, samples, profile=args.profile, atol=atol, rtol=rtol,
                     per_output_atol=per_atol, per_output_rtol=per_rtol, layerwise=args.layerwise,
                     val_range=val_range, inputs=inputs, accept_vacuous=args.accept_vacuous)
    render(result, con, histogram=not args.no_histogram)
    if args.save_inputs or args.save_outputs:
        _save_polygraphy(args, con, samples, {"kiln": result.engine_outputs, result.reference_kind:
                                              result.reference_outputs})
    if args.json:
        atomic_write_json(args.json, result.to_json())
        con.print(f"[I] Results written to {args.json}")
    return {"PASSED": 0, "FAILED": EXIT_FAILED, "INCONCLUSIVE": EXIT_INCONCLUSIVE}[result.verdict]


def parse_named_floats(values: list[str] | None, flag: str) -> tuple[float | None, dict[str, float]]:
    """['1e-3', 'out:1e-2'] -> (1e-3, {'out': 1e-2}); comma lists allowed in each value."""
    default, per = None, {}
    for item in [x for v in (values or []) for x in v.split(",") if x.strip()]:
        name, _, num = item.rpartition(":")
        try:
            val = float(num)
        except ValueError:
            raise ConfigError(f"{flag}: '{item}' should be a number or OUTPUT:NUMBER (e.g. {flag} 1e-3 or "
                              f"{flag} logits:1e-2).") from None
        if val < 0:
            raise ConfigError(f"{flag}: '{item}' is negative.")
        if name:
            per[name] = val
        else:
            default = val
    return default, per
