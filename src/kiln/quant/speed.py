"""Layers that gain nothing from INT8/FP8 stay in float: the builder's timings decide, as TensorRT's do.

Quantizing a layer is a permission, not an order (TensorRT's --precisionConstraints=none, Kiln's default): a
quantized GEMM whose 8-bit tactics are slower than the float ones (BERT-base's FFN1 in INT8: see
docs/design/small-kernels.md) should run in float. So, on a GPU build:

1. Build the quantized engine, every quantizable layer quantized (precision constraints "obey"), and the same
   model in the build's float precision, both timing their tactics into one timing cache.
2. Group the two engines' layers by the ONNX nodes they cover: the FP8 engine's GEMM and its separate
   add + LayerNorm against the float engine's fused GEMM + LayerNorm are one group. A group whose float layers
   timed faster (by more than MARGIN) is a candidate; like candidates (same ops and weight shapes: BERT's twelve
   FFN1 GEMMs) form a class.
3. Time the quantized engine end to end. A class whose timed saving is under GAIN of that time is not tried: a
   float layer between 8-bit ones usually costs its neighbours time (they quantize for it), so such a class would
   not pass the bar below.
4. Try the other classes one at a time, the largest timed saving first (at most CLASSES): rebuild with the class's
   GEMMs and convolutions pinned to float, on top of the classes kept so far (the timing cache makes the
   rebuild cheap), and keep it only if the engine runs faster end to end (CUDA-graph latency at the opt shape,
   the two engines timed in turn, against the fastest timing the engine to beat ever had). A float layer
   between quantized ones makes its neighbours quantize their inputs themselves, which the per-group times do
   not see: on BERT-base INT8 the times favoured FFN1 in FP16, and the engine then ran 1.527 ms against 1.492,
   as FFN2 read FP16 rows and quantized them itself.

The engine's findings record each group kept in (or tried in) float with both times and every trial's latency;
the inspector shows the layers kept in float and why.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import onnx

MARGIN = 0.03  # a group moves to float only when float is this much faster: timings of one build vary ~1-2%
GAIN = 0.01  # and the mixed engine is kept only when it is this much faster end to end
CLASSES = 3  # classes of like groups tried, one rebuild each (the timing cache makes a rebuild cheap)
ROUNDS = 2  # a trial and the engine it must beat are timed in turn this many times
REASON = "kept in {prec}: faster than {q} ({f_us:.1f} us against {q_us:.1f})"
_GEMMS = ("Conv", "MatMul", "Gemm")


def _layer_times(engine) -> dict[str, float]:
    """Each timed layer's chosen tactic time (ms, summed over profiles)."""
    return {r["layer"]: r["timings"].get(r["chosen"], 0.0) for r in engine.tactics}


def _groups(q, f) -> list[tuple[set[str], list, list]]:
    """Layers of the quantized engine `q` and the float engine `f` grouped by shared ONNX source nodes:
    [(sources, q layers, f layers)]."""
    parent: dict[str, str] = {}

    def find(a):
        while parent.setdefault(a, a) != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    layers = [(e, n) for e in (q, f) for n in e.graph.nodes if n.placement == "device"]
    for _, n in layers:
        srcs = n.sources or [n.name]
        for s in srcs[1:]:
            parent[find(s)] = find(srcs[0])
    groups: dict[str, tuple[set, list, list]] = {}
    for e, n in layers:
        srcs = n.sources or [n.name]
        g = groups.setdefault(find(srcs[0]), (set(), [], []))
        g[0].update(srcs)
        (g[1] if e is q else g[2]).append(n)
    return list(groups.values())


