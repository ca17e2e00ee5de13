"""`kiln compare model.onnx --runners kiln-fp16,kiln-int8,onnxruntime,torch`: several backends, one table.

Polygraphy's `polygraphy run model.onnx --trt --onnxrt` habit: the same inputs go through every
runner, and every runner's outputs are compared with the first runner's (or --referenceRunner's),
one row per runner and output.

Runners:
  kiln-fp32, kiln-tf32, kiln-fp16, kiln-bf16   a Kiln engine built from the model at that precision
  kiln-int8, kiln-fp8                          ... quantized: calibrated on --calib DATA when given,
                                               else on the compared inputs themselves (the report says so)
  onnxruntime                                  the model on onnxruntime's CPU provider
  torch                                        the PyTorch module --torch MODULE:FACTORY, called with the
                                               model's inputs in order

Tolerances follow compare's rule per runner (atol = f x RMS(reference), rtol = f, f by the runner's
precision; the looser of the two runners' precisions when neither is FP32); --atol/--rtol override.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import ConfigError, InputError
from ..ir import dtypes
from ..ir.shapes import fmt_shape
from .references import OnnxReference, TorchReference
from .user_code import load_torch_module

KILN_PRECISIONS = {"kiln-fp32": ("float32", {}), "kiln-tf32": ("tf32", {"tf32": True}),
                   "kiln-fp16": ("float16", {"fp16": True}), "kiln-bf16": ("bfloat16", {"bf16": True}),
                   "kiln-int8": ("int8", {"int8": True}), "kiln-fp8": ("fp8", {"fp8": True})}
RUNNERS = (*KILN_PRECISIONS, "onnxruntime", "torch")


def parse_runners(text: str) -> list[str]:
    names = [r.strip() for r in (text or "").split(",") if r.strip()]
    unknown = [r for r in names if r not in RUNNERS]
    if unknown:
        raise ConfigError(f"--runners: {unknown} are not runners Kiln knows; choose from {list(RUNNERS)}.")
    if len(names) < 2:
        raise ConfigError("--runners needs at least two runners to compare, e.g. kiln-fp16,onnxruntime.")
    if len(set(names)) != len(names):
        raise ConfigError(f"--runners names a runner twice: {names}.")
    return names


@dataclass
class RunnerRow:
    runner: str
    output: str
    verdict: str
    max_abs: float | None
    mean_abs: float | None
    max_rel: float | None
    min_atol: float | None
    atol: float
    rtol: float
    reason: str = ""


@dataclass
class MultiRunnerResult:
    model: str
    reference_runner: str
    runners: dict[str, str]  # runner -> what it is ("Kiln engine, float16, CPU ...")
    samples: int
    inputs: str
    rows: list[RunnerRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    synthetic_rules: dict = field(default_factory=dict)
    samples_used: list = field(default_factory=list)  # the input samples, for --save-inputs
    outputs: dict = field(default_factory=dict)  # runner -> [{output: array}], for --save-outputs
    runtimes: dict = field(default_factory=dict)  # runner -> [seconds per sample]

    @property
    def verdict(self) -> str:
        v = {r.verdict for r in self.rows}
        return "FAILED" if "FAILED" in v else "INCONCLUSIVE" if "INCONCLUSIVE" in v else "PASSED"

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {"model": self.model, "reference_runner": self.reference_runner, "runners": self.runners,
                "samples": self.samples, "inputs": self.inputs, "synthetic_rules": self.synthetic_rules,
                "notes": self.notes, "verdict": self.verdict, "rows": [asdict(r) for r in self.rows]}


def _input_shapes(model, given: dict) -> dict[str, tuple]:
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if vi.name in given:
            out[vi.name] = tuple(given[vi.name])
            continue
        dims = vi.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") or d.dim_value <= 0 for d in dims):
            shown = fmt_shape([d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims])
            raise ConfigError(f"input '{vi.name}' of the model has dynamic dimensions ({shown}); give its shape with "
                              f"--shapes {vi.name}:..., or give inputs with --load-inputs.")
        out[vi.name] = tuple(d.dim_value for d in dims)
    return out


def _profile(samples: list[dict]):
    from ..engine.profile import Profile

    shapes = {}
    for name in samples[0]:
        ss = [tuple(np.shape(s[name])) for s in samples]
        lo = tuple(min(d) for d in zip(*ss))
        hi = tuple(max(d) for d in zip(*ss))
        shapes[name] = (lo, ss[0], hi)
    return Profile(shapes)


def _build(build, model, runner: str, profile, device: str, calib):
    from ..builder.config import BuildConfig

    _, flags = KILN_PRECISIONS[runner]
    cfg = BuildConfig(profiles=[profile], device=device, calib=calib if ("int8" in flags or "fp8" in flags) else None,
                      progress=False, **flags)  # the compare's own display shows each runner's build
    return build(model, cfg)


def run_runners(model_path: str, runners: list[str], *, samples: list[dict] | None = None, inputs: str = "",
                shapes: dict | None = None, torch_module: str | None = None, calib: str | None = None,
                reference_runner: str | None = None, device: str = "auto", seed: int = 0, count: int = 1,
                val_range: dict | None = None, atol: float | None = None, rtol: float | None = None,
                accept_vacuous: bool = False, build) -> MultiRunnerResult:
    """Run `samples` (or synthetic ones) through every runner and compare each with the reference runner.
    `build`: kiln.build (the Kiln runners' engines)."""
    if "torch" in runners and not torch_module:
        raise ConfigError("the 'torch' runner needs the PyTorch module: --torch MODULE:FACTORY (called with the "
                          "model's inputs in order).")
    ref_name = reference_runner or ("onnxruntime" if "onnxruntime" in runners else runners[0])
    if ref_name not in runners:
        raise ConfigError(f"--referenceRunner '{ref_name}' is not one of --runners {runners}.")
    model = OnnxReference(model_path).model if "onnxruntime" in runners else _read(model_path)
    onnx_inputs = [vi.name for vi in model.graph.input if vi.name not in {t.name for t in model.graph.initializer}]
    out_names = [vi.name for vi in model.graph.output]
    result = MultiRunnerResult(model=str(model_path), reference_runner=ref_name, runners={}, samples=0,
                               inputs=inputs or "given samples")
    from ..progress import progress

    with progress("kiln compare", total=2 * len(runners), first="preparing inputs") as bar:
        _run_all(model, model_path, runners, result, bar, samples=samples, shapes=shapes, onnx_inputs=onnx_inputs,
                 out_names=out_names, torch_module=torch_module, calib=calib, device=device, seed=seed, count=count,
                 val_range=val_range, build=build)
    _compare_rows(result, runners, ref_name, out_names, atol, rtol, accept_vacuous)
    return result


def _run_all(model, model_path, runners, result, bar, *, samples, shapes, onnx_inputs, out_names, torch_module,
             calib, device, seed, count, val_range, build) -> None:
    """Build every Kiln runner, then run every runner on every sample (result.outputs/runtimes)."""
    engines = {}
    # Float Kiln engines first: synthetic inputs are drawn from an engine's graph (token ids over the
    # embedding's rows, masks as masks), and the quantized builds may calibrate on the inputs.
    if samples is None:
        from ..engine.synthetic import describe
        from .compare import synthetic_samples

        fixed = _input_shapes(model, shapes or {})
        from ..engine.profile import Profile

        profile = Profile({k: (v, v, v) for k, v in fixed.items()})
        float_kiln = [r for r in runners if r in KILN_PRECISIONS and r not in ("kiln-int8", "kiln-fp8")]
        seed_runner = float_kiln[0] if float_kiln else "kiln-fp32"
        bar.step(f"building {seed_runner} (its graph draws the synthetic inputs)")
        seed_engine = _build(build, model, seed_runner, profile, device, None)
        if seed_runner in runners:
            engines[seed_runner] = seed_engine
            bar.advance(f"built {seed_runner}")
        samples = synthetic_samples(seed_engine, 0, seed, count, None, val_range)
        result.inputs, result.synthetic_rules = "synthetic", describe(seed_engine, val_range)
    if not samples:
        raise InputError("no input samples to run.")
    for i, s in enumerate(samples):
        if sorted(s) != sorted(onnx_inputs):
            raise InputError(f"input sample {i} has {sorted(s)}; the model's inputs are {onnx_inputs}.")
    result.samples, result.samples_used = len(samples), samples
    profile = _profile(samples)
    for r in runners:
        if r in KILN_PRECISIONS and r not in engines:
            quantized = r in ("kiln-int8", "kiln-fp8")
            data = calib or (samples if quantized else None)
            if quantized and not calib:
                result.notes.append(f"{r}: scales calibrated on the {len(samples)} compared input sample(s) "
                                    f"({result.inputs}); pass --calib DATA to calibrate on other data.")
            bar.step(f"building {r}")
            engines[r] = _build(build, model, r, profile, device, data)
            bar.advance(f"built {r}")
        elif r not in KILN_PRECISIONS:
            bar.advance(f"{r} needs no build")
    for r in runners:
        bar.step(f"running {r} on {len(samples)} sample(s)")
        if r in engines:
            e = engines[r]
            quant = f" + {KILN_PRECISIONS[r][0].upper()}" if r in ("kiln-int8", "kiln-fp8") else ""
            result.runners[r] = f"Kiln engine, {e.precision}{quant}, {e.target.describe()}"
            run = _engine_runner(e.create_execution_context())
        elif r == "onnxruntime":
            ref = OnnxReference(model)
            ref.source = str(model_path)
            result.runners[r] = ref.describe()
            run = _reference_runner(ref, out_names)
        else:
            mod = TorchReference(load_torch_module(torch_module), onnx_inputs, out_names)
            result.runners[r] = mod.describe()
            run = _reference_runner(mod, out_names)
        outs, times = [], []
        for feeds in samples:
            t0 = time.perf_counter()
            outs.append(run(feeds))
            times.append(time.perf_counter() - t0)
        result.outputs[r], result.runtimes[r] = outs, times
        bar.advance(f"ran {r}")


def _engine_runner(ctx):
    def run(feeds):
        return {k: dtypes.to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in ctx.run(feeds).items()}
    return run


def _reference_runner(ref, names):
    def run(feeds):
        return ref.run(feeds, names)
    return run


def _compare_rows(result, runners, ref_name, out_names, atol, rtol, accept_vacuous) -> None:
    from .compare import DEFAULT_FRACTION, compare_arrays

    ref_outs = result.outputs[ref_name]
    for r in runners:
        if r == ref_name:
            continue
        precs = [KILN_PRECISIONS[x][0] for x in (r, ref_name) if x in KILN_PRECISIONS]
        f = max((DEFAULT_FRACTION.get(p, 1e-4) for p in precs), default=DEFAULT_FRACTION["float32"])
        for name in out_names:
            refs = [o[name] for o in ref_outs]
            got = [o[name] for o in result.outputs[r]]
            exact = np.asarray(refs[0]).dtype.kind in "biu"
            a = atol if atol is not None else (0.0 if exact else f)
            t = rtol if rtol is not None else (0.0 if exact else f)
            c = compare_arrays(name, refs, got, a, t, of_scale=atol is None and not exact,
                               accept_vacuous=accept_vacuous)
            result.rows.append(RunnerRow(r, name, c.verdict, c.abs_err.get("max"), c.abs_err.get("mean"),
                                         c.rel_err.get("max"), c.min_atol, c.atol, c.rtol,
                                         c.reason + (" (vacuous: a constant would pass)" if c.vacuous else "")))


def input_names(model_path) -> list[str]:
    """The model's inputs (initializers left out), in order."""
    model = _read(model_path)
    inits = {t.name for t in model.graph.initializer}
    return [vi.name for vi in model.graph.input if vi.name not in inits]


def _read(path):
    import onnx

    from ..errors import ModelError

    try:
        return onnx.load(str(path))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"'{path}' cannot be read as ONNX ({e}).") from None


