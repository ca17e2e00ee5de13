"""kiln.build: the builder, and the builds around it that a quantized build may take.

    INT8/FP8: calibration (the calibration cache, else an FP32 engine run on the calibration data)
    then one of:
      --accuracyBudget: the precision search (quant/search.py), which builds candidates and keeps the most
          sensitive layers in float until the budget holds
      an 8-bit build on a GPU, --precisionConstraints=none (the default): the 8-bit and the float engine,
          float layers kept where they run faster (quant/speed.py)
      otherwise: one build (builder/builder.py)

The searches call this function for each engine they compare (with the choice made: no budget,
precisionConstraints=obey), and the builder calls back only into the calibration passed to it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

from .builder import builder
from .builder.config import BuildConfig
from .engine.engine import Engine
from .engine.profile import Profile
from .engine.target import resolve
from .errors import ConfigError
from .ir.graph import Graph
from .quant import search, speed
from .quant.calibrate import Calibration, calibrate


def build(model, config: BuildConfig | None = None) -> Engine:
    """Build an engine. `model`: an onnx.ModelProto, a path to an .onnx file, or a kiln Graph."""
    config = config or BuildConfig()
    builder.check_excluded_tactics(config.exclude_tactics)
    if config.accuracy_budget:
        engine, report = search.search(model, dataclasses.replace(config, accuracy_budget={}), config.accuracy_budget,
                                       config.budget_data, build, accuracy)
        engine.findings.append(report)
        return engine
    builder.check_precision_constraints(config)
    start = time.perf_counter()
    if (config.quantized and config.precision_constraints == "none" and resolve(config.device).kind == "cuda"
            and config.optimization_level > 0 and not isinstance(model, Graph)):
        engine, report = speed.keep_faster_float(model, config, build, latency_us)
        engine.findings.append(report)
        if config.validate:
            builder.validate(engine)
        engine.build_seconds = time.perf_counter() - start
        return engine
    return builder.build_engine(model, config, calibration)


def calibration(model, config: BuildConfig, profiles: list[Profile]) -> Calibration:
    """Calibrated activation ranges: from the calibration cache, else by calibrating an FP32 engine."""
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


def accuracy(engine, model, data, budgets) -> tuple[bool, dict, dict]:
    """The precision search's measure (kiln verify's): (inside the budget, {metric: drop},
    {metric: {"engine", "reference", "drop"}})."""
    from .tools.verify import verify

    res = verify(engine, data, reference=model, metrics=list(budgets), budgets=budgets)
    values = {m.name: {"engine": m.engine, "reference": m.reference, "drop": m.drop} for m in res.metrics}
    return (all(m.passed for m in res.metrics if m.budget is not None), {m.name: m.drop for m in res.metrics},
            values)


def latency_us(engine) -> float:
    """keep-faster-float's measure: the engine's median latency at its first profile's opt shape (CUDA-graph
    replay on a GPU), in us, as kiln bench times it."""
    from .tools.bench import bench

    return statistics.median(bench(engine, iterations=50, warmup_ms=200.0).timings.latency_ms) * 1e3