def keep_faster_float(model, config, build, latency):
    """Returns (engine, finding). `build` is kiln.build; `config` an INT8/FP8 BuildConfig on a GPU; `latency`
    times an engine end to end (us; kiln.build passes kiln bench's median)."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    with tempfile.TemporaryDirectory(prefix="kiln-precision-") as scratch:  # caches the builds share, unless given
        base = dataclasses.replace(config, precision_constraints="obey", validate=False,
                                   timing_cache=config.timing_cache or str(Path(scratch) / "timing.json"),
                                   calib_cache=config.calib_cache or str(Path(scratch) / "calibration.json"))
        engine, report = _choose(proto, config, base, build, latency)
    # The engine records the build the user asked for, not the inner builds' settings and scratch files.
    engine.build_config.update(config.to_json())
    if "calibration" in engine.build_config:
        engine.build_config["calibration"]["cache"] = config.calib_cache
    if "timing_cache" in engine.build_config:
        engine.build_config["timing_cache"]["path"] = config.timing_cache
    return engine, report


def _signature(engine, layers) -> tuple:
    """What a group's quantized layers are (op and weight shape): BERT's twelve FFN1 groups share one."""
    inits = engine.graph.initializers
    return tuple(sorted((n.op_type, tuple(inits[n.inputs[1]].shape) if n.inputs[1] in inits else ())
                        for n in layers if n.precision in ("int8", "fp8")))


def _saving(groups: list[dict]) -> float:
    """The time a class of groups saved in float, by the builder's timings (us)."""
    return sum(g["quantized_us"] - g["float_us"] for g in groups)


def _candidates(quantized, floating, onnx_ops) -> list[list[dict]]:
    """The groups whose float layers timed faster, in classes of like groups, the largest saving first."""
    qt, ft = _layer_times(quantized), _layer_times(floating)
    classes: dict[tuple, list[dict]] = {}
    for sources, q_layers, f_layers in _groups(quantized, floating):
        if not any(n.precision in ("int8", "fp8") for n in q_layers) or not f_layers:
            continue
        q_ms, f_ms = sum(qt.get(n.name, 0.0) for n in q_layers), sum(ft.get(n.name, 0.0) for n in f_layers)
        if f_ms < q_ms * (1 - MARGIN):
            classes.setdefault(_signature(quantized, q_layers), []).append(
                {"layers": sorted(s for s in sources if onnx_ops.get(s) in _GEMMS),
                 "quantized_us": round(q_ms * 1e3, 2), "float_us": round(f_ms * 1e3, 2)})
    return sorted(classes.values(), key=lambda c: -_saving(c))


def _in_turn(latency, best, trial) -> list[tuple[float, float]]:
    """(best's, trial's) latency for each of ROUNDS rounds, each engine timed first in every other round: the one
    timed right after a build (the GPU idle through it, its clocks perhaps down) would otherwise always be the
    same."""
    rounds = []
    for i in range(ROUNDS):
        if i % 2:
            t, b = latency(trial), latency(best)
        else:
            b, t = latency(best), latency(trial)
        rounds.append((b, t))
    return rounds


def _say(config, message: str) -> None:
    """One line before each of the builds (two to 2 + CLASSES), which show their own progress."""
    if config.progress:
        from rich.console import Console
        from rich.markup import escape

        Console(file=sys.stderr, highlight=False).print(f"[bold]kiln build[/] precision by speed: {escape(message)}",
                                                        soft_wrap=True)


