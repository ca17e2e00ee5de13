"""The build's passes, in the order they run: the loaded graph in, the laid-out graph out.

    pin_layer_precisions   --layerPrecisions: the named ONNX nodes keep a float precision
    calibration            INT8/FP8: the calibrated activation ranges that insert_qdq and stem_patches read
    fold_constants ... dead_code
                           the graph rewrites, in passes/__init__.py's order (passes.PIPELINE)
    placement              each node on the host (shape arithmetic) or the device; can it be one CUDA graph
    footprint              the memory the fused graph's activations need at each profile's max fits (a check)
    precision              each layer's precision (FP16/BF16: the guard keeps overflowing layers in FP32)
    quantized_io           8-bit values between quantized layers
    channels_last_weights, padded_channel_weights, column_major_weights
                           the weights' layouts on a GPU (builder/layout.py)

Each pass is run(graph, build): `build` holds what the build knows (config, target, profiles) and what the
passes after the rewrites decide (capturable, the weight layouts), which the engine keeps. With
BuildConfig.dump_passes (kiln build --dumpPasses DIR) the graph is written after each pass; BuildConfig.skip_passes
(--skipPasses) leaves fusions out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .. import passes
from ..engine.profile import Profile
from ..engine.target import Target
from ..errors import ConfigError
from ..ir.graph import Graph
from . import footprint, layout, placement, precision, quantized_io
from .config import BuildConfig
from .dump import dump_folder, dump_graph


@dataclass
class Build:
    """One build's state as its passes see it."""

    model: object  # what the builder was given: calibration builds an FP32 engine of it
    config: BuildConfig
    target: Target
    profiles: list[Profile]
    calibrate: Callable | None = None  # calibrate(model, config, profiles) -> Calibration
    step: Callable[[str], None] = lambda message: None  # the progress display
    float_bytes_floor: int | None = None  # the fewest bytes a float may take in this build (footprint)
    calibration: object = None
    capturable: bool = True
    channels_last: list[str] = field(default_factory=list)
    padded_channels: list[str] = field(default_factory=list)
    column_major: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Graph, Build], None]
    rewrite: bool = False  # one of passes.PIPELINE (the progress display names each)


def _rewrite(module) -> Pass:
    return Pass(module.__name__.rsplit(".", 1)[-1], lambda graph, build: module.run(graph), rewrite=True)


def _pin_layer_precisions(graph: Graph, build: Build) -> None:
    precision.pin(graph, build.config.layer_precisions)


def _calibration(graph: Graph, build: Build) -> None:
    quantized = build.config.quantized
    if not quantized:
        return
    _check_quantized_target(quantized, build.target)
    build.step(f"{quantized.upper()} calibration")
    build.calibration = calibration = build.calibrate(build.model, build.config, build.profiles)
    # A copy: passes/stem_patches.py adds the patches' range, which is not the calibration's
    graph.quant_amax, graph.quant_type = dict(calibration.amax), quantized
    graph.quant_absmax = {k: t.absmax for k, t in calibration.tensors.items() if t.absmax is not None}


def _check_quantized_target(kind: str, target: Target) -> None:
    from ..errors import ConfigError

    if kind == "fp8" and target.kind == "cuda" and tuple(map(int, target.capability.split("."))) < (8, 9):
        raise ConfigError(
            f"--fp8 needs a GPU with FP8 Tensor Cores (compute capability 8.9 or newer: Ada, Hopper); "
            f"{target.name} has compute capability {target.capability}. Build with --int8 or --fp16 instead."
        )


def _placement(graph: Graph, build: Build) -> None:
    build.step("placement and precision")
    build.capturable = placement.assign(graph)


def _footprint(graph: Graph, build: Build) -> None:
    footprint.check(graph, build.profiles, build.target, build.float_bytes_floor)  # before the guard runs it


def guard_feeds(graph: Graph, config: BuildConfig, profiles: list[Profile]) -> list[dict] | None:
    """Random inputs at each profile's opt shape for precision.guard (FP16/BF16 builds, and the float layers of
    INT8/FP8 ones), or None where it does not run: precision_guard off, or inputs read as shape arguments (random
    values cannot stand in for them). Not tied to the validation run: the builds that kiln.build compares for an
    8-bit engine (quant/speed.py, quant/search.py) skip that run, and their float layers need the guard."""
    if not (config.precision_guard and config.precision in ("float16", "bfloat16")) \
            or placement.inputs_read_as_values(graph):
        return None
    return [precision.sample_inputs(graph.inputs, {k: s[1] for k, s in p.shapes.items()}) for p in profiles]


def _precision(graph: Graph, build: Build) -> None:
    precision.assign(graph, build.config.precision, guard_feeds(graph, build.config, build.profiles),
                     build.target.device)


def _quantized_io(graph: Graph, build: Build) -> None:
    quantized_io.link(graph, build.config.precision)


def _channels_last_weights(graph: Graph, build: Build) -> None:
    build.channels_last = layout.channels_last_weights(graph, build.target.kind, build.config.precision)


def _padded_channel_weights(graph: Graph, build: Build) -> None:
    build.padded_channels = layout.padded_channel_weights(graph, build.channels_last)


def _column_major_weights(graph: Graph, build: Build) -> None:
    build.column_major = layout.column_major_weights(graph, build.target.kind)


PASSES = [
    Pass("pin_layer_precisions", _pin_layer_precisions),
    Pass("calibration", _calibration),
    *[_rewrite(p) for p in passes.PIPELINE],
    Pass("placement", _placement),
    Pass("footprint", _footprint),
    Pass("precision", _precision),
    Pass("quantized_io", _quantized_io),
    Pass("channels_last_weights", _channels_last_weights),
    Pass("padded_channel_weights", _padded_channel_weights),
    Pass("column_major_weights", _column_major_weights),
]


# Rewrites named like fusions that lower what no layer runs otherwise (Q/DQ pairs, INT4 weights): never skipped.
LOWERINGS = ("fuse_qdq", "fuse_int4_weights")


def skippable() -> list[str]:
    """The passes BuildConfig.skip_passes may name: the fusions, which only make the graph faster to run."""
    return [p.name for p in PASSES
            if p.rewrite and p.name.startswith(("fuse_", "merge_")) and p.name not in LOWERINGS]


def check_skip_passes(names) -> None:
    known = skippable()
    wrong = [n for n in names if n not in known]
    if wrong:
        raise ConfigError(f"--skipPasses: {', '.join(map(repr, wrong))} is not a pass the build can leave out; "
                          f"these can: {', '.join(known)}.")


def run(graph: Graph, build: Build) -> None:
    """Every pass in order, but those config.skip_passes names; with dump_passes, the graph before them
    (00-loaded) and after each (NN-name)."""
    skip = set(build.config.skip_passes)
    check_skip_passes(skip)
    folder = dump_folder(build.config.dump_passes) if build.config.dump_passes else None
    if folder is not None:
        dump_graph(graph, folder, "00-loaded")
    for i, p in enumerate(PASSES, 1):
        if p.name in skip:
            continue
        p.run(graph, build)
        if p.rewrite:
            build.step(f"pass: {p.name}")
        if folder is not None:
            dump_graph(graph, folder, f"{i:02d}-{p.name}")
