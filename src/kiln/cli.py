"""The `kiln` command. Spelling follows trtexec (--onnx=, --saveEngine=, --fp16, --minShapes= ...)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape

from .cli_flags import camel_case_flags
from .errors import ConfigError, InputError, KilnError
from .fileio import atomic_write

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# --- shared option groups -----------------------------------------------------
def _add_build_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--onnx", metavar="FILE", help="ONNX model to build (default: Kiln's embedded tiny CNN)")
    p.add_argument("--fp16", action="store_true", help="allow FP16 layers (FP32 accumulation)")
    p.add_argument("--bf16", action="store_true", help="allow BF16 layers")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for FP32 matmuls and convolutions")
    p.add_argument("--int8", action="store_true", help="INT8 GEMMs and convolutions (needs --calib or --calibCache)")
    p.add_argument("--fp8", action="store_true", help="FP8 E4M3 GEMMs and convolutions on Ada/Hopper (calibrated)")
    p.add_argument("--best", action="store_true", help="every precision that can be made accurate: FP16, plus INT8 "
                   "GEMMs and convolutions when --calib/--calibCache gives scales; the fastest tactic wins per layer")
    p.add_argument("--calib", metavar="DATA",
                   help="calibration samples: .npz by input name, folder of .npz, NAME:FILE.npy")
    p.add_argument("--calibCache", metavar="FILE", help="calibration cache (TensorRT text format, or .json): read if "
                   "it exists, else written")
    p.add_argument("--calibMethod", default="entropy", choices=["entropy", "minmax", "percentile"])
    p.add_argument("--accuracyBudget", "--accuracy-budget", dest="accuracyBudget", default="", metavar="METRIC=DROP",
                   help="with --int8/--fp8: keep the most sensitive layers in float until e.g. top1=0.5 holds")
    p.add_argument("--budgetData", metavar="FILE.npz", help="held-out inputs and 'labels' for --accuracyBudget")
    p.add_argument("--layerPrecisions", default="", metavar="SPEC",
                   help="pin layers (ONNX node names) to a float precision: conv1:fp32,fc:fp16 "
                        "(pinned layers are not quantized)")
    p.add_argument("--precisionConstraints", default="none", choices=["none", "obey"],
                   help="none (default): with --int8/--fp8 on a GPU, a layer whose float tactics time faster than its "
                        "8-bit ones stays in float; obey: quantize every layer that can be")
    p.add_argument("--minShapes", action="append", default=[], metavar="SPEC",
                   help="x:1x3x224x224,... ; repeat --minShapes/--optShapes/--maxShapes to add profiles")
    p.add_argument("--optShapes", action="append", default=[], metavar="SPEC")
    p.add_argument("--maxShapes", action="append", default=[], metavar="SPEC")
    p.add_argument("--memPoolSize", metavar="workspace:MiB", help="workspace cap for tactics, e.g. workspace:4096")
    p.add_argument("--builderOptimizationLevel", type=int, default=3, choices=range(6), metavar="0..5",
                   help="tactic search breadth: 0 reference kernels, 1-2 library tactics (cuDNN, cuBLASLt, SDPA), "
                        "3 +Triton norm/elementwise (default), 4-5 +Triton GEMM/conv/attention configs")
    p.add_argument("--timingCacheFile", metavar="FILE", help="reuse and update tactic timings in this JSON file")
    p.add_argument("--excludeTactics", default="", metavar="NAMES",
                   help="tactics never to time or choose, by name or pattern: triton_tma_*,cudnn_conv_relu")
    p.add_argument("--dumpPasses", metavar="DIR",
                   help="write the graph after each build pass into DIR as NN-pass.onnx (.txt where ONNX cannot "
                        "hold it), to see what each pass did")
    p.add_argument("--skipPasses", default="", metavar="NAMES",
                   help="fusion passes to leave out, to see what one changes: fuse_view_chains,fuse_elementwise")
    p.add_argument("--device", default="auto", help="auto (GPU if present), cuda, cuda:N or cpu")
    p.add_argument("--noCudaGraph", action="store_true", help="run layer by layer instead of one CUDA graph")
    p.add_argument("--maxAuxStreams", type=int, default=0, choices=range(2), metavar="0..1",
                   help="auxiliary streams for layers beside the main chain in the CUDA graph (default 0)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="", metavar="SPEC", help="runtime input shapes, x:2x3x224x224,...")
    p.add_argument("--profile", type=int, default=0, help="optimization profile to run with")
    p.add_argument("--loadInputs", metavar="FILE", help="inputs: a .npz keyed by input name, or name:file.npy,...")
    p.add_argument("--valRange", nargs="+", metavar="NAME:LO,HI", help="value range of synthetic inputs "
                   "(Polygraphy's spelling), e.g. input_ids:0,30521 pixel:[0,1]; LO,HI alone for every input")
    p.add_argument("--exportOutput", metavar="FILE", help="save outputs of the first run (.npz)")
    p.add_argument("--iterations", type=int, default=None, help="timed runs, at least (default: up to 100, "
                   "stopping once the median is stable)")
    p.add_argument("--duration", type=float, default=0.0, help="time for at least this many seconds")
    p.add_argument("--warmUp", type=float, default=200.0, help="warm-up time in ms")
    p.add_argument("--json", metavar="FILE", help="write the engine summary and the timing as JSON")


def _config_from_args(a):
    from .builder.config import BuildConfig, parse_layer_precisions, parse_mem_pool
    from .engine.profile import profile_from_flags
    from .tools.verify import parse_budgets

    counts = {len(a.minShapes), len(a.optShapes), len(a.maxShapes)} - {0}
    if len(counts) > 1:
        raise ConfigError("give --minShapes, --optShapes and --maxShapes the same number of times (once per profile).")
    n = max(counts) if counts else 0
    pick = lambda xs, i: xs[i] if xs else ""  # noqa: E731
    profiles = [profile_from_flags(pick(a.minShapes, i), pick(a.optShapes, i), pick(a.maxShapes, i)) for i in range(n)]
    if not profiles and getattr(a, "shapes", ""):  # as trtexec: --shapes alone is also the build's (static) profile
        profiles = [profile_from_flags(a.shapes, a.shapes, a.shapes, ("--shapes",) * 3)]
    # trtexec's --best quantizes with placeholder scales when there is no calibration data; Kiln never
    # invents scales, so without data --best means FP16, and says so.
    best_int8 = a.best and _has_calibration(a)
    if a.best and not best_int8:
        err.print("[yellow]note:[/] --best without calibration data builds FP16: INT8 layers need scales measured on "
                  "real inputs (--calib=DATA or an existing --calibCache), and Kiln does not make them up.")
    return BuildConfig(
        fp16=a.fp16 or a.best, bf16=a.bf16, tf32=a.tf32, profiles=profiles, device=a.device,
        int8=a.int8 or best_int8, fp8=a.fp8, calib=a.calib, layer_precisions=parse_layer_precisions(a.layerPrecisions),
        accuracy_budget=parse_budgets([a.accuracyBudget], "--accuracyBudget") if a.accuracyBudget else {},
        budget_data=a.budgetData,
        calib_cache=a.calibCache, calib_method=a.calibMethod,
        workspace_bytes=parse_mem_pool(a.memPoolSize) if a.memPoolSize else None,
        cuda_graphs=not a.noCudaGraph, max_aux_streams=a.maxAuxStreams, optimization_level=a.builderOptimizationLevel,
        timing_cache=a.timingCacheFile, precision_constraints=a.precisionConstraints,
        exclude_tactics=_names(a.excludeTactics), dump_passes=a.dumpPasses, skip_passes=_names(a.skipPasses),
    )


def _names(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): a comma-separated list of names (--excludeTactics, --skipPasses)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _note_emulated(precision: str, device: str, a) -> None:
    """Say before anything runs that FP16/BF16 on the CPU is emulated and slow (once per command)."""
    from .tools.timing import emulation_note

    note = emulation_note(precision, device)
    if note and not getattr(a, "_emulation_noted", False):
        err.print(f"[yellow]note:[/] {escape(note)}")
        a._emulation_noted = True


def _has_calibration(a) -> bool:
    return bool(a.calib or (a.calibCache and Path(a.calibCache).exists()))


# --- kiln build ---------------------------------------------------------------
def cmd_build(a) -> int:
    from .build import build
    from .engine import signing
    from .engine.profile import Profile
    from .errors import EngineFileError
    from .fileio import check_destination

    _check_run_options(a)
    if a.sign and not a.saveEngine:
        raise ConfigError("--sign signs the saved engine: give --saveEngine=FILE too.")
    sign_key = signing.load_key(a.sign) if a.sign else None
    if a.saveEngine:  # before the build: a destination that cannot be written fails now, not after it
        check_destination(a.saveEngine, EngineFileError, "--saveEngine")
    config = _config_from_args(a)
    if a.onnx:
        model, source = a.onnx, a.onnx
    else:
        from .models import DEFAULT_PROFILE, tiny_cnn

        model, source = tiny_cnn(), "Kiln's embedded tiny CNN (3x32x32 -> 10 classes)"
        if not config.profiles:
            config.profiles = [Profile(dict(DEFAULT_PROFILE))]
    if config.device == "auto" and not torch.cuda.is_available():
        err.print("[yellow]note:[/] no CUDA GPU found: building for the CPU target (reference kernels). "
                  "Latency figures below are CPU figures, not GPU ones.")
    _note_emulated(config.precision, "cpu" if config.device == "cpu" or not torch.cuda.is_available() else "cuda", a)
    engine = build(model, config)
    if a.calib and Path(a.calib).exists() and isinstance(engine.build_config.get("calibration"), dict):
        # `kiln compare` runs on the calibration data when no inputs are given: data, not synthetic values
        engine.build_config["calibration"]["data"] = str(Path(a.calib).resolve())
    _print_build_summary(engine, source)
    if a.saveEngine:
        from .engine.serialize import save

        save(engine, a.saveEngine, sign_key=sign_key)
        out.print(f"Engine saved to {a.saveEngine} ({Path(a.saveEngine).stat().st_size / 2**20:.2f} MiB)")
    saved = a.saveEngine or _save_first_engine(engine, a)
    rc = 0 if a.skipInference else _run_and_report(engine, a)
    _print_next_command(saved, a)
    return rc


DEFAULT_ENGINE = "kiln-default.kiln"


def _save_first_engine(engine, a) -> str | None:
    """`kiln build` with no model keeps what it built: DEFAULT_ENGINE in the current directory."""
    if a.onnx:
        return None
    path = Path(DEFAULT_ENGINE)
    try:
        engine.save(path)
    except (OSError, KilnError) as e:
        err.print(f"[yellow]note:[/] the engine was not saved to {path} in the current directory ({escape(str(e))}); "
                  "--saveEngine=FILE writes it elsewhere.")
        return None
    out.print(f"Engine saved to {path} in the current directory ({path.stat().st_size / 2**20:.2f} MiB; "
              "--saveEngine=FILE writes it elsewhere)")
    return str(path)


def _print_next_command(saved: str | None, a) -> None:
    if saved and not a.onnx:
        out.print(f"Next: kiln inspect {saved}   (layers, fusions, precisions); then your own model: "
                  "kiln build --onnx=model.onnx --fp16 --saveEngine=model.kiln")
    elif saved:
        out.print(f"Next: kiln compare {a.onnx} {saved}   (the engine's outputs against onnxruntime's)")
    elif a.onnx:
        out.print(f"Next: add --saveEngine=model.kiln to keep the engine, then kiln compare {a.onnx} model.kiln")


def _graph_text(engine) -> str:
    if engine.target.kind != "cuda":
        return "n/a (CPU target)"
    if not engine.capturable:
        return "no (value-dependent shapes, control flow or random ops: runs layer by layer)"
    return "one per input shape" if engine.build_config.get("cuda_graphs", True) else "disabled (--noCudaGraph)"


def _print_build_summary(engine, source: str) -> None:
    from .ir.shapes import fmt_shape

    g = engine.graph
    out.print(f"Built {source}")
    quant = sum(n.precision in ("int8", "fp8") for n in g.nodes)
    kind = "FP8" if engine.build_config.get("fp8") else "INT8"
    prec = engine.precision + (f" ({quant} {kind} layers)" if quant else "")
    out.print(f"  target: {engine.target.describe()}   precision: {prec}   "
              f"build time: {engine.build_seconds:.2f} s")
    phases = engine.build_config.get("build_phases") or {}
    if phases:  # where the time went (an 8-bit GPU build's inner builds: `kiln inspect`'s precision-by-speed)
        out.print("  build phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    host = sum(n.placement == "host" for n in g.nodes)
    out.print(f"  layers: {len(g.nodes)} ({host} shape-arithmetic layers on the host)   "
              f"weights: {engine.weight_bytes / 2**20:.2f} MiB   "
              f"CUDA graph: {_graph_text(engine)}")
    for i, p in enumerate(engine.profiles):
        shapes = ", ".join(f"{k}: {fmt_shape(a)}..{fmt_shape(c)} (opt {fmt_shape(b)})"
                           for k, (a, b, c) in p.shapes.items())
        arena = engine.arena_bytes[i] if i < len(engine.arena_bytes) else None
        out.print(f"  profile {i}: {shapes}" + (f"   activations at max: {arena / 2**20:.2f} MiB" if arena else ""))
    fused = [n for n in g.nodes if n.domain == "kiln"]
    if fused:
        kinds = sorted({n.op_type for n in fused})
        out.print(f"  fused layers: {len(fused)} ({', '.join(kinds)})")
    if engine.tactics:
        chosen = {}
        for t in engine.tactics:
            chosen[t["chosen"]] = chosen.get(t["chosen"], 0) + 1
        cache = engine.build_config.get("timing_cache") or {}
        out.print(f"  tactics timed for {len(engine.tactics)} layers: "
                  + ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items(), key=lambda kv: -kv[1]))
                  + (f"   timing cache: {cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses"
                     if cache.get("path") else ""))
        capped = {name: why for t in engine.tactics for name, why in t["excluded"].items() if "workspace" in why}
        for name, why in sorted(capped.items()):
            out.print(f"  [yellow]workspace cap excluded {name}[/]: {escape(why)}")
        for t in engine.tactics:
            if t.get("chosen_per_profile"):
                per = " | ".join(f"p{i} {name}" for i, name in enumerate(t["chosen_per_profile"]))
                out.print(f"  {escape(t['layer'])}: {escape(per)}")
        asked = sorted({name for t in engine.tactics for name, why in t["excluded"].items()
                        if "--excludeTactics" in why})
        if asked:
            out.print(f"  excluded as asked (--excludeTactics): {escape(', '.join(asked))}")
    for n in g.nodes:
        if n.note:
            out.print(f"  [yellow]{escape(n.name)}[/]: {escape(n.note)}")
    for f in engine.findings:
        if f.get("kind") == "precision-search":
            from .quant.search import summary

            for line in summary(f):
                out.print(f"  {escape(line)}")
        if f.get("kind") == "precision-by-speed":
            from .tools.inspect import describe_finding

            out.print(f"  {escape(describe_finding(f))}")


# --- kiln run -----------------------------------------------------------------
def _save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    atomic_write(path, lambda f: np.savez(f, **arrays))


def _run_and_report(engine, a) -> int:
    from .engine.profile import parse_shapes
    from .ir import dtypes
    from .samples import load_samples
    from .tools.timing import render, time_context

    shapes = parse_shapes(a.shapes, "--shapes")
    unknown = [k for k in shapes if k not in {v.name for v in engine.inputs}]
    if unknown:
        raise InputError(f"--shapes: {unknown} are not inputs of this engine; "
                         f"its inputs are {[v.name for v in engine.inputs]}.")
    _note_emulated(engine.precision, engine.target.device, a)
    ctx = engine.create_execution_context(profile=a.profile)
    if a.loadInputs:
        loaded = load_samples(a.loadInputs, [v.name for v in engine.inputs])
        for k, x in loaded[0].items():
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                warnings.warn(f"input '{k}' from {a.loadInputs} contains NaN or Inf values; "
                              "outputs will likely be NaN.")
        input_sets = [{k: dtypes.to_torch(x) for k, x in sample.items()} for sample in loaded]
    else:
        from .engine.synthetic import parse_val_range

        val_range = parse_val_range(a.valRange, [v.name for v in engine.inputs])
        input_sets = [engine.random_inputs(a.profile, shapes=shapes, seed=seed, val_range=val_range)
                      for seed in range(4)]
        from .engine.synthetic import describe

        out.print("Synthetic inputs (--loadInputs gives real ones): "
                  + "; ".join(f"{k}: {how}" for k, how in describe(engine, val_range).items()))
    dev = engine.target.device
    input_sets = [{k: x.to(dev) for k, x in s.items()} for s in input_sets]
    for name, x in input_sets[0].items():
        ctx.check_shape(name, tuple(x.shape))
    first = ctx.run(input_sets[0])
    if a.exportOutput:
        _save_npz(a.exportOutput, {k: dtypes.to_numpy(t) for k, t in first.items()})
        out.print(f"Outputs saved to {a.exportOutput}")
    shape_text = ", ".join(f"{k}: {list(x.shape)}" for k, x in input_sets[0].items())
    out.print(f"Running on {engine.target.describe()} with {shape_text} (profile {a.profile}, "
              f"{'CUDA graph replay' if ctx.uses_cuda_graphs else 'layer by layer'})")
    t = time_context(ctx, input_sets, iterations=a.iterations or 100, warmup_ms=a.warmUp, duration_s=a.duration,
                     stop_when_stable=a.iterations is None, warn_emulated=False)
    first_shape = next(iter(input_sets[0].values())).shape if input_sets[0] else (1,)
    t.batch = first_shape[0] if len(first_shape) else 1
    render(t, out)
    if getattr(a, "json", None):
        from .json_file import atomic_write_json

        atomic_write_json(a.json, {"target": engine.target.describe(), "precision": engine.precision,
                                   "build_seconds": engine.build_seconds, "layers": len(engine.graph.nodes),
                                   "profile": a.profile, "inputs": {k: list(x.shape) for k, x in input_sets[0].items()},
                                   "synthetic_inputs": not a.loadInputs, "timing": t.to_json()})
        out.print(f"Summary written to {a.json}")
    return 0


def _check_run_options(a) -> None:
    """Option values argparse's types cannot refuse: counts and times, the device, output destinations."""
    from .engine.serialize import check_device
    from .fileio import check_destination

    if a.iterations is not None and a.iterations <= 0:  # None: up to 100, stopping once stable
        raise ConfigError(f"--iterations must be at least 1, not {a.iterations}.")
    for flag, value in (("--duration", a.duration), ("--warmUp", a.warmUp)):
        if not value >= 0:  # also refuses NaN
            raise ConfigError(f"{flag} must be zero or more, not {value}.")
    check_device(a.device)
    if a.exportOutput:
        check_destination(a.exportOutput, ConfigError, "--exportOutput")


