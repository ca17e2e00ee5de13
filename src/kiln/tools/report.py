"""`kiln report ENGINE`: one page that answers the litmus tests for an engine.

    kiln report model.kiln --latencyTarget 2.5 --traffic shapes.txt --reference model.onnx \\
        --data held_out.npz --budget top1=0.5 --out model.report

writes model.report.html (self-contained: inline CSS and SVG, no scripts, no
network) and its markdown twin model.report.md. The questions:

1. Latency: does the engine meet --latencyTarget (ms, median by default) on
   this device? The page says which device measured it; a CPU figure is not a
   GPU figure.
2. Profile coverage: does every shape in the --traffic file fit a profile?
   Lists the shapes each profile would reject. Traffic: JSON (a list of
   {"input": [dims], "count": n}, or of "x:4x3x32x32" strings, or of batch
   sizes) or text, one request per line: `x:4x3x32x32,mask:4x128 [count]` or a
   bare batch size `4 [count]`; `#` starts a comment.
3. Accuracy: compare with the reference (--reference) and the task-metric gate
   (--data, --metric, --budget); for INT8/FP8 engines, the calibration record.
4. Inspector: fusions that did not fire, layers above the requested precision.

Plots: latency distribution, per-layer time breakdown, error histogram.
Exit status 1 when a litmus test fails, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..console import console, device_note
from ..errors import ConfigError, KilnError
from ..fileio import atomic_write_text
from ..ir.shapes import fmt_shape
from ..json_file import atomic_write_json
from ..samples import load_samples
from . import inspect as inspect_tool
from . import plots
from .engine_args import (
    add_verify_key_flag,
    load_engine,
    parse_shapes_arg,
    verify_key_of,
)

_STAT_KEYS = {"median": "median", "mean": "mean", "p90": "p90", "p95": "p95", "p99": "p99", "max": "max", "min": "min"}


# --- traffic and profile coverage ----------------------------------------------------------------------------


@dataclass
class Request:
    shapes: dict[str, tuple]
    count: int = 1

    @property
    def text(self) -> str:
        return ",".join(f"{k}:{fmt_shape(v)}" for k, v in self.shapes.items())


def _parse_entry(item, engine, where: str) -> Request:
    from ..engine.profile import parse_shapes

    names = [v.name for v in engine.inputs]
    count = 1
    if isinstance(item, dict) and "shapes" in item:
        count = item.get("count", 1)
        item = item["shapes"]
    elif isinstance(item, dict) and "count" in item:
        count = item["count"]
        item = {k: v for k, v in item.items() if k != "count"}
    if isinstance(item, dict) and "batch" in item and len(item) == 1:
        item = int(item["batch"])
    if isinstance(item, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"--traffic {where}: a count must be a whole number >= 0.")
    if isinstance(item, int):
        if item < 1:
            raise ConfigError(f"--traffic {where}: batch size {item} must be at least 1.")
        shapes = {}
        for v in engine.inputs:
            opt = list(engine.get_profile_shape(0, v.name)[1])
            if not opt:
                raise ConfigError(f"--traffic {where}: a bare batch size needs inputs with a batch axis; '{v.name}' is "
                                  "a scalar. Give full shapes (x:4x3x32x32).")
            shapes[v.name] = tuple([item] + opt[1:])
        return Request(shapes, count)
    if isinstance(item, str):
        shapes = parse_shapes(item, f"--traffic {where}")
    elif isinstance(item, dict):
        shapes = {}
        for k, v in item.items():
            if not isinstance(v, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in v):
                raise ConfigError(f"--traffic {where}: the shape of '{k}' should be a list of dimensions, got {v!r}.")
            shapes[k] = tuple(v)
    else:
        raise ConfigError(f"--traffic {where}: expected a shape like x:4x3x32x32, a {{input: [dims]}} object or a "
                          f"batch size, got {item!r}.")
    unknown = [k for k in shapes if k not in names]
    if unknown:
        raise ConfigError(f"--traffic {where}: {unknown} are not inputs of this engine; its inputs are {names}.")
    if not shapes:
        raise ConfigError(f"--traffic {where}: empty request.")
    return Request({k: tuple(v) for k, v in shapes.items()}, count)


def load_traffic(path, engine) -> list[Request]:
    """Observed request shapes, merged by shape (counts summed)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--traffic: file '{path}' does not exist.")
    text = path.read_text()
    reqs: list[Request] = []
    stripped = text.lstrip()
    if path.suffix == ".json" or stripped.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--traffic: '{path}' is not valid JSON ({e}).") from None
        if isinstance(data, dict):
            data = data.get("requests", data.get("shapes", [data]))
        if not isinstance(data, list):
            raise ConfigError(f"--traffic: '{path}' should hold a list of requests.")
        reqs = [_parse_entry(x, engine, f"{path.name} item {i}") for i, x in enumerate(data)]
    else:
        for no, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            count = 1
            if len(parts) > 1:
                try:
                    count = int(parts[-1].lstrip("x*"))
                except ValueError:
                    raise ConfigError(f"--traffic {path.name} line {no}: "
                                      f"'{parts[-1]}' should be a request count.") from None
                line = " ".join(parts[:-1])
            entry = line.removeprefix("batch=").removeprefix("batch:")
            item = int(entry) if entry.isdigit() else line
            r = _parse_entry(item, engine, f"{path.name} line {no}")
            r.count = count
            reqs.append(r)
    merged: dict[str, Request] = {}
    for r in reqs:
        if r.text in merged:
            merged[r.text].count += r.count
        else:
            merged[r.text] = Request(dict(r.shapes), r.count)
    if not merged:
        raise ConfigError(f"--traffic: '{path}' holds no requests.")
    return list(merged.values())


