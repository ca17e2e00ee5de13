"""`kiln verify ENGINE --data held_out.npz --reference model.onnx`: the task-metric gate.

Runs a held-out data set through the reference (the ONNX model on onnxruntime,
or a PyTorch module) and through the engine, computes the task metric on both
and fails when the engine loses more than the budget:

    kiln verify model.kiln --data digits_test.npz --reference model.onnx --metric top1 --budget top1=0.5

The .npz holds one array per engine input (by binding name, samples along
axis 0) and the labels under `labels`. Metrics: top1 and top5 accuracy (in
percent; the budget is in points), mae (mean absolute error; the budget is in
the output's units), or a Python callable MODULE:FUNCTION taking
(outputs, labels) -> float, where outputs is the chosen output's array (set
`fn.higher_is_better = False` on a loss-like metric). The data runs in chunks
that fit the chosen optimization profile.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..console import console
from ..errors import ConfigError, InputError, KilnError, ShapeError
from ..ir import dtypes
from ..ir.shapes import fmt_shape
from ..json_file import atomic_write_json
from ..samples import read_npz
from .engine_args import add_verify_key_flag, load_engine, verify_key_of
from .references import check_bindings, make_reference
from .user_code import load_callable


@dataclass(frozen=True)
class Metric:
    name: str
    fn: Callable  # (outputs: np.ndarray, labels: np.ndarray) -> float
    higher_is_better: bool = True
    unit: str = ""  # "%" for accuracies (budget in points)


def _class_scores(outputs: np.ndarray, labels: np.ndarray, k: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    if outputs.ndim != 2:
        raise InputError(f"{name} expects class scores of shape [samples, classes], but the output has shape "
                         f"{fmt_shape(outputs.shape)}; choose another output with --output.")
    n, c = outputs.shape
    if c < k:
        raise InputError(f"{name} needs at least {k} classes, but the output has {c}.")
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise InputError(f"{name} expects one class index per sample; "
                         f"'labels' has shape {fmt_shape(labels.shape)}.")
    if labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or not np.all(labels == np.round(labels)):
            raise InputError(f"{name} expects integer class indices in 'labels'; they hold non-integer values.")
        labels = labels.astype(np.int64)
    elif labels.dtype.kind not in "iu":
        raise InputError(f"{name} expects integer class indices in 'labels', not {labels.dtype}.")
    if labels.size and (labels.min() < 0 or labels.max() >= c):
        raise InputError(f"'labels' holds class {int(labels.max()) if labels.max() >= c else int(labels.min())}, "
                         f"outside 0..{c - 1}: the output has {c} classes.")
    return outputs, labels


def top_k(k: int) -> Callable:
    name = f"top{k}"

    def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
        scores, labels = _class_scores(np.asarray(outputs, dtype=np.float64), labels, k, name)
        if k == 1:
            hit = scores.argmax(axis=1) == labels
        else:
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
            hit = (top == labels[:, None]).any(axis=1)
        return 100.0 * float(hit.mean()) if hit.size else math.nan

    metric.__name__ = name
    return metric


def mae(outputs: np.ndarray, labels: np.ndarray) -> float:
    out, lab = np.asarray(outputs, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if out.shape != lab.shape:
        if out.size == lab.size and out.shape[:1] == lab.shape[:1]:
            lab = lab.reshape(out.shape)
        else:
            raise InputError(f"mae compares the output with 'labels' element by element, but the output has shape "
                             f"{fmt_shape(out.shape)} and 'labels' {fmt_shape(lab.shape)}.")
    return float(np.mean(np.abs(out - lab)))


BUILTIN = {
    "top1": Metric("top1", top_k(1), True, "%"),
    "top5": Metric("top5", top_k(5), True, "%"),
    "mae": Metric("mae", mae, False, ""),
}


def resolve_metric(spec: str | Callable) -> Metric:
    if callable(spec):
        name = getattr(spec, "__name__", "metric")
        return Metric(name, spec, bool(getattr(spec, "higher_is_better", True)))
    spec = spec.strip()
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" in spec:
        fn = load_callable(spec, f"metric '{spec}'")
        return Metric(spec, fn, bool(getattr(fn, "higher_is_better", True)))
    raise ConfigError(f"unknown metric '{spec}': the built-in metrics are {sorted(BUILTIN)}; a custom metric is "
                      "given as MODULE:FUNCTION (a callable (outputs, labels) -> float).")


def parse_budgets(items: list[str] | None, flag: str = "--budget") -> dict[str, float]:
    """['top1=0.5', 'mae=0.01,top5=1'] -> {'top1': 0.5, 'mae': 0.01, 'top5': 1.0}; errors name `flag`."""
    out = {}
    for item in [x for v in (items or []) for x in v.split(",") if x.strip()]:
        name, sep, num = item.rpartition("=")
        try:
            val = float(num)
        except ValueError:
            val = None
        if not sep or not name or val is None or val < 0 or not math.isfinite(val):
            raise ConfigError(f"{flag}: '{item}' should be METRIC=POINTS with a number >= 0, e.g. top1=0.5.")
        out[name.strip()] = val
    return out


# --- data -----------------------------------------------------------------------------------------------


def load_data(data, input_names: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray, str]:
    """(inputs, labels, source) from a .npz path or a dict; checks names and sample counts."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.is_file():
            raise InputError(f"--data: file '{path}' does not exist.")
        arrays = read_npz(path, "--data")
        source = str(path)
    else:
        arrays, source = dict(data), "data (in memory)"
    if "labels" not in arrays:
        raise InputError(f"{source} has no 'labels' array; it holds {sorted(arrays)}. Store the labels under 'labels' "
                         "and each engine input under its binding name.")
    labels = np.asarray(arrays.pop("labels"))
    unknown = [k for k in arrays if k not in input_names]
    missing = [k for k in input_names if k not in arrays]
    if unknown or missing:
        parts = ([f"{unknown} are not inputs of the engine"] if unknown else []) + \
                ([f"inputs {missing} are missing"] if missing else [])
        raise InputError(f"{source}: {' and '.join(parts)}; the engine's inputs are {input_names}.")
    counts = {k: (np.shape(v)[0] if np.ndim(v) else None) for k, v in arrays.items()}
    if any(c is None for c in counts.values()):
        raise InputError(f"{source}: every input needs a sample axis first; "
                         f"{[k for k, c in counts.items() if c is None]} are scalars.")
    if len(set(counts.values())) > 1:
        raise InputError(f"{source}: the inputs hold different numbers of samples (axis 0): {counts}.")
    n = next(iter(counts.values())) if counts else 0
    if labels.ndim == 0 or labels.shape[0] != n:
        got = labels.shape[0] if labels.ndim else "a scalar"
        first = next(iter(counts), "?")
        raise InputError(f"{source}: 'labels' has {got} entries but the inputs hold {n} samples (input '{first}' "
                         "axis 0); they must match one to one.")
    if n == 0:
        raise InputError(f"{source} holds no samples.")
    return arrays, labels, source


