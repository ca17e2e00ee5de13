"""The builder: ONNX model in, Engine out.

    load + check -> kiln Graph -> profiles -> (INT8/FP8: calibration of an FP32 engine)
    -> optimization passes (passes/__init__.py) -> placement (host shape arithmetic vs
    device work) -> layer precision -> layout -> tactic timing on the GPU
    -> validation run of every profile on the target (measures the arena)
"""

from __future__ import annotations

import os
import time
import warnings
from contextlib import nullcontext

import onnx

from .. import passes
from ..errors import ConfigError, UnsupportedError
from ..frontend.check import preflight
from ..ir.from_onnx import model_to_graph
from ..ir.graph import Graph
from ..ir.shapes import fmt_shape
from ..ops.registry import unsupported_reason
from ..passes.insert_qdq import KEPT_IN_FLOAT
from . import footprint, layout, placement, precision, quantized_io
from .config import BuildConfig, Profile
from .engine import Engine
from .target import resolve, versions


class ProfileWarning(UserWarning):
    pass


def check_supported(graph: Graph) -> None:
    blocked = [(n, r) for n in graph.walk() if (r := unsupported_reason(n))]
    if blocked:
        listed = "; ".join(f"node '{n.label}': {r}" for n, r in blocked[:10])
        more = f" (and {len(blocked) - 10} more)" if len(blocked) > 10 else ""
        raise UnsupportedError(
            f"the model cannot be built: {len(blocked)} node(s) use operators or attributes Kiln does not "
            f"support: {listed}{more}. Run `kiln check` for the full operator report."
        )


def resolve_profiles(graph: Graph, config: BuildConfig) -> list[Profile]:
    """Complete and validate profiles: every input gets min/opt/max, static dims must match."""
    profiles = list(config.profiles) or [Profile({k: (s, s, s) for k, s in config.shapes.items()})]
    names = [v.name for v in graph.inputs]
    out = []
    for idx, prof in enumerate(profiles):
        unknown = [k for k in prof.shapes if k not in names]
        if unknown:
            raise ConfigError(f"profile {idx} names input(s) {unknown}, which the model does not have; "
                              f"its inputs are {names}.")
        shapes = {}
        for v in graph.inputs:
            if v.name in prof.shapes:
                lo, opt, hi = prof.shapes[v.name]
                if not (len(lo) == len(opt) == len(hi)):
                    raise ConfigError(f"profile {idx}, input '{v.name}': min/opt/max shapes have different ranks.")
                if v.shape is not None and len(v.shape) != len(lo):
                    raise ConfigError(
                        f"profile {idx}, input '{v.name}': shape {fmt_shape(lo)} has rank {len(lo)}, "
                        f"but the model's input has rank {len(v.shape)} ({fmt_shape(v.shape)})."
                    )
                for axis in range(len(lo)):
                    if not lo[axis] <= opt[axis] <= hi[axis]:
                        raise ConfigError(
                            f"profile {idx}, input '{v.name}' axis {axis}: need min <= opt <= max, got "
                            f"{lo[axis]}, {opt[axis]}, {hi[axis]}."
                        )
                    d = v.shape[axis] if v.shape is not None else None
                    if isinstance(d, int) and not lo[axis] == hi[axis] == d:
                        raise ConfigError(
                            f"profile {idx}, input '{v.name}' axis {axis} is fixed at {d} in the model, "
                            f"but the profile asks for {lo[axis]}..{hi[axis]}."
                        )
                shapes[v.name] = (tuple(lo), tuple(opt), tuple(hi))
            elif v.shape is None:
                raise ConfigError(f"input '{v.name}' has no shape in the model; give one with --shapes or --optShapes.")
            else:
                dims = tuple(d if isinstance(d, int) else 1 for d in v.shape)
                if v.is_dynamic:
                    dyn = [a for a, d in enumerate(v.shape) if not isinstance(d, int)]
                    warnings.warn(
                        f"input '{v.name}' has dynamic axes {dyn} ({fmt_shape(v.shape)}) but no profile covers them; "
                        f"building for {fmt_shape(dims)} (min=opt=max). Pass --minShapes/--optShapes/--maxShapes "
                        "(or --shapes, for one static shape) to cover the shapes you will run.", ProfileWarning,
                        stacklevel=3)
                shapes[v.name] = (dims, dims, dims)
        out.append(Profile(shapes))
    return out


