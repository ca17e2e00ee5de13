"""Automatic precision search: the fastest quantized mix inside an accuracy budget.

1. Build the fully quantized engine; if its task metric is within the budget
   (against the FP32 model, on held-out data), done.
2. Otherwise measure each quantized layer's sensitivity: the metric drop of an
   engine where only that layer is quantized.
3. Keep the most sensitive layers in float, one more at a time, until the
   metric is inside the budget. The report says which layers were kept and
   what each one cost alone.

Every build reuses one calibration (a cache file), so the scales never change
between the engines compared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path

import onnx

from ..errors import ConfigError

_GEMMS = ("Conv", "MatMul", "Gemm")
KEPT_BY_SEARCH = "pinned in float by the --accuracyBudget search"  # "pinned": the runtime's float-input rule holds


def _metric(metric, engine, model, data, budgets) -> tuple[bool, dict, dict]:
    """metric's answer; the metric values default to the drops where a metric gives only those."""
    ok, drops, *values = metric(engine, model, data, budgets)
    return ok, drops, values[0] if values else {k: {"drop": v} for k, v in drops.items()}


def _quantized_anchors(engine, onnx_names: dict[str, str]) -> list[str]:
    """ONNX Conv/MatMul/Gemm names of the engine's quantized layers."""
    anchors = []
    for n in engine.graph.nodes:
        if n.precision in ("int8", "fp8"):
            anchors += [s for s in n.sources if onnx_names.get(s) in _GEMMS]
    return anchors


def _validated(engine, config):
    """The chosen engine, validated as a normal build is (the candidates were built without it)."""
    from ..builder.builder import validate

    if config.validate:
        validate(engine)
    return engine


def _fmt(drops: dict) -> str:
    return ", ".join(f"{k} drop {v:+.3g}" for k, v in drops.items() if v is not None)


class _Display:
    """One progress display for the whole search (its builds run without their own)."""

    def __init__(self, bar):
        self._bar, self.count, self.total = bar, 0, None

    def step(self, what: str) -> None:
        self.count += 1
        of = f"/{self.total}" if self.total else ""
        if self._bar is not None:
            self._bar.step(f"precision search, engine {self.count}{of}: {what}")


def _explain(engine, kept: dict[str, dict], budgets: dict, prec: str) -> None:
    """Notes and findings say the search kept these layers in float and what each cost quantized alone."""
    first = next(iter(budgets))
    for n in engine.graph.nodes:
        layer = next((s for s in (n.sources or [n.name]) if s in kept), None)
        if layer is not None and n.note.startswith("pinned"):
            cost = kept[layer].get(first)
            n.note = (f"{KEPT_BY_SEARCH}: kept in {prec}; quantized alone it costs {first} "
                      f"{cost:+.3g}" if cost is not None else f"{KEPT_BY_SEARCH}: kept in {prec}")
    by_name = {n.name: n for n in engine.graph.nodes}
    for f in engine.findings:
        node = by_name.get(f.get("layer"))
        if f.get("kind") == "precision" and node is not None and node.note.startswith(KEPT_BY_SEARCH):
            f["reason"] = node.note


def summary(report: dict) -> list[str]:
    """The search in the user's terms: each step's engine, what it kept in float and its metric."""
    lines = [f"precision search for {', '.join(f'{k} <= {v:g}' for k, v in report['budget'].items())} "
             f"({report['quantized_layers']} quantizable layers, {report['engines_built']} engines built):"]
    for st in report.get("steps", []):
        vals = "; ".join((f"{k} {v['engine']:.4g} (reference {v['reference']:.4g}, drop {v['drop']:+.3g})"
                          if v.get("engine") is not None and v.get("reference") is not None
                          else f"{k} drop {v['drop']:+.3g}")
                         for k, v in st["metrics"].items() if v.get("drop") is not None)
        mark = {True: "within budget", False: "over budget", None: ""}[st.get("within_budget")]
        lines.append(f"  {st['step']}: {vals}" + (f" - {mark}" if mark else ""))
    kept = report.get("kept_in_float", [])
    lines.append("  result: " + ("every quantizable layer quantized" if not kept else
                                 f"kept in float: {', '.join(k['layer'] for k in kept)}"))
    return lines


