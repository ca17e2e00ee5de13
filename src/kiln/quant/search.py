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

import dataclasses
import tempfile
from pathlib import Path

import onnx

from ..errors import ConfigError

_GEMMS = ("Conv", "MatMul", "Gemm")


def _metric_drop(engine, model, data, budgets) -> tuple[bool, dict[str, float]]:
    from ..tools.verify import verify

    res = verify(engine, data, reference=model, metrics=list(budgets), budgets=budgets)
    return all(m.passed for m in res.metrics if m.budget is not None), {m.name: m.drop for m in res.metrics}


def _quantized_anchors(engine, onnx_names: dict[str, str]) -> list[str]:
    """ONNX Conv/MatMul/Gemm names of the engine's quantized layers."""
    anchors = []
    for n in engine.graph.nodes:
        if n.precision in ("int8", "fp8"):
            anchors += [s for s in n.sources if onnx_names.get(s) in _GEMMS]
    return anchors


def _validated(engine, config):
    """The chosen engine, validated as a normal build is (the candidates were built without it)."""
    from ..engine.builder import validate

    if config.validate:
        validate(engine)
    return engine


def search(model, config, budgets: dict[str, float], data, build):
    """Returns (engine, report). `build` is kiln.build; `config` an INT8/FP8 BuildConfig."""
    if not config.quantized:
        raise ConfigError("--accuracy-budget searches quantized builds: add --int8 or --fp8.")
    if data is None:
        raise ConfigError("--accuracy-budget needs held-out data with labels: pass --budgetData=FILE.npz "
                          "(inputs by binding name and 'labels').")
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    onnx_names = {n.name: n.op_type for n in proto.graph.node}
    float_prec = config.precision if config.precision != "tf32" else "float32"
    cache = config.calib_cache or str(Path(tempfile.mkdtemp(prefix="kiln-calib-")) / "calibration.json")
    # Every candidate quantizes all it may: the search, not the timings, decides what stays in float.
    base = dataclasses.replace(config, calib_cache=cache, validate=False, precision_constraints="obey")

    full = build(proto, base)
    ok, drops = _metric_drop(full, proto, data, budgets)
    anchors = _quantized_anchors(full, onnx_names)
    report = {"kind": "precision-search", "budget": budgets, "quantized_layers": len(anchors),
              "full_quantization_drop": drops, "kept_in_float": [], "engines_built": 1}
    if ok:
        return _validated(full, config), report
    sensitivity = {}
    for layer in anchors:  # only `layer` quantized
        others = {a: float_prec for a in anchors if a != layer}
        eng = build(proto, dataclasses.replace(base, layer_precisions={**config.layer_precisions, **others}))
        sensitivity[layer] = _metric_drop(eng, proto, data, budgets)[1]
        report["engines_built"] += 1
    first = next(iter(budgets))
    order = sorted(anchors, key=lambda a: -sensitivity[a][first])
    for k in range(1, len(order) + 1):
        kept = {a: float_prec for a in order[:k]}
        eng = build(proto, dataclasses.replace(base, layer_precisions={**config.layer_precisions, **kept}))
        report["engines_built"] += 1
        ok, drops = _metric_drop(eng, proto, data, budgets)
        if ok:
            report["kept_in_float"] = [{"layer": a, "drop_when_only_it_is_quantized": sensitivity[a]}
                                       for a in order[:k]]
            report["final_drop"] = drops
            return _validated(eng, config), report
    raise ConfigError(f"no quantized mix meets the budget {budgets}: even with every quantized layer in float "
                      f"the drop is {drops}. Check the budget and the held-out data.")