def plan_chunks(engine, arrays: dict[str, np.ndarray], profile: int | None, batch: int | None) -> tuple[int, int, int]:
    """(profile, chunk size, minimum batch) so every chunk of samples fits the profile."""
    candidates = [profile] if profile is not None else list(range(engine.num_optimization_profiles))
    reasons = []
    best = None
    for p in candidates:
        if not 0 <= p < engine.num_optimization_profiles:
            raise ConfigError(f"--profile {p} does not exist; the engine has {engine.num_optimization_profiles}.")
        lo_b, hi_b, why = 1, None, None
        for name, x in arrays.items():
            lo, _, hi = engine.get_profile_shape(p, name)
            shape = np.shape(x)
            if len(shape) != len(lo):
                why = (f"input '{name}' has rank {len(shape)} in the data ({fmt_shape(shape)}) but rank "
                       f"{len(lo)} in the engine")
                break
            for axis in range(1, len(lo)):
                if not lo[axis] <= shape[axis] <= hi[axis]:
                    why = (f"input '{name}' axis {axis} is {shape[axis]} in the data, outside profile {p}'s range "
                           f"[{lo[axis]}, {hi[axis]}] (samples are {fmt_shape(shape[1:])}; the profile takes "
                           f"{fmt_shape(lo[1:])} .. {fmt_shape(hi[1:])})")
                    break
            if why:
                break
            lo_b, hi_b = max(lo_b, lo[0]), hi[0] if hi_b is None else min(hi_b, hi[0])
        if why is None and hi_b is not None and lo_b > hi_b:
            why = f"the inputs' batch ranges in profile {p} do not overlap"
        if why is None and batch is not None and not lo_b <= batch <= hi_b:
            why = f"--batch {batch} is outside profile {p}'s batch range [{lo_b}, {hi_b}]"
        if why:
            reasons.append(why)
            continue
        chunk = batch or hi_b
        if best is None or chunk > best[1]:
            best = (p, chunk, lo_b)
    if best is None:
        raise ShapeError("the data does not fit the engine's optimization profiles: " + "; ".join(reasons)
                         + ". Rebuild the engine with a profile that covers these shapes.")
    return best