def reject_reason(profile: dict, shapes: dict[str, tuple]) -> str | None:
    """Why a profile ({input: {min, opt, max}}) would refuse these shapes, or None if it takes them."""
    for name, shape in shapes.items():
        if name not in profile:
            return f"'{name}' is not an input"
        lo, hi = profile[name]["min"], profile[name]["max"]
        if len(shape) != len(lo):
            return f"'{name}' has rank {len(shape)}, the engine expects {len(lo)}"
        for axis, (d, a, b) in enumerate(zip(shape, lo, hi)):
            if not a <= d <= b:
                return f"'{name}' axis {axis} is {d}, outside [{a}, {b}]"
    return None


def coverage(profiles: list[dict], requests: list[Request]) -> dict:
    rows = []
    for r in requests:
        reasons = {i: reject_reason(p, r.shapes) for i, p in enumerate(profiles)}
        rows.append({"shape": r.text, "count": r.count, "accepted_by": [i for i, x in reasons.items() if x is None],
                     "reasons": {i: x for i, x in reasons.items() if x is not None}})
    total = sum(r["count"] for r in rows)
    rejected = [r for r in rows if not r["accepted_by"]]
    return {
        "requests": total, "distinct": len(rows), "rows": rows,
        "rejected": rejected, "rejected_requests": sum(r["count"] for r in rejected),
        "per_profile": [{"profile": i, "accepts": sum(r["count"] for r in rows if i in r["accepted_by"]),
                         "rejects": [r for r in rows if i not in r["accepted_by"]]} for i in range(len(profiles))],
    }


# --- the report -----------------------------------------------------------------------------------------------


@dataclass
class Litmus:
    question: str
    status: str  # pass, fail, warn, unknown
    answer: str


@dataclass
class Report:
    engine: str
    target: str
    on_gpu: bool
    device_note: str
    precision: str
    versions: dict
    created: str
    command: str
    profiles: list
    litmus: list[Litmus] = field(default_factory=list)
    bench: object = None  # bench.BenchResult
    bench_error: str = ""
    latency_target: float | None = None
    latency_stat: str = "median"
    coverage: dict | None = None
    compare: object = None  # compare.CompareResult
    compare_error: str = ""
    verify: object = None  # verify.VerifyResult
    verify_error: str = ""
    calibration: str = ""
    calibration_status: str = "unknown"
    inspection: object = None  # inspect.Inspection

    @property
    def passed(self) -> bool:
        return not any(x.status == "fail" for x in self.litmus)

    def to_json(self) -> dict:
        return {
            "engine": self.engine, "target": self.target, "precision": self.precision, "created": self.created,
            "command": self.command, "passed": self.passed,
            "litmus": [x.__dict__ for x in self.litmus],
            "latency_target_ms": self.latency_target, "latency_stat": self.latency_stat,
            "bench": self.bench.to_json() if self.bench else None, "bench_error": self.bench_error,
            "coverage": self.coverage,
            "compare": self.compare.to_json() if self.compare else None, "compare_error": self.compare_error,
            "verify": self.verify.to_json() if self.verify else None, "verify_error": self.verify_error,
            "calibration": self.calibration,
            "findings": self.inspection.findings if self.inspection else [],
        }