def _choose(proto, config, base, build, latency):
    qname, float_prec = config.quantized.upper(), config.precision
    _say(config, f"the {qname} engine, every quantizable layer in {qname}")
    quantized = build(proto, base)
    report = {"kind": "precision-by-speed", "margin": MARGIN, "kept_in_float": [], "tried_in_float": [],
              "engines_built": 1, "builds": [_build_time(qname, quantized)]}
    if not quantized.tactics:  # no timing (a CPU target, optimization level 0): nothing to compare
        return quantized, report
    _say(config, f"the {float_prec} engine, to compare each layer's time")
    floating = build(proto, dataclasses.replace(base, int8=False, fp8=False, calib=None, calib_cache=None))
    report["engines_built"] += 1
    report["builds"].append(_build_time(float_prec, floating))
    classes = _candidates(quantized, floating, {n.name: n.op_type for n in proto.graph.node})
    del floating  # its device weights are not needed for the trials
    best, best_us, pins = quantized, float("inf"), {}
    if classes:
        # A float layer between 8-bit ones usually costs more than its timed saving (its neighbours quantize for it): a
        # class saving less than GAIN of the engine's time would not pass the end-to-end bar, and is not worth a build.
        best_us = min(latency(quantized) for _ in range(ROUNDS))
        report["quantized_latency_us"], report["min_saving_us"] = round(best_us, 1), round(GAIN * best_us, 1)
        report["not_tried"] = [g for c in classes if _saving(c) < GAIN * best_us for g in c]
        classes = [c for c in classes if _saving(c) >= GAIN * best_us]
    for k, groups in enumerate(classes[:CLASSES]):  # each class of like groups tried in float on top of those kept
        layers = [a for g in groups for a in g["layers"]]
        _say(config, f"trial {k + 1} of {min(len(classes), CLASSES)}, {len(groups)} group(s) timed "
             f"{_saving(groups):.1f} us faster in {float_prec}: {', '.join(layers[:3])}"
             f"{', ...' if len(layers) > 3 else ''}")
        trial_pins = {**pins, **{a: float_prec for a in layers}}
        trial = build(proto, dataclasses.replace(base, layer_precisions={**trial_pins, **config.layer_precisions}))
        report["engines_built"] += 1
        report["builds"].append(_build_time(f"trial {k + 1}", trial))
        rounds = _in_turn(latency, best, trial)
        # The fastest of every timing of the engine to beat, earlier trials' included: noise only slows a run, and
        # a slow re-timing must not let a slower mix in.
        best_us = min([best_us] + [b for b, _ in rounds])
        trial_us = min(t for _, t in rounds)
        faster = trial_us < best_us * (1 - GAIN)
        report["kept_in_float" if faster else "tried_in_float"] += groups
        report.setdefault("trials", []).append({"groups": len(groups), "latency_us": round(trial_us, 1),
                                                "against_us": round(best_us, 1), "kept": faster})
        if faster:
            best, best_us, pins, report["mixed_latency_us"] = trial, trial_us, trial_pins, round(trial_us, 1)
    if best is quantized:
        if report.get("trials"):
            report["result"] = "fully quantized: no mix was faster end to end"
        elif report.get("not_tried"):
            report["result"] = (f"fully quantized: no class of layers timed {GAIN:.0%} of the engine's "
                                f"{best_us:.0f} us faster in {float_prec}")
        return quantized, report
    _explain(best, report, {a for a in pins if a not in config.layer_precisions}, config.quantized, float_prec)
    report["result"] = f"{len(report['kept_in_float'])} group(s) kept in {float_prec}"
    return best, report


def _build_time(what: str, engine) -> dict:
    """One inner build's seconds and their phases (where an 8-bit build's time goes)."""
    out = {"engine": what, "seconds": round(engine.build_seconds or 0.0, 2),
           "phases": engine.build_config.get("build_phases", {})}
    if engine.build_config.get("tactic_selection"):
        out["tactic_selection"] = engine.build_config["tactic_selection"]
    return out


def _explain(engine, report, pinned: set[str], qtype: str, prec: str) -> None:
    """Say why each speed-pinned layer is in float (a plain pin says "pinned by --layerPrecisions")."""
    why = {}
    for kept in report["kept_in_float"]:
        text = REASON.format(prec=prec, q=qtype.upper(), f_us=kept["float_us"], q_us=kept["quantized_us"])
        why.update({a: text for a in kept["layers"] if a in pinned})
    for n in engine.graph.nodes:
        reason = next((why[s] for s in (n.sources or [n.name]) if s in why), None)
        if reason:
            n.note = reason
    by_name = {n.name: n for n in engine.graph.nodes}
    for f in engine.findings:
        node = by_name.get(f.get("layer"))
        if f.get("kind") == "precision" and node is not None and node.note.startswith("kept in"):
            f["reason"] = node.note