def search(model, config, budgets: dict[str, float], data, build, metric):
    """Returns (engine, report). `build` is kiln.build; `config` an INT8/FP8 BuildConfig; `metric(engine, model,
    data, budgets)` -> (inside the budget, {metric: drop}[, {metric: {"engine", "reference", "drop"}}]):
    kiln.build passes kiln verify's."""
    if not config.quantized:
        raise ConfigError("--accuracyBudget searches quantized builds: add --int8 or --fp8.")
    if data is None:
        raise ConfigError("--accuracyBudget needs held-out data with labels: pass --budgetData=FILE.npz "
                          "(inputs by binding name and 'labels').")
    from ..progress import build_progress

    start = time.perf_counter()
    with (build_progress() if config.progress else contextlib.nullcontext()) as bar:
        engine, report = _search(model, config, budgets, data, build, metric, _Display(bar))
    engine.build_seconds = time.perf_counter() - start  # the whole search, every candidate build
    return engine, report


def _search(model, config, budgets, data, build, metric, display: _Display):
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    onnx_names = {n.name: n.op_type for n in proto.graph.node}
    float_prec = config.precision if config.precision != "tf32" else "float32"
    q = config.quantized.upper()
    cache = config.calib_cache or str(Path(tempfile.mkdtemp(prefix="kiln-calib-")) / "calibration.json")
    # Every candidate quantizes all it may: the search, not the timings, decides what stays in float. The
    # candidates show no progress of their own: the search's display is the one.
    base = dataclasses.replace(config, calib_cache=cache, validate=False, precision_constraints="obey",
                               progress=False)

    display.step(f"every layer {q} (calibrating)")
    full = build(proto, base)
    ok, drops, values = _metric(metric, full, proto, data, budgets)
    anchors = _quantized_anchors(full, onnx_names)
    report = {"kind": "precision-search", "budget": budgets, "quantized_layers": len(anchors),
              "full_quantization_drop": drops, "kept_in_float": [], "engines_built": 1,
              "steps": [{"step": f"every quantizable layer {q}", "kept_in_float": [], "metrics": values,
                         "within_budget": ok}]}
    if ok:
        return _validated(full, config), report
    display.total = 1 + 2 * len(anchors)  # at most: each layer alone, then one more kept in float at a time
    sensitivity = {}
    for layer in anchors:  # only `layer` quantized
        display.step(f"sensitivity: only {layer} {q}")
        others = {a: float_prec for a in anchors if a != layer}
        eng = build(proto, dataclasses.replace(base, layer_precisions={**config.layer_precisions, **others}))
        _, sensitivity[layer], values = _metric(metric, eng, proto, data, budgets)
        report["engines_built"] += 1
        report["steps"].append({"step": f"only {layer} {q}", "kept_in_float": [a for a in anchors if a != layer],
                                "metrics": values, "within_budget": None})
    first = next(iter(budgets))
    order = sorted(anchors, key=lambda a: -sensitivity[a][first])
    for k in range(1, len(order) + 1):
        display.step(f"keeping {k} layer(s) in {float_prec}: {', '.join(order[:k])}")
        kept = {a: float_prec for a in order[:k]}
        eng = build(proto, dataclasses.replace(base, layer_precisions={**config.layer_precisions, **kept}))
        report["engines_built"] += 1
        ok, drops, values = _metric(metric, eng, proto, data, budgets)
        rest = f", the rest {q}" if k < len(order) else f": no layer left in {q}"
        report["steps"].append({"step": f"{', '.join(order[:k])} in {float_prec}{rest}",
                                "kept_in_float": order[:k], "metrics": values, "within_budget": ok})
        if ok:
            report["kept_in_float"] = [{"layer": a, "drop_when_only_it_is_quantized": sensitivity[a]}
                                       for a in order[:k]]
            report["final_drop"] = drops
            _explain(eng, {a: sensitivity[a] for a in order[:k]}, budgets, float_prec)
            return _validated(eng, config), report
    raise ConfigError(f"no quantized mix meets the budget {budgets}: even with every quantized layer in float "
                      f"the drop is {_fmt(drops)}. Check the budget and the held-out data.")