def render(result: MultiRunnerResult, con) -> None:
    from rich.table import Table

    con.print(f"[I] Model: {result.model}; {result.samples} input sample(s); inputs: "
              + ("SYNTHETIC (pass --load-inputs with real samples)" if result.inputs == "synthetic" else result.inputs))
    for name, how in result.synthetic_rules.items():
        con.print(f"[W]     {name}: {how}")
    for r, what in result.runners.items():
        con.print(f"[I] Runner {r}: {what}" + ("  (reference)" if r == result.reference_runner else ""))
    for n in result.notes:
        con.print(f"[W] {n}")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("Runner", f"vs {result.reference_runner}: output", "max abs", "mean abs", "max rel",
                "min atol to pass", "atol / rtol", "Result"):
        table.add_column(col, overflow="fold")
    def g(x):
        return "-" if x is None else f"{x:.4g}"

    for row in result.rows:
        table.add_row(row.runner, row.output, g(row.max_abs), g(row.mean_abs), g(row.max_rel), g(row.min_atol),
                      f"{row.atol:.3g} / {row.rtol:g}", row.verdict + (f": {row.reason}" if row.reason else ""))
    con.print(table)
    bad = sorted({r.runner for r in result.rows if r.verdict != "PASSED"})
    tail = " (on synthetic inputs)" if result.inputs == "synthetic" else ""
    if result.verdict == "PASSED":
        con.print(f"[I] PASSED | every runner matches {result.reference_runner}{tail}")
    else:
        con.print(f"[E] {result.verdict} | runners {bad} against {result.reference_runner}{tail}")