def cmd_run(a) -> int:
    if bool(a.loadEngine) == bool(a.onnx):
        raise ConfigError("kiln run needs exactly one of --loadEngine=FILE or --onnx=FILE.")
    _check_run_options(a)
    if a.verifyKey and not a.loadEngine:
        raise ConfigError("--verifyKey checks an engine file: use it with --loadEngine=FILE.")
    if a.loadEngine:
        from .engine import signing
        from .engine.serialize import load

        key = signing.load_key(a.verifyKey) if a.verifyKey else None
        engine = load(a.loadEngine, device=a.device, verify_key=key)
        if a.noCudaGraph:
            engine.build_config["cuda_graphs"] = False
    else:
        from .build import build

        engine = build(a.onnx, _config_from_args(a))
    return _run_and_report(engine, a)


# --- main ---------------------------------------------------------------------
def version_text() -> str:
    """Kiln, torch, Triton and CUDA versions and the GPU: what an engine's stamp and a bug report need."""
    from .version import __version__

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    cuda = torch.version.cuda or "none (a CPU build of torch)"
    if torch.cuda.is_available():
        gpus = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                for i in range(torch.cuda.device_count())]
        gpu = ", ".join(gpus)
    else:
        gpu = "none found (engines build for the CPU target)"
    return "\n".join([f"Kiln {__version__}", f"torch {torch.__version__}", f"Triton {triton_v}", f"CUDA {cuda}",
                      f"GPU {gpu}"])