def build_report(engine, *, engine_label: str | None = None, latency_target: float | None = None,
                 latency_stat: str = "median", traffic=None, reference=None, data=None, metrics=None,
                 budgets=None, samples=None, shapes=None, profile: int = 0, iterations: int = 100,
                 warmup_ms: float = 200.0, profile_iterations: int = 5, run_bench: bool = True,
                 device: str = "auto", command: str = "", on_step=None, calib_cache=None,
                 calib_validation=None, samples_label: str | None = None) -> Report:
    """Measure and answer the four litmus tests for an engine (Engine or .kiln path)."""
    from . import bench as bench_tool
    from . import compare as compare_tool
    from . import verify as verify_tool

    step = on_step or (lambda m: None)
    if latency_stat not in _STAT_KEYS:
        raise ConfigError(f"--latencyStat must be one of {sorted(_STAT_KEYS)}.")
    if latency_target is not None and not (latency_target > 0 and math.isfinite(latency_target)):
        raise ConfigError("--latencyTarget must be a positive number of milliseconds.")
    label = engine_label or (str(engine) if isinstance(engine, (str, Path)) else "engine (in memory)")
    engine = load_engine(engine, device)
    requests = load_traffic(traffic, engine) if traffic else None
    rep = Report(engine=label, target=engine.target.describe(), on_gpu=engine.target.kind == "cuda",
                 device_note=device_note(engine.target), precision=engine.precision,
                 versions=dict(engine.versions),
                 created=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 command=command, profiles=[p.to_json() for p in engine.profiles], latency_target=latency_target,
                 latency_stat=latency_stat)

    step("inspecting")
    rep.inspection = inspect_tool.inspect_engine(engine, measure=False)

    if run_bench:
        step("timing")
        try:
            rep.bench = bench_tool.bench(engine, samples=samples, profile=profile, shapes=shapes,
                                         iterations=iterations, warmup_ms=warmup_ms, dump_profile=True,
                                         profile_iterations=profile_iterations)
        except KilnError as e:
            rep.bench_error = str(e)

    if requests is not None:
        rep.coverage = coverage(rep.profiles, requests)

    data_samples = None
    if data is not None:
        try:
            arrays, labels, _ = verify_tool.load_data(data, [v.name for v in engine.inputs])
            p, chunk, _ = verify_tool.plan_chunks(engine, arrays, None, None)
            if p == profile:
                data_samples = [{k: v[:chunk] for k, v in arrays.items()}]
        except KilnError:
            data_samples = None  # the metric gate below reports the problem
    if reference is not None:
        step("comparing with the reference")
        try:
            given = samples if samples is not None else data_samples
            label = (samples_label or "given samples") if samples is not None else \
                (f"--data {data} (first chunk)" if data_samples is not None else None)
            rep.compare = compare_tool.compare(reference, engine, given, profile=profile, shapes=shapes,
                                               inputs=label)
        except KilnError as e:
            rep.compare_error = str(e)
    if data is not None:
        step("metric gate")
        try:
            rep.verify = verify_tool.verify(engine, data, reference=reference, metrics=metrics or ["top1"],
                                            budgets=budgets)
        except KilnError as e:
            rep.verify_error = str(e)
    _calibration(rep, engine)
    if calib_cache and calib_validation:
        step("calibration coverage")
        _calibration_coverage(rep, calib_cache, reference, calib_validation)
    _answer(rep)
    return rep


def _calibration_coverage(rep: Report, cache, reference, validation) -> None:
    """Was the calibration set representative? Validation values against the calibrated ranges."""
    from ..quant.calibrate import Calibration
    from ..quant.coverage import check_coverage

    if reference is None or not str(reference).endswith(".onnx"):
        raise ConfigError("--calibValidation runs the validation set through the FP32 model: give --reference "
                          "model.onnx (the model the engine was built from).")
    cov = check_coverage(Calibration.load(cache), str(reference), validation)
    found = "; ".join(cov.flags[:6]) + (f" (and {len(cov.flags) - 6} more)" if len(cov.flags) > 6 else "")
    rep.calibration = (f"{rep.calibration}. Coverage on {validation}: "
                       + ("the calibration set covers the validation set" if cov.ok else found))
    rep.calibration_status = "pass" if cov.ok else "warn"


def _calibration(rep: Report, engine) -> None:
    from .compare import engine_precision

    quant = engine_precision(engine) in ("int8", "fp8", "int4")
    calib = engine.build_config.get("calibration")
    if not quant:
        rep.calibration, rep.calibration_status = (f"not applicable: a {engine.precision} engine has no calibrated "
                                                   "scales"), "n/a"
    elif calib:
        items = calib.items() if isinstance(calib, dict) else [("record", calib)]
        rep.calibration = "; ".join(f"{k}: {v}" for k, v in items)
        rep.calibration_status = "pass"
    else:
        rep.calibration = "the engine records no calibration data: representativeness cannot be checked"
        rep.calibration_status = "warn"


