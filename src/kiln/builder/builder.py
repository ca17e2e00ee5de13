"""The builder: ONNX model in, one Engine out.

    load + check -> kiln Graph -> profiles (and the memory they need)
    -> the build's passes, in order (builder/pipeline.py): layer pins, INT8/FP8 calibration, the graph
       rewrites (passes/__init__.py), placement (host shape arithmetic vs device work), layer precision,
       8-bit values between quantized layers, weight layouts
    -> tactic timing on the GPU -> validation run of every profile on the target (measures the arena)

kiln.build (kiln/build.py) calls it once per engine: calibration, the precision search and keep-faster-float
are around it, not in it.
"""

from __future__ import annotations

import os
import time
import warnings
from contextlib import nullcontext

import onnx
import torch

from ..engine.engine import Engine
from ..engine.profile import Profile
from ..engine.target import resolve, versions
from ..errors import ConfigError, UnsupportedError
from ..frontend.check import preflight
from ..ir.from_onnx import model_to_graph
from ..ir.graph import Graph
from ..ir.shapes import fmt_shape
from ..ops.registry import unsupported_reason
from ..passes.insert_qdq import KEPT_IN_FLOAT
from . import footprint, pipeline
from .config import BuildConfig
from .placement import inputs_read_as_values


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


def check_precision_constraints(config: BuildConfig) -> None:
    if config.precision_constraints not in ("none", "obey"):
        raise ConfigError(f"--precisionConstraints must be 'none' or 'obey', not '{config.precision_constraints}'.")


def check_excluded_tactics(patterns) -> None:
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


def build_engine(model, config: BuildConfig | None = None, calibrate=None) -> Engine:
    """Build one engine. `model`: an onnx.ModelProto, a path to an .onnx file, or a kiln Graph. `calibrate`
    (INT8/FP8 builds): calibrate(model, config, profiles) -> the calibration (kiln/build.py's, which reads the
    calibration cache or calibrates an FP32 engine). kiln.build calls this once per engine it compares."""
    from ..frontend.onnx_loader import load_onnx, mark_dynamic_dims
    from ..progress import build_progress

    config = config or BuildConfig()
    check_excluded_tactics(config.exclude_tactics)
    check_precision_constraints(config)
    if config.quantized and calibrate is None:
        raise ConfigError(f"an {config.quantized.upper()} build_engine needs calibrate=: build with kiln.build, which "
                          "reads the calibration cache or calibrates.")
    start = time.perf_counter()
    target = resolve(config.device)
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
        build = pipeline.Build(model, config, target, profiles, calibrate, step, floor)
        pipeline.run(graph, build)
        engine = Engine(
            graph=graph, profiles=profiles, target=target, build_config=config.to_json(),
            capturable=build.capturable, versions=versions(),
            findings=graph.findings + [{"kind": "precision", "layer": n.name, "requested": _requested(n, config),
                                        "actual": n.precision, "reason": n.note} for n in graph.nodes if n.note],
        )
        calibration = build.calibration
        if calibration is not None:  # what the report's calibration litmus question reads
            engine.build_config["calibration"] = {
                "method": calibration.method, "samples": calibration.samples, "tensors": len(calibration.amax),
                "cache": config.calib_cache}
        engine.channels_last, engine.padded_channels = build.channels_last, build.padded_channels
        engine.column_major = build.column_major
        # Random values cannot stand in for inputs a layer reads as numbers (a Range delta, a Slice end).
        value_inputs = inputs_read_as_values(graph)
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
    if inputs_read_as_values(engine.graph):
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
    from .tactic_selection import Selector, compile_threads

    cache = TimingCache(config.timing_cache)
    count = [0]

    def on_layer(node):
        count[0] += 1
        step(f"tactic timing: layer {count[0]} ({node.op_type})")

    sel = Selector(engine, config.optimization_level, config.workspace_bytes, cache, on_layer,
                   exclude=config.exclude_tactics, time_quantized_cold=config.time_quantized_cold)
    runs = [(i, engine.create_execution_context(profile=i, cuda_graphs=False),
             engine.random_inputs(profile=i, pick=1, device=engine.target.device)) for i in range(len(profiles))]
    threads = compile_threads(engine.target.kind)
    compile_s = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if threads >= 2:  # every profile's candidates compiled before any is timed (builder/compile_ahead.py)
            from .compile_ahead import CompileAhead

            step(f"compiling tactics: {threads} threads")
            start = time.perf_counter()
            sel.compiler = CompileAhead(threads, torch.device(engine.target.device))
            try:
                for i, ctx, feeds in runs:
                    sel.profile = i
                    ctx.run_with_inputs_hook(feeds, sel.ahead)
            finally:
                sel.compiler.finish(lambda done, queued: step(f"compiling tactics: {done}/{queued} candidates, "
                                                              f"{threads} threads"))
            compile_s = time.perf_counter() - start
        for i, ctx, feeds in runs:
            sel.profile = i
            ctx.run_with_inputs_hook(feeds, sel.visit)
    report = sel.assign()
    engine.findings.extend(sel.findings())
    cache.save()
    engine.build_config["timing_cache"] = {"path": config.timing_cache, "hits": cache.hits, "misses": cache.misses}
    stats = {k: round(v, 3) if isinstance(v, float) else v for k, v in sel.stats.items()}
    if sel.compiler is not None:
        stats.update(compile_threads=threads, compiled_ahead=sel.compiler.calls, failed_ahead=sel.compiler.failed,
                     compile_ahead_s=round(compile_s, 3))
    engine.build_config["tactic_selection"] = stats
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