def run_in_chunks(fn: Callable[[dict], dict], arrays: dict[str, np.ndarray], chunk: int, min_batch: int,
                  names: list[str]) -> dict[str, np.ndarray]:
    n = next(iter(arrays.values())).shape[0]
    outs: dict[str, list] = {k: [] for k in names}
    for start in range(0, n, chunk):
        part = {k: v[start:start + chunk] for k, v in arrays.items()}
        real = next(iter(part.values())).shape[0]
        if real < min_batch:  # pad the last chunk up to the profile's minimum batch, then drop the padding
            part = {k: np.concatenate([v, np.repeat(v[-1:], min_batch - real, axis=0)]) for k, v in part.items()}
        res = fn(part)
        for k in names:
            outs[k].append(np.asarray(res[k])[:real])
    return {k: np.concatenate(v) for k, v in outs.items()}


# --- the gate -------------------------------------------------------------------------------------------


@dataclass
class MetricResult:
    name: str
    higher_is_better: bool
    unit: str
    engine: float
    reference: float | None = None
    drop: float | None = None  # how much worse the engine is (points for accuracies)
    budget: float | None = None
    passed: bool | None = None


@dataclass
class VerifyResult:
    source: str
    samples: int
    output: str
    profile: int
    chunk: int
    reference: str | None
    engine_target: str
    metrics: list[MetricResult] = field(default_factory=list)
    agreement: float | None = None  # % of samples where engine and reference pick the same class

    @property
    def passed(self) -> bool:
        return all(m.passed is not False for m in self.metrics)

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def _call_metric(m: Metric, outputs: np.ndarray, labels: np.ndarray) -> float:
    try:
        value = m.fn(outputs, labels)
    except KilnError:
        raise
    except Exception as e:
        raise ConfigError(f"metric '{m.name}' raised {type(e).__name__}: {e}") from None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"metric '{m.name}' returned {type(value).__name__}, not a number.") from None


def verify(engine, data, reference=None, metrics=("top1",), budgets: dict | None = None, output: str | None = None,
           profile: int | None = None, batch: int | None = None, device: str = "auto",
           verify_key: bytes | None = None) -> VerifyResult:
    """Task metrics of the engine (and the reference) on held-out data, checked against budgets.

    engine: Engine or .kiln path. data: .npz path or {input: array, "labels": array}.
    reference: .onnx path, onnx.ModelProto, torch.nn.Module, 'module:factory' or None.
    metrics: names ('top1', 'top5', 'mae'), 'module:function' specs or callables.
    budgets: {metric: allowed drop}; a budget needs a reference.
    verify_key: refuse an engine file not signed with this key.
    """
    engine = load_engine(engine, device, verify_key=verify_key)
    budgets = dict(budgets or {})
    specs = list(metrics or [])
    for name in budgets:
        if name not in [s if isinstance(s, str) else getattr(s, "__name__", "") for s in specs]:
            specs.append(name)
    if not specs:
        raise ConfigError("give at least one metric (--metric top1, top5, mae or MODULE:FUNCTION).")
    resolved = [resolve_metric(s) for s in specs]
    if budgets and reference is None:
        raise ConfigError("--budget compares the engine with the reference: give --reference model.onnx (the model "
                          "the engine was built from).")
    names_out = [v.name for v in engine.outputs]
    output = output or names_out[0]
    if output not in names_out:
        raise ConfigError(f"--output: '{output}' is not an output of the engine; its outputs are {names_out}.")
    arrays, labels, source = load_data(data, [v.name for v in engine.inputs])
    for v in engine.inputs:
        want = dtypes.name_of(v.dtype) if v.dtype is not None else None
        got = str(arrays[v.name].dtype)
        if want and got != want:
            raise InputError(f"{source}: input '{v.name}' is {got} but the engine expects {want}.")
    p, chunk, min_batch = plan_chunks(engine, arrays, profile, batch)
    ctx = engine.create_execution_context(profile=p)
    eng_out = run_in_chunks(lambda feeds: ctx.run(feeds), arrays, chunk, min_batch, [output])[output]
    ref_desc, ref_out = None, None
    if reference is not None:
        ref = make_reference(reference, engine)
        check_bindings(ref, engine)
        ref_desc = ref.describe()
        ref_out = run_in_chunks(lambda feeds: ref.run(feeds, [output]), arrays, chunk, min_batch, [output])[output]
    result = VerifyResult(source=source, samples=int(labels.shape[0]), output=output, profile=p, chunk=chunk,
                          reference=ref_desc, engine_target=engine.target.describe())
    for m in resolved:
        mr = MetricResult(m.name, m.higher_is_better, m.unit, engine=_call_metric(m, eng_out, labels))
        if ref_out is not None:
            mr.reference = _call_metric(m, ref_out, labels)
            mr.drop = (mr.reference - mr.engine) if m.higher_is_better else (mr.engine - mr.reference)
            if m.name in budgets:
                mr.budget = budgets[m.name]
                mr.passed = bool(math.isfinite(mr.drop) and mr.drop <= mr.budget + 1e-12)
        result.metrics.append(mr)
    if ref_out is not None and eng_out.ndim == 2 and eng_out.shape[1] > 1:
        result.agreement = 100.0 * float((eng_out.argmax(1) == ref_out.argmax(1)).mean())
    return result


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}%" if unit == "%" else f"{v:.6g}"