def _answer(rep: Report) -> None:
    # 1. latency
    q1 = "Does the engine meet the latency floor on the target GPU?"
    b = rep.bench
    if b is None:
        rep.litmus.append(Litmus(q1, "unknown", rep.bench_error or "not measured (--noBench)."))
    else:
        lat = b.timings.to_json()["latency_ms"]
        value = lat[_STAT_KEYS[rep.latency_stat]]
        shape = ", ".join(f"{k}: {fmt_shape(v)}" for k, v in b.shapes.items())
        where = f"at {shape} on {b.target}"
        if rep.latency_target is None:
            rep.litmus.append(Litmus(q1, "unknown", f"no --latencyTarget given; {rep.latency_stat} latency is "
                                     f"{value:.4g} ms {where}."))
        else:
            ok = value <= rep.latency_target
            verdict = (f"{rep.latency_stat} latency {value:.4g} ms {'<=' if ok else '>'} target "
                       f"{rep.latency_target:g} ms {where} (p99 {lat['p99']:.4g} ms)")
            if rep.on_gpu:
                rep.litmus.append(Litmus(q1, "pass" if ok else "fail", verdict + "."))
            else:
                rep.litmus.append(Litmus(q1, "warn", verdict + ": a CPU measurement with the reference kernels, not "
                                         "the target GPU. Run the report on the GPU the engine is for."))
    # 2. coverage
    q2 = "Do the profiles' min and max cover every shape production sends?"
    c = rep.coverage
    if c is None:
        rep.litmus.append(Litmus(q2, "unknown", "no --traffic file of observed shapes given."))
    elif not c["rejected"]:
        rep.litmus.append(Litmus(q2, "pass", f"all {c['requests']} observed requests ({c['distinct']} distinct shapes) "
                                 "fit a profile."))
    else:
        shown = "; ".join(f"{r['shape']} (x{r['count']})" for r in c["rejected"][:5])
        more = f" and {len(c['rejected']) - 5} more" if len(c["rejected"]) > 5 else ""
        rep.litmus.append(Litmus(q2, "fail", f"{c['rejected_requests']} of {c['requests']} requests would be rejected: "
                                 f"{shown}{more}."))
    # 3. accuracy
    q3 = "Was accuracy measured, and is it within budget?" + (
        " Was calibration data representative?" if rep.calibration_status not in ("n/a",) else "")
    parts, statuses = [], []
    if rep.compare is not None:
        cmp = rep.compare
        worst = max((o.abs_err.get("max", 0.0) for o in cmp.outputs), default=0.0)
        # The verdict, not `passed`: an INCONCLUSIVE (vacuous) check neither matches nor mismatches.
        verdict = cmp.verdict
        statuses.append({"PASSED": "pass", "FAILED": "fail"}.get(verdict, "warn"))
        said = {"PASSED": "match", "FAILED": "DO NOT match"}.get(
            verdict, "are within tolerance of, but the check is vacuous (a constant output would pass it), so "
                     "this does not show they match,")
        parts.append(f"outputs {said} the reference (max abs error {worst:.3g}, {cmp.samples} sample(s) of "
                     f"{_inputs_text(cmp)})")
    elif rep.compare_error:
        statuses.append("fail")
        parts.append(f"compare failed: {rep.compare_error}")
    if rep.verify is not None:
        v = rep.verify
        gated = [m for m in v.metrics if m.passed is not None]
        txt = ", ".join(f"{m.name} {_metric(m.engine, m.unit)}" + (f" vs {_metric(m.reference, m.unit)} reference"
                                                                    if m.reference is not None else "")
                        for m in v.metrics)
        if any(m.passed is False for m in gated):
            statuses.append("fail")
            parts.append(f"metric gate FAILED: {txt}")
        elif gated:
            statuses.append("pass")
            parts.append(f"metric gate passed: {txt}")
        else:
            statuses.append("warn")
            parts.append(f"task metric {txt} (no budget given)")
    elif rep.verify_error:
        statuses.append("fail")
        parts.append(f"metric gate failed: {rep.verify_error}")
    if rep.calibration_status == "warn":
        statuses.append("warn")
        parts.append(rep.calibration)
    if not parts:
        rep.litmus.append(Litmus(q3, "unknown", "not measured: give --reference (compare) and --data (metric gate)."))
    else:
        if "fail" in statuses:
            status = "fail"
        elif "warn" in statuses:
            status = "warn"
        elif rep.verify is None:
            status = "warn"
            parts.append("no held-out task metric (give --data)")
        else:
            status = "pass"
        rep.litmus.append(Litmus(q3, status, "; ".join(parts) + "."))
    # 4. inspector
    q4 = "Did the inspector confirm that the intended fusions and precisions applied?"
    fs = rep.inspection.findings if rep.inspection else []
    missed = [f for f in fs if f.get("kind") == "fusion-missed"]
    prec = [f for f in fs if f.get("kind") == "precision"]
    unexplained = [f for f in prec if not f.get("reason") or f.get("reason") == "no reason recorded by the builder"]
    if not fs:
        rep.litmus.append(Litmus(q4, "pass", f"{inspect_tool.no_findings(rep.precision)}."))
    else:
        status = "fail" if unexplained else "warn"
        bits = []
        if missed:
            bits.append(f"{len(missed)} fusion(s) did not fire")
        if prec:
            bits.append(f"{len(prec)} layer(s) run above the requested precision"
                        + (f" ({len(unexplained)} without a reason)" if unexplained
                           else " (each with a recorded reason)"))
        other = len(fs) - len(missed) - len(prec)
        if other:
            bits.append(f"{other} other finding(s)")
        rep.litmus.append(Litmus(q4, status, "; ".join(bits) + ": see Inspector findings."))