class _VersionAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        out.print(escape(version_text()))
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kiln", description="Compile ONNX/PyTorch models into verified GPU engines.",
        epilog="MODULE:FACTORY and MODULE:FUNCTION references (--torch, --reference, --metric) are imported from "
               "Python's import path (PYTHONPATH, installed packages); Kiln never adds the current directory to it. "
               "For a file in the current directory, give its path: ./models.py:make_model.")
    p.add_argument("--version", action=_VersionAction, nargs=0,
                   help="print Kiln's, torch's, Triton's and CUDA's versions and the GPU, then exit")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an engine (like trtexec --onnx= --saveEngine=) and time it")
    _add_build_options(b)
    b.add_argument("--saveEngine", metavar="FILE", help="write the engine here")
    b.add_argument("--sign", metavar="KEYFILE", help="sign the saved engine with this secret key (HMAC-SHA256; at "
                   "least 16 bytes), so `kiln run|inspect --verifyKey KEYFILE` accepts only engines you built")
    b.add_argument("--skipInference", action="store_true", help="build only; do not time the engine")
    _add_run_options(b)
    b.set_defaults(func=cmd_build)

    r = sub.add_parser("run", help="run and time an engine (--loadEngine=) or an ONNX model (--onnx=)")
    _add_build_options(r)
    r.add_argument("--loadEngine", metavar="FILE")
    r.add_argument("--verifyKey", "--verify-key", dest="verifyKey", metavar="KEYFILE",
                   help="refuse the engine unless it was signed with this key (kiln build --sign KEYFILE)")
    _add_run_options(r)
    r.set_defaults(func=cmd_run)

    from .frontend import check as check_cmd
    from .serve import engine_cli as serve_tool
    from .serve import export as export_tool
    from .tools import bench as bench_tool
    from .tools import compare as compare_tool
    from .tools import inspect as inspect_tool
    from .tools import report as report_tool
    from .tools import verify as verify_tool

    check_cmd.add_check_command(sub)
    for tool in (inspect_tool, compare_tool, verify_tool, bench_tool, report_tool, export_tool, serve_tool):
        tool.add_command(sub)
    from .build import build

    sub.choices["compare"].set_defaults(build=build)  # --runners builds with kiln.build, a layer above the tools
    from .llm import cli as llm_cli

    llm_cli.add_command(sub)
    camel_case_flags(p)  # trtexec's spelling first in every command, the kebab-case one its alias
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None):
    err.print(f"[yellow]warning:[/] {escape(str(message))}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings.showwarning = _show_warning
    try:
        return args.func(args) or 0
    except KilnError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        return e.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