def _requested(node, config: BuildConfig) -> str:
    """The precision a build asked of a layer: its 8-bit type for one quantization left in float (a stem over
    three channels), else the build's float precision."""
    return config.quantized if config.quantized and node.note.startswith(KEPT_IN_FLOAT) else config.precision


def _check_quantized_target(kind: str, target) -> None:
    if kind == "fp8" and target.kind == "cuda" and tuple(map(int, target.capability.split("."))) < (8, 9):
        raise ConfigError(
            f"--fp8 needs a GPU with FP8 Tensor Cores (compute capability 8.9 or newer: Ada, Hopper); "
            f"{target.name} has compute capability {target.capability}. Build with --int8 or --fp16 instead."
        )


def _calibration(model, config: BuildConfig, profiles: list[Profile]):
    """Calibrated activation ranges: from the calibration cache, else by calibrating an FP32 engine."""
    from pathlib import Path

    from ..quant.calibrate import Calibration, calibrate

    cache = Path(config.calib_cache) if config.calib_cache else None
    if cache is not None and cache.exists():
        return Calibration.load(cache)
    if config.calib is None:
        raise ConfigError(
            f"an {config.quantized.upper()} build needs calibration data: pass --calib=DATA (100 to 1000 "
            "representative samples as a "
            ".npz keyed by input name, a folder of .npz files, or NAME:FILE.npy) or an existing --calibCache=FILE. "
            "Kiln never makes up quantization scales."
        )
    if isinstance(model, Graph):
        raise ConfigError("calibration needs the ONNX model (a path or ModelProto), not a kiln Graph.")
    fp32 = BuildConfig(profiles=profiles, device=config.device, progress=False)
    cal = calibrate(model, config.calib, method=config.calib_method, device=config.device, build_config=fp32,
                    progress=config.progress)
    if cache is not None:
        cal.save(cache)
    return cal


def _inputs_read_as_values(graph: Graph) -> list[str]:
    from ..ops.registry import lookup

    names = {v.name for v in graph.inputs}
    found = set()
    for node in graph.nodes:
        entry = lookup(node.op_type, node.domain)
        for pos in entry.host_inputs:
            if pos < len(node.inputs) and node.inputs[pos] in names:
                found.add(node.inputs[pos])
    return sorted(found)


def _guard_feeds(graph: Graph, config: BuildConfig, profiles: list[Profile]) -> list[dict] | None:
    """Random inputs at each profile's opt shape for precision.guard (FP16/BF16 builds that validate, and the
    float layers of INT8/FP8 ones), or None where it does not run: random values cannot stand in for inputs
    read as shape arguments."""
    if not (config.validate and config.precision_guard and config.precision in ("float16", "bfloat16")) \
            or _inputs_read_as_values(graph):
        return None
    return [precision.sample_inputs(graph.inputs, {k: s[1] for k, s in p.shapes.items()}) for p in profiles]


def _check_excluded_tactics(patterns) -> None:
    """Every --excludeTactics pattern names at least one tactic: a misspelt one would exclude nothing, silently."""
    if not patterns:  # the common case: no reason to import every tactic module (Triton) at the start of a build
        return
    import difflib
    import fnmatch

    from ..tactics import _TACTICS, load_all

    load_all()
    names = sorted({t.name for ts in _TACTICS.values() for t in ts})
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            near = difflib.get_close_matches(p.rstrip("*?"), names, n=4, cutoff=0.5) or names[:4]
            raise ConfigError(f"--excludeTactics: '{p}' matches no tactic (give names, or patterns with * and ?); "
                              f"close names: {', '.join(near)}. `kiln inspect` lists the tactics an engine chose.")