def _metric(v, unit) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}%" if unit == "%" else f"{v:.4g}"


# --- HTML --------------------------------------------------------------------------------------------------------

_CSS = """
:root{--ok:#1e7d3a;--bad:#b3261e;--warn:#9a6700;--unk:#5f6670;--line:#d9dde3;--bg:#f6f7f9;--ink:#1f2328}
*{box-sizing:border-box}body{margin:0;background:var(--bg);color:var(--ink);
font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
main{max-width:1040px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}\
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid var(--line);padding-bottom:4px}
.meta{color:#57606a;font-size:12.5px}
section{background:#fff;border:1px solid var(--line);border-radius:8px;padding:14px 18px;margin:14px 0}
table{border-collapse:collapse;width:100%;font-size:13px}\
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line);
vertical-align:top}th{background:#f0f2f5;font-weight:600}\
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.badge{display:inline-block;min-width:64px;text-align:center;border-radius:12px;padding:1px 10px;font-weight:700;
font-size:12px;color:#fff}
.pass{background:var(--ok)}.fail{background:var(--bad)}.warn{background:var(--warn)}\
.unknown,.n\\/a{background:var(--unk)}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
pre{background:#f6f8fa;border:1px solid var(--line);border-radius:6px;padding:8px;overflow-x:auto}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plots svg{background:#fff;max-width:100%;height:auto}
.note{color:#57606a;font-size:12.5px}
"""


@dataclass(frozen=True)
class Badge:
    """A table cell drawn as a status badge (pass, fail, warn, unknown, n/a)."""
    status: str


_BADGE_LABELS = {"pass": "PASS", "fail": "FAIL", "warn": "CHECK", "unknown": "NOT RUN", "n/a": "N/A"}