def render(res: VerifyResult, con) -> None:
    con.print(f"Metric gate on {res.source}: {res.samples} samples, output '{res.output}', profile {res.profile} "
              f"in chunks of {res.chunk}")
    con.print(f"  engine:    {res.engine_target}")
    con.print(f"  reference: {res.reference or 'none (give --reference to gate against it)'}")
    con.print(f"  {'metric':<24} {'reference':>12} {'engine':>12} {'drop':>10} {'budget':>10}  result")
    for m in res.metrics:
        drop = "-" if m.drop is None else (f"{m.drop:+.2f}" if m.unit == "%" else f"{m.drop:+.4g}")
        budget = "-" if m.budget is None else (f"{m.budget:g}")
        result = {True: "PASSED", False: "FAILED", None: "(no budget)"}[m.passed]
        con.print(f"  {m.name:<24} {_fmt(m.reference, m.unit):>12} {_fmt(m.engine, m.unit):>12} {drop:>10} "
                  f"{budget:>10}  {result}")
    if res.agreement is not None:
        con.print(f"  top-1 agreement between engine and reference: {res.agreement:.2f}% of samples")
    bad = [m for m in res.metrics if m.passed is False]
    if bad:
        for m in bad:
            unit = " points" if m.unit == "%" else ""
            better = "below" if m.higher_is_better else "above"
            con.print(f"FAILED | {m.name}: the engine is {m.drop:.4g}{unit} {better} the reference, over the budget "
                      f"of {m.budget:g}{unit}")
    elif any(m.passed for m in res.metrics):
        con.print("PASSED | every metric is within its budget")


# --- command line ----------------------------------------------------------------------------------------


def add_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("verify", help="task-metric gate: held-out accuracy of the engine vs the reference",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", metavar="ENGINE", help="the engine file (.kiln)")
    p.add_argument("--data", required=True, metavar="FILE.npz", help="held-out inputs by binding name + 'labels'")
    p.add_argument("--reference", metavar="MODEL", help="the ONNX model (onnxruntime) or MODULE:FACTORY (PyTorch)")
    p.add_argument("--metric", action="append", metavar="NAME",
                   help="top1, top5, mae or MODULE:FUNCTION; repeat or comma-separate (default top1)")
    p.add_argument("--budget", action="append", metavar="METRIC=DROP",
                   help="fail when the engine is more than DROP below the reference, e.g. top1=0.5 (points)")
    p.add_argument("--output", metavar="NAME", help="the engine output the metric reads (default: the first)")
    p.add_argument("--profile", type=int, help="optimization profile (default: the one that fits the data)")
    p.add_argument("--batch", type=int, help="samples per run (default: the profile's max batch)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    add_verify_key_flag(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    con = console()
    metrics = [x.strip() for v in (args.metric or []) for x in _split_metrics(v) if x.strip()]
    budgets = parse_budgets(args.budget)
    if not metrics and not budgets:
        metrics = ["top1"]
    res = verify(args.engine, args.data, reference=args.reference, metrics=metrics, budgets=budgets,
                 output=args.output, profile=args.profile, batch=args.batch, device=args.device,
                 verify_key=verify_key_of(args))
    render(res, con)
    if args.json:
        atomic_write_json(args.json, res.to_json())
        con.print(f"Results written to {args.json}")
    return 0 if res.passed else 1


def _split_metrics(text: str) -> list[str]:
    return text.split(",")