def build(model, config: BuildConfig | None = None) -> Engine:
    """Build an engine. `model`: an onnx.ModelProto, a path to an .onnx file, or a kiln Graph."""
    from ..frontend.onnx_loader import load_onnx, mark_dynamic_dims
    from ..tools.progress import build_progress

    config = config or BuildConfig()
    _check_excluded_tactics(config.exclude_tactics)
    if config.accuracy_budget:
        import dataclasses

        from ..quant.search import search

        engine, report = search(model, dataclasses.replace(config, accuracy_budget={}), config.accuracy_budget,
                                config.budget_data, build)
        engine.findings.append(report)
        return engine
    if config.precision_constraints not in ("none", "obey"):
        raise ConfigError(f"--precisionConstraints must be 'none' or 'obey', not '{config.precision_constraints}'.")
    start = time.perf_counter()
    target = resolve(config.device)
    if (config.quantized and config.precision_constraints == "none" and target.kind == "cuda"
            and config.optimization_level > 0 and not isinstance(model, Graph)):
        from ..quant.speed import keep_faster_float

        engine, report = keep_faster_float(model, config, build)
        engine.findings.append(report)
        if config.validate:
            validate(engine)
        engine.build_seconds = time.perf_counter() - start
        return engine
    phases: dict[str, float] = {}  # seconds per phase of the build (engine.build_config["build_phases"])
    clock = [time.perf_counter(), None]

    def timed_step(msg: str | None) -> None:
        now = time.perf_counter()
        if clock[1] is not None:
            phases[clock[1]] = phases.get(clock[1], 0.0) + now - clock[0]
        clock[0], clock[1] = now, None if msg is None else _phase(msg)
        if bar and msg is not None:
            bar.step(msg)

    with (build_progress() if config.progress else nullcontext()) as bar:
        step = timed_step
        step("loading model")
        if isinstance(model, Graph):
            graph = model
        else:
            proto = mark_dynamic_dims(model) if isinstance(model, onnx.ModelProto) else load_onnx(model)
            preflight(proto, f"'{model}'" if isinstance(model, (str, os.PathLike)) else "the model")
            graph = model_to_graph(proto)
        check_supported(graph)
        profiles = resolve_profiles(graph, config)
        floor = footprint.float_bytes_floor(config.precision, config.quantized)
        footprint.check_inputs(graph, profiles, target, floor)  # before any tensor of the profile is allocated
        precision.pin(graph, config.layer_precisions)
        calibration = None
        if config.quantized:
            _check_quantized_target(config.quantized, target)
            step(f"{config.quantized.upper()} calibration")
            calibration = _calibration(model, config, profiles)
            # A copy: passes/stem_patches.py adds the patches' range, which is not the calibration's
            graph.quant_amax, graph.quant_type = dict(calibration.amax), config.quantized
            graph.quant_absmax = {k: t.absmax for k, t in calibration.tensors.items() if t.absmax is not None}
        passes.optimize(graph, on_pass=lambda name: step(f"pass: {name}"))
        step("placement and precision")
        capturable = placement.assign(graph)
        footprint.check(graph, profiles, target, floor)  # the fused graph's activations, before the guard runs it
        precision.assign(graph, config.precision, _guard_feeds(graph, config, profiles), target.device)
        quantized_io.link(graph, config.precision)
        engine = Engine(
            graph=graph, profiles=profiles, target=target, build_config=config.to_json(),
            capturable=capturable, versions=versions(),
            findings=graph.findings + [{"kind": "precision", "layer": n.name, "requested": _requested(n, config),
                                        "actual": n.precision, "reason": n.note} for n in graph.nodes if n.note],
        )
        if calibration is not None:  # what the report's calibration litmus question reads
            engine.build_config["calibration"] = {
                "method": calibration.method, "samples": calibration.samples, "tensors": len(calibration.amax),
                "cache": config.calib_cache}
        engine.channels_last = layout.channels_last_weights(graph, target.kind, config.precision)
        engine.padded_channels = layout.padded_channel_weights(graph, engine.channels_last)
        engine.column_major = layout.column_major_weights(graph, target.kind)
        # Random values cannot stand in for inputs a layer reads as numbers (a Range delta, a Slice end).
        value_inputs = _inputs_read_as_values(graph)
        if value_inputs:
            engine.findings.append({"kind": "build", "reason": f"inputs {value_inputs} are read as shape arguments: "
                                    "the build ran no validation or tactic timing on random data"})
        if target.kind == "cuda" and config.optimization_level > 0 and not value_inputs:
            engine.tactics = _select_tactics(engine, profiles, config, step)
        if config.validate:
            validate(engine, step)
        step(None)
    engine.build_config["build_phases"] = {k: round(v, 3) for k, v in phases.items()}
    engine.build_seconds = time.perf_counter() - start
    return engine