@functools.cache
def _template():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("kiln.tools", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.tests["badge"] = lambda x: isinstance(x, Badge)
    return env.get_template("report.html.j2")


def _stat_rows(j: dict) -> list[list]:
    rows = []
    for label, key in (("Latency", "latency_ms"), ("Enqueue Time", "enqueue_ms"), ("H2D Latency", "h2d_ms"),
                       ("GPU Compute Time", "gpu_compute_ms"), ("D2H Latency", "d2h_ms")):
        s = j.get(key)
        if s:
            rows.append([label] + [f"{s[k]:.4f}" for k in ("min", "median", "mean", "p90", "p95", "p99", "max")])
    return rows


def render_html(rep: Report) -> str:
    """The report's page: templates/report.html.j2, every value escaped (the plots are SVG that plots.py made)."""
    bench = None
    b = rep.bench
    if b is not None:
        j = b.timings.to_json()
        plot_svgs = [plots.histogram(b.timings.latency_ms, "Latency distribution", "latency (ms)",
                                     marker=rep.latency_target,
                                     marker_label=f"target {rep.latency_target:g} ms" if rep.latency_target else "")]
        if b.layers:
            plot_svgs.append(plots.hbars([(x.name, x.mean_ms) for x in b.layers], "Per-layer time (mean per run)",
                                         " ms"))
        top = sorted(b.layers, key=lambda x: -x.mean_ms)[:15] if b.layers else []
        bench = {"note": b.device_note[0].upper() + b.device_note[1:],
                 "shapes": ", ".join(f"{k}: {fmt_shape(v)}" for k, v in b.shapes.items()), "mode": b.mode,
                 "iterations": j["iterations"], "qps": j["throughput_qps"], "samples_per_s": j["throughput_qps"] * b.batch,
                 "stat_rows": _stat_rows(j), "plots": plot_svgs,
                 "profile_iterations": b.profile_iterations,
                 "layer_rows": [[x.name, x.op_type, x.precision, x.tactic, f"{x.mean_ms:.4f}", f"{x.share:.1f}%"]
                                for x in top]}
    c = rep.coverage
    coverage_rows = [] if c is None else [
        [r["shape"], r["count"], ", ".join(map(str, r["accepted_by"])) or "none",
         "; ".join(f"profile {i}: {why}" for i, why in r["reasons"].items()) or "-"] for r in c["rows"]]
    layers = None
    if rep.inspection:
        dev = [x for x in rep.inspection.layers if x.placement == "device"]
        counts: dict[str, int] = {}
        for x in dev:
            counts[x.precision] = counts.get(x.precision, 0) + 1
        layers = {"device": len(dev), "precisions": ", ".join(f"{n} {p}" for p, n in sorted(counts.items())),
                  "fused": sum(len(x.sources) > 1 for x in dev), "host": len(rep.inspection.layers) - len(dev)}
    return _template().render(
        rep=rep, CSS=_CSS, BADGE_LABELS=_BADGE_LABELS, engine_name=Path(rep.engine).name,
        litmus_rows=[[Badge(x.status), x.question, x.answer] for x in rep.litmus], bench=bench,
        profile_rows=[[f"profile {i}", "; ".join(f"{k}: {fmt_shape(v['min'])} .. {fmt_shape(v['max'])}"
                                                 f" (opt {fmt_shape(v['opt'])})" for k, v in p.items())]
                      for i, p in enumerate(rep.profiles)],
        coverage=c, coverage_rows=coverage_rows, compare=_compare_view(rep.compare), verify=_verify_view(rep.verify),
        findings=[inspect_tool.describe_finding(f) for f in (rep.inspection.findings if rep.inspection else [])],
        no_findings=inspect_tool.no_findings(rep.precision), layers=layers)


def _inputs_text(cmp) -> str:
    """Where the compared inputs came from; synthetic ones say so, and how each was drawn."""
    if getattr(cmp, "synthetic", False):
        rules = "; ".join(f"{k}: {v}" for k, v in (cmp.synthetic_rules or {}).items())
        return "SYNTHETIC inputs, not data" + (f" ({rules})" if rules else "")
    return getattr(cmp, "inputs", "") or "given samples"


_VERDICT_STATUS = {"PASSED": "pass", "FAILED": "fail", "INCONCLUSIVE": "warn"}


def _result_text(o) -> str:
    if o.reason:
        return o.reason
    if o.verdict == "INCONCLUSIVE":
        return (f"within tolerance, but vacuous: the constant {o.constant_that_passes:.5g} would pass too"
                if o.constant_that_passes is not None else "within tolerance, but vacuous")
    return "within tolerance"


def _compare_view(cmp) -> dict | None:
    """What the page shows of a comparison: its table rows and error histograms."""
    if cmp is None:
        return None
    rows = [[Badge(_VERDICT_STATUS.get(o.verdict, "fail")), o.name, _tolerance(o), _g(o.abs_err.get("max")),
             _g(o.abs_err.get("median")), _g(o.abs_err.get("p99")), _g(o.rel_err.get("max")),
             f"{o.engine_nan}/{o.engine_inf}", _g(o.min_atol), _result_text(o)] for o in cmp.outputs]
    svgs = []
    for o in cmp.outputs:
        bins = [("0" if b["hi"] == 0 else (f"<{b['hi']:.0e}" if b["lo"] == 0 else f"{b['lo']:.0e}"), b["count"])
                for b in o.histogram]
        svgs.append(plots.columns(bins, f"Absolute error of '{o.name}'", "|engine - reference| (decade bins)"))
    x = cmp.first_bad_layer
    first_bad = None if not x else {"layer": x.layer, "op_type": x.op_type, "precision": x.precision,
                                    "tensor": x.tensor, "max_abs": _g(x.max_abs)}
    return {"reference": cmp.reference, "samples": cmp.samples, "inputs": _inputs_text(cmp), "rows": rows,
            "plots": svgs, "first_bad": first_bad}


def _verify_view(v) -> dict | None:
    """What the page shows of the metric gate: one row per metric."""
    if v is None:
        return None
    rows = [[Badge({True: "pass", False: "fail", None: "unknown"}[m.passed]), m.name, _metric(m.reference, m.unit),
             _metric(m.engine, m.unit),
             "-" if m.drop is None else (f"{m.drop:+.2f}" if m.unit == "%" else f"{m.drop:+.4g}"),
             "-" if m.budget is None else f"{m.budget:g}"] for m in v.metrics]
    return {"source": v.source, "samples": v.samples, "output": v.output, "rows": rows, "agreement": v.agreement}


def _tolerance(o) -> str:
    """atol / rtol of one output, with how a range-relative default atol was reached."""
    basis = f" ({o.atol_basis})" if o.atol_basis else ""
    return f"{o.atol:.3g}{basis} / {o.rtol:g}"


def _g(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.3g}"


# --- markdown ----------------------------------------------------------------------------------------------------


def _md_escape(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _md_table(headers, rows) -> list[str]:
    lines = ["| " + " | ".join(_md_escape(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_md_escape(x) for x in r) + " |" for r in rows]
    return lines + [""]


def render_markdown(rep: Report) -> str:
    from .compare import render_histogram

    mark = {"pass": "PASS", "fail": "FAIL", "warn": "CHECK", "unknown": "NOT RUN", "n/a": "N/A"}
    L = [f"# Kiln engine report: {Path(rep.engine).name}", "",
         f"{rep.engine} · {rep.target} · precision {rep.precision} · {rep.created}", ""]
    if not rep.on_gpu:
        L += [f"> Device: {rep.device_note}.", ""]
    L += ["## Litmus tests", ""]
    L += _md_table(["", "Question", "Answer"], [[f"**{mark[x.status]}**", x.question, x.answer] for x in rep.litmus])
    L += ["## 1. Latency", ""]
    b = rep.bench
    if b is None:
        L += [rep.bench_error or "Not measured (--noBench).", ""]
    else:
        j = b.timings.to_json()
        shape = ", ".join(f"{k}: {fmt_shape(v)}" for k, v in b.shapes.items())
        L += [f"{b.device_note[0].upper() + b.device_note[1:]}; inputs {shape}; {b.mode}; "
              f"{j['iterations']} timed runs; throughput {j['throughput_qps']:.2f} qps.", ""]
        if rep.latency_target is not None:
            L += [f"Target: {rep.latency_stat} latency <= **{rep.latency_target:g} ms**.", ""]
        L += _md_table(["ms", "min", "median", "mean", "p90", "p95", "p99", "max"], _stat_rows(j))
        if b.layers:
            L += [f"Per-layer time ({b.profile_iterations} layer-by-layer runs, no CUDA graph), top 15:", ""]
            top = sorted(b.layers, key=lambda x: -x.mean_ms)[:15]
            L += _md_table(["Layer", "Type", "Precision", "Tactic", "mean ms", "share"],
                           [[x.name, x.op_type, x.precision, x.tactic, f"{x.mean_ms:.4f}", f"{x.share:.1f}%"]
                            for x in top])
    L += ["## 2. Profile coverage", ""]
    L += _md_table(["Profile", "min .. max (opt)"],
                   [[f"profile {i}", "; ".join(f"{k}: {fmt_shape(v['min'])} .. {fmt_shape(v['max'])} "
                                               f"(opt {fmt_shape(v['opt'])})" for k, v in p.items())]
                    for i, p in enumerate(rep.profiles)])
    c = rep.coverage
    if c is None:
        L += ["No --traffic file given: coverage of production shapes was not checked.", ""]
    else:
        L += [f"{c['requests']} observed requests, {c['distinct']} distinct shapes; **{c['rejected_requests']}** "
              "would be rejected by every profile.", ""]
        L += _md_table(["Observed shape", "Requests", "Accepted by profile", "Rejections"],
                       [[r["shape"], r["count"], ", ".join(map(str, r["accepted_by"])) or "none",
                         "; ".join(f"profile {i}: {why}" for i, why in r["reasons"].items()) or "-"]
                        for r in c["rows"]])
    L += ["## 3. Accuracy", ""]
    cmp = rep.compare
    if cmp is not None:
        L += [f"Reference: {cmp.reference}; {cmp.samples} input sample(s) of {_inputs_text(cmp)}.", ""]
        L += _md_table(["", "Output", "atol / rtol", "max abs", "median abs", "p99 abs", "max rel", "NaN/Inf",
                        "min atol to pass", "Result"],
                       [[f"**{ {'PASSED': 'PASS', 'FAILED': 'FAIL'}.get(o.verdict, o.verdict)}**", o.name,
                         _tolerance(o),
                         _g(o.abs_err.get("max")), _g(o.abs_err.get("median")), _g(o.abs_err.get("p99")),
                         _g(o.rel_err.get("max")), f"{o.engine_nan}/{o.engine_inf}", _g(o.min_atol),
                         _result_text(o)] for o in cmp.outputs])
        for o in cmp.outputs:
            if o.histogram:
                L += [f"Absolute error of '{o.name}':", "", "```"] + render_histogram(o.histogram) + ["```", ""]
        if cmp.first_bad_layer:
            x = cmp.first_bad_layer
            L += [f"First layer out of tolerance: **{x.layer}** ({x.op_type}, {x.precision}) output '{x.tensor}'.", ""]
    elif rep.compare_error:
        L += [f"**FAIL** Compare could not run: {rep.compare_error}", ""]
    else:
        L += ["No --reference given: outputs were not compared.", ""]
    v = rep.verify
    if v is not None:
        L += [f"Metric gate on {v.source}: {v.samples} held-out samples, output '{v.output}'.", ""]
        L += _md_table(["", "Metric", "Reference", "Engine", "Drop", "Budget"],
                       [[f"**{mark[{True: 'pass', False: 'fail', None: 'unknown'}[m.passed]]}**", m.name,
                         _metric(m.reference, m.unit), _metric(m.engine, m.unit),
                         "-" if m.drop is None else (f"{m.drop:+.2f}" if m.unit == "%" else f"{m.drop:+.4g}"),
                         "-" if m.budget is None else f"{m.budget:g}"] for m in v.metrics])
    elif rep.verify_error:
        L += [f"**FAIL** Metric gate could not run: {rep.verify_error}", ""]
    else:
        L += ["No --data given: no held-out task metric.", ""]
    L += [f"Calibration: {rep.calibration}.", ""]
    L += ["## 4. Inspector findings", ""]
    fs = rep.inspection.findings if rep.inspection else []
    L += [f"- {inspect_tool.describe_finding(f)}" for f in fs] or [
        f"None: {inspect_tool.no_findings(rep.precision)}."]
    L += ["", f"Kiln {rep.versions.get('kiln')}, torch {rep.versions.get('torch')}, CUDA {rep.versions.get('cuda')} · "
              f"command: `{rep.command}`", ""]
    return "\n".join(L)


def write_report(rep: Report, prefix) -> tuple[Path, Path]:
    prefix = Path(prefix)
    html_path = prefix.with_name(prefix.name + ".html") if prefix.suffix != ".html" else prefix
    md_path = html_path.with_suffix(".md")
    atomic_write_text(html_path, render_html(rep))
    atomic_write_text(md_path, render_markdown(rep))
    return html_path, md_path


# --- command line ----------------------------------------------------------------------------------------------


def add_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="one HTML page (and markdown) answering the litmus tests for an engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", metavar="ENGINE", help="the engine file (.kiln)")
    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.html and PREFIX.md (default: ENGINE's path + .report)")
    p.add_argument("--latencyTarget", "--latency-target", dest="latency_target", type=float, metavar="MS",
                   help="the latency floor to meet, in ms")
    p.add_argument("--latencyStat", "--latency-stat", dest="latency_stat", default="median", choices=sorted(_STAT_KEYS),
                   help="statistic held to the target")
    p.add_argument("--traffic", metavar="FILE", help="observed request shapes (JSON or text; see above)")
    p.add_argument("--reference", metavar="MODEL", help="the ONNX model (onnxruntime) or MODULE:FACTORY, for compare")
    p.add_argument("--data", metavar="FILE.npz", help="held-out inputs + 'labels' for the metric gate")
    p.add_argument("--metric", action="append", metavar="NAME",
                   help="top1, top5, mae or MODULE:FUNCTION (default top1)")
    p.add_argument("--budget", action="append", metavar="METRIC=DROP", help="e.g. top1=0.5")
    p.add_argument("--loadInputs", metavar="PATH", help="inputs for timing and compare (.npz, folder, NAME:FILE.npy)")
    p.add_argument("--shapes", default="", metavar="SPEC", help="input shapes to time at (default: profile opt)")
    p.add_argument("--profile", type=int, default=0, help="optimization profile to time and compare with")
    p.add_argument("--iterations", type=int, default=100, help="timed runs (default 100)")
    p.add_argument("--warmUp", type=float, default=200.0, help="warm-up in ms (default 200)")
    p.add_argument("--profileIterations", type=int, default=5, help="layer-by-layer runs for the breakdown")
    p.add_argument("--no-bench", action="store_true", help="skip timing (the latency question stays unanswered)")
    p.add_argument("--calibCache", metavar="FILE",
                   help="the INT8/FP8 engine's calibration cache, for --calibValidation")
    p.add_argument("--calibValidation", metavar="DATA", help="validation inputs: flag tensors whose values fall "
                   "outside the calibrated ranges (clipping) and a calibration set too small or too uniform")
    p.add_argument("--json", metavar="FILE", help="also write the report's data as JSON")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    add_verify_key_flag(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from .verify import parse_budgets

    con = console()
    err = console(stderr=True)
    engine = load_engine(args.engine, args.device, verify_key=verify_key_of(args))
    shapes = parse_shapes_arg(args.shapes, engine)
    samples = load_samples(args.loadInputs, [v.name for v in engine.inputs]) if args.loadInputs else None
    metrics = [x.strip() for v in (args.metric or []) for x in v.split(",") if x.strip()] or None
    budgets = parse_budgets(args.budget)
    if (metrics or budgets) and not args.data:
        raise ConfigError("--metric/--budget need --data (held-out inputs with 'labels').")
    if args.iterations < 1:
        raise ConfigError("--iterations must be at least 1.")
    command = "kiln " + " ".join(sys.argv[1:]) if sys.argv and Path(sys.argv[0]).name in ("kiln", "__main__.py") \
        else f"kiln report {args.engine}"
    rep = build_report(engine, engine_label=args.engine, latency_target=args.latency_target,
                       latency_stat=args.latency_stat, traffic=args.traffic, reference=args.reference, data=args.data,
                       metrics=metrics, budgets=budgets, samples=samples, shapes=shapes, profile=args.profile,
                       samples_label=f"--loadInputs {args.loadInputs}" if args.loadInputs else None,
                       iterations=args.iterations, warmup_ms=args.warmUp, profile_iterations=args.profileIterations,
                       run_bench=not args.no_bench, command=command, calib_cache=args.calibCache,
                       calib_validation=args.calibValidation,
                       on_step=lambda m: err.print(f"kiln report: {m}"))
    prefix = args.out or str(Path(args.engine).with_suffix("")) + ".report"
    html_path, md_path = write_report(rep, prefix)
    mark = {"pass": "PASS ", "fail": "FAIL ", "warn": "CHECK", "unknown": "-    ", "n/a": "N/A  "}
    for x in rep.litmus:
        con.print(f"{mark[x.status]} {x.question} {x.answer}")
    for what in (rep.compare_error, rep.verify_error, rep.bench_error):
        if what:
            err.print(f"warning: {what}")
    if args.json:
        atomic_write_json(args.json, rep.to_json())
    con.print(f"Report written to {html_path} and {md_path}")
    return 0 if rep.passed else 1