def _phase(step: str) -> str:
    """The phase a progress step belongs to: "tactic timing: layer 12 (QConv)" -> "tactic timing",
    "validating profile 0 on ..." -> "validating", "pass: fuse_conv" -> "passes"."""
    head = step.split(":")[0]
    return {"pass": "passes", "tactic timing": "tactic timing"}.get(head, head.split(" profile")[0])


def validate(engine: Engine, step=lambda msg: None) -> None:
    """The build's last step: run the engine at each profile's opt and max shapes on its target, so errors
    surface now, and record each profile's activation peak. Skipped where random inputs cannot stand in
    (inputs read as shape arguments; the build recorded a finding)."""
    if _inputs_read_as_values(engine.graph):
        return
    for i in range(len(engine.profiles)):
        step(f"validating profile {i} on {engine.target.describe()}")
        engine.arena_bytes.append(_validate(engine, i))
    for node in engine.graph.nodes:  # a chosen tactic that raised at some shape: the layer keeps the reference
        for tactic, why in node.__dict__.pop("tactic_failures", {}).items():
            node.tactic, node.profile_tactics = "reference", []
            engine.findings.append({"kind": "tactic", "layer": node.name, "tactic": tactic,
                                    "reason": f"failed in the validation run: {why}", "runs": "reference"})


def _select_tactics(engine: Engine, profiles: list[Profile], config: BuildConfig, step) -> list[dict]:
    from ..tactics.cache import TimingCache
    from ..tactics.select import Selector

    cache = TimingCache(config.timing_cache)
    count = [0]

    def on_layer(node):
        count[0] += 1
        step(f"tactic timing: layer {count[0]} ({node.op_type})")

    sel = Selector(engine, config.optimization_level, config.workspace_bytes, cache, on_layer,
                   exclude=config.exclude_tactics, time_quantized_cold=config.time_quantized_cold)
    for i in range(len(profiles)):
        ctx = engine.create_execution_context(profile=i, cuda_graphs=False)
        feeds = engine.random_inputs(profile=i, pick=1, device=engine.target.device)
        sel.profile = i
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx.run_with_inputs_hook(feeds, sel.visit)
    report = sel.assign()
    engine.findings.extend(sel.findings())
    cache.save()
    engine.build_config["timing_cache"] = {"path": config.timing_cache, "hits": cache.hits, "misses": cache.misses}
    return report


def _validate(engine: Engine, index: int) -> int | None:
    """Run the engine once at the profile's opt and max shapes; returns the activation peak at max."""
    ctx = engine.create_execution_context(profile=index, cuda_graphs=False)
    for pick in (1, 2):  # opt, then max
        feeds = engine.random_inputs(profile=index, pick=pick, device=engine.target.device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx.run(feeds, copy_outputs=False)
    return ctx.stats.peak_activation_bytes
