"""The model zoo benchmark: build every zoo model (bench/zoo_models.py) with Kiln at each precision and batch,
check it against its reference and time it against eager PyTorch and torch.compile.

    python bench/zoo.py --out DIR [--precisions fp32,fp16,bf16,int8,fp8] [--batches 1,32] [--models a,b]
                        [--size real|tiny] [--device auto|cuda|cpu] [--case-timeout S] [--time-limit S]

Prints the table and writes DIR/zoo.md and DIR/zoo.json: model, precision, batch, Kiln ms, torch.compile ms,
eager ms, ratio (Kiln over torch.compile, else over eager), error against the reference (relative L2 over
the outputs, the worst output), build seconds, status (ok, mismatch, or failed with the reason). The
reference is the FP32 model: eager PyTorch for modules, onnxruntime on the CPU for the real ONNX files
(whose "eager" column is onnxruntime's CPU time, two threads). An FP16/BF16 row passes within its tolerance, or
within 1.5x of eager PyTorch's own error at that precision (its column beside Kiln's: a random-weight network's
FP16 error grows with depth whoever computes it). Every case runs in its own try/except under
a time limit, so one failure never stops the table. 8-bit rows calibrate on random inputs (the compared
inputs plus noise) and compare their timings with torch at FP16; their "torch's own" column is a fake-quantized
PyTorch reference with the engine's rounding (bench/fake_quant.py), and they pass within their tolerance or
1.5x of it: an engine near that reference rounds as designed, one far above it has a bug. The top-1 column is
the share of rows (and sequence steps) whose argmax over the last axis of an output of rank 2 or 3 matches the
reference's (class scores; for hidden states it means little); a reduced-precision row of a real ONNX file (no
torch or fake-quant reference to set its bound) whose every prediction stayed passes with a note: PP-OCR's
softmax over 6625 characters moves its confidences under BF16's and 8-bit rounding, not its answers. A detector
whose entry names a mask threshold (PP-OCR's text map, binarized at 0.3 by its post-processing) passes at any precision when its mask agrees with the reference's
on at least 99.9% of the elements; the column then holds that share. An object detector whose entry names its
score outputs and confidence cut (PP-PicoDet's, at 0.5) passes when its detections, the (anchor, class) pairs
above the cut, overlap the reference's at an intersection over union of at least 0.9; the column holds it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import zoo_models  # noqa: E402

import kiln  # noqa: E402
from kiln import BuildConfig, Profile  # noqa: E402
from kiln.errors import summary as error_summary  # noqa: E402

PRECISIONS = {"fp32": {}, "tf32": {"tf32": True}, "fp16": {"fp16": True}, "bf16": {"bf16": True},
              "int8": {"int8": True, "fp16": True}, "fp8": {"fp8": True, "fp16": True}}
# Relative L2 against FP32 within which a row reads "ok" (8-bit: a loose bound on random weights and inputs).
TOLERANCE = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 2e-2, "bf16": 5e-2, "int8": 0.25, "fp8": 0.25}
_TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float16, "fp8": torch.float16}


@dataclass
class Row:
    model: str
    precision: str
    batch: int
    kiln_ms: float | None = None
    compile_ms: float | None = None
    eager_ms: float | None = None
    ratio: float | None = None
    rel_l2: float | None = None
    build_s: float | None = None
    torch_rel_l2: float | None = None  # eager PyTorch's own error at that precision (8-bit: fake-quantized)
    status: str = "not run"
    source: str = ""
    findings: int = 0  # the engine's findings (precision kept in FP32, tactics dropped, ...)
    top1: float | None = None  # class-score outputs: share of rows whose argmax (last axis) matches the reference
    cuda_graph: str = ""  # on a GPU: "yes" when the engine replays as one CUDA graph, else "no: <why>"


class CaseTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise CaseTimeout in this (main) thread after `seconds`; code inside a long C call stops when it returns."""
    if not seconds or seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise CaseTimeout(f"over the {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _ByPosition(torch.nn.Module):
    """A module whose keyword arguments are given by position: ONNX inputs are positional."""

    def __init__(self, module, keywords):
        super().__init__()
        self.module, self.keywords = module, list(keywords)

    def forward(self, *args):
        n = len(args) - len(self.keywords)
        return self.module(*args[:n], **dict(zip(self.keywords, args[n:])))


def _leaves(out) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [x for x in pytree.tree_flatten(out)[0] if isinstance(x, torch.Tensor)]


# onnxruntime's exp/sigmoid/tanh are approximations within a few 1e-8 of exact: on an output of values near
# 1e-6 (PP-OCR's probability map over a random image) that alone would read as a relative error of several
# percent. Against an onnxruntime reference, differences under this (absolute) count as none.
ORT_ATOL = 2e-7


def rel_l2(outs, refs, atol: float = 0.0) -> float:
    """The worst relative L2 error over the outputs, differences of at most `atol` counted as none."""
    if len(outs) != len(refs):
        raise ValueError(f"the engine returns {len(outs)} outputs, the reference {len(refs)}")
    worst = 0.0
    for o, r in zip(outs, refs):
        o = np.asarray(o.detach().cpu().float() if isinstance(o, torch.Tensor) else o, dtype=np.float64)
        r = np.asarray(r.detach().cpu().float() if isinstance(r, torch.Tensor) else r, dtype=np.float64)
        if o.shape != r.shape:
            raise ValueError(f"an output of shape {o.shape} where the reference has {r.shape}")
        finite = np.isfinite(r)
        if not np.isfinite(o[finite]).all():
            return float("inf")
        d = np.where(finite, o - r, 0.0)
        d = np.where(np.abs(d) <= atol, 0.0, d)
        denom = np.linalg.norm(r[finite])
        err = np.linalg.norm(d) / denom if denom > 0 else np.linalg.norm(d)
        worst = max(worst, float(err))
    return worst


@dataclass
class Prepared:
    """A zoo model at one batch: its ONNX model, inputs and FP32 reference outputs."""

    spec: zoo_models.Spec
    onnx_model: object  # onnx.ModelProto or a path
    feeds: dict  # ONNX input name -> tensor (CPU)
    reference: list
    torch_module: torch.nn.Module | None
    torch_args: tuple
    export_s: float


def prepare(entry: zoo_models.Entry, size: str, batch: int, spec: zoo_models.Spec | None = None) -> Prepared:
    spec = spec or entry.make(size, batch)
    if spec.onnx_path is not None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        sess = ort.InferenceSession(spec.onnx_path, opts, providers=["CPUExecutionProvider"])
        feeds = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in spec.feeds.items()}
        ref = sess.run(None, spec.feeds)
        return Prepared(spec, spec.onnx_path, feeds, ref, None, (), 0.0)
    module = spec.module.eval()
    target = _ByPosition(module, spec.kwargs) if spec.kwargs else module
    args = tuple(spec.args) + tuple(spec.kwargs.values())
    with torch.no_grad():
        ref = _leaves(target(*args))
    t0 = time.perf_counter()
    model, _ = kiln.from_torch(target, args)
    export_s = time.perf_counter() - t0
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(names) != len(tensors):
        raise ValueError(f"the exported model has {len(names)} inputs for {len(tensors)} tensor arguments")
    return Prepared(spec, model, dict(zip(names, tensors)), ref, target, args, export_s)


def calibration_feeds(prep: Prepared) -> list[dict]:
    """The 8-bit rows' calibration set: eight copies of the compared inputs, float ones with noise added."""
    g = torch.Generator().manual_seed(2)
    return [{k: (v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v)
             for k, v in prep.feeds.items()} for _ in range(8)]


EXCLUDE_TACTICS: tuple[str, ...] = ()  # --exclude-tactics: BuildConfig.exclude_tactics of every build (A/B runs)
SKIP_PASSES: tuple[str, ...] = ()  # --skip-passes: BuildConfig.skip_passes of every build (A/B runs)
TIMING_CACHE: str | None = None  # --timing-cache: one timing cache file for every build (A/B runs rebuild warm)


def build(prep: Prepared, precision: str, device: str, progress: bool = False, validate: bool = True):
    shapes = {k: tuple(v.shape) for k, v in prep.feeds.items()}
    extra = dict(PRECISIONS[precision])
    if EXCLUDE_TACTICS:
        extra["exclude_tactics"] = EXCLUDE_TACTICS
    if SKIP_PASSES:
        extra["skip_passes"] = SKIP_PASSES
    if TIMING_CACHE:
        extra["timing_cache"] = TIMING_CACHE
    if "int8" in extra or "fp8" in extra:
        extra["calib"] = [{k: v.numpy() for k, v in feeds.items()} for feeds in calibration_feeds(prep)]
    config = BuildConfig(profiles=[Profile({k: (s, s, s) for k, s in shapes.items()})], device=device,
                         progress=progress, validate=validate, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kiln.build(prep.onnx_model, config)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, calls: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(calls):
                fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


PEER_FACTOR = 1.5


def top1_agreement(outs, refs) -> float | None:
    """Share of rows whose argmax over the last axis matches the reference's, on the first output that reads as
    class scores (rank 2 or 3, at least 10 classes on the last axis), or None when none does."""
    for o, r in zip(outs, refs):
        o = np.asarray(o.detach().cpu().float() if isinstance(o, torch.Tensor) else o)
        r = np.asarray(r.detach().cpu().float() if isinstance(r, torch.Tensor) else r)
        if o.shape == r.shape and r.ndim in (2, 3) and r.shape[-1] >= 10 and r.dtype.kind == "f":
            return float((o.argmax(-1) == r.argmax(-1)).mean())
    return None


MASK_AGREEMENT = 0.999


def mask_agreement(outs, refs, threshold: float | None) -> float | None:
    """Share of the first output's elements on the same side of `threshold` as the reference's (None: no mask)."""
    if threshold is None:
        return None
    o = np.asarray(outs[0].detach().cpu().float() if isinstance(outs[0], torch.Tensor) else outs[0])
    r = np.asarray(refs[0].detach().cpu().float() if isinstance(refs[0], torch.Tensor) else refs[0])
    return float(((o > threshold) == (r > threshold)).mean())


DETECTION_IOU = 0.9


def detection_agreement(outs, refs, detections: tuple[float, int] | None) -> float | None:
    """Intersection over union of the engine's and the reference's detections (spec.detections); None when the
    entry names none or the reference detects nothing (an empty set proves nothing)."""
    if detections is None:
        return None
    threshold, n = detections
    mine, theirs = (np.concatenate([np.asarray(t.detach().cpu().float() if isinstance(t, torch.Tensor) else t).ravel()
                                    > threshold for t in ts[:n]]) for ts in (outs, refs))
    union = (mine | theirs).sum()
    return float((mine & theirs).sum() / union) if theirs.any() else None


def _torch_error(prep: Prepared, precision: str, device) -> float | None:
    """Eager PyTorch's relative L2 error at the row's precision against the FP32 reference (None if the module
    does not run at that precision here)."""
    import copy

    dtype = _TORCH_DTYPE[precision]
    try:
        module = copy.deepcopy(prep.torch_module).to(device=device, dtype=dtype)
        args = tuple(a.to(device=device, dtype=dtype) if a.is_floating_point() else a.to(device)
                     for a in prep.torch_args)
        with torch.no_grad():
            return rel_l2(_leaves(module(*args)), prep.reference)
    except Exception:  # an op without a kernel at this precision on this device
        return None


def _fake_quant_error(prep: Prepared, precision: str, device) -> float | None:
    """A fake-quantized PyTorch reference's relative L2 error at the row's 8-bit type (bench/fake_quant.py),
    calibrated on the rows' own calibration set."""
    import copy

    import fake_quant

    def on_device(feeds: dict) -> tuple:  # the module's arguments with its tensors replaced in input order
        tensors = iter(feeds.values())
        return tuple(next(tensors).to(device) if isinstance(a, torch.Tensor) else a for a in prep.torch_args)

    try:
        module = copy.deepcopy(prep.torch_module).to(device)
        outs = fake_quant.fake_quant_outputs(module, on_device(prep.feeds),
                                             [on_device(f) for f in calibration_feeds(prep)], precision)
        return rel_l2(_leaves(outs), prep.reference)
    except Exception:  # a layer PyTorch cannot round this way here (FP8 casts on an old build, say)
        return None


def _torch_peer(prep: Prepared, precision: str, device):
    """The torch module and arguments at the row's precision on the device (8-bit rows: FP16)."""
    dtype = _TORCH_DTYPE.get(precision, torch.float32)
    module = prep.torch_module.to(device=device, dtype=dtype)
    args = tuple(a.to(device=device, dtype=dtype) if a.is_floating_point() else a.to(device) for a in prep.torch_args)
    return module, args


@contextmanager
def gpu_turn():
    """Hold the GPU alone while timing: with ZOO_GPU_LOCK set (parallel shards of one zoo run), the shards take
    turns through that lock file for their builds (whose tactic timing needs the GPU alone) and timings, and
    compile torch.compile's graphs (CPU work) outside it."""
    path = os.environ.get("ZOO_GPU_LOCK")
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compiled_peer(prep: Prepared, precision: str, device: torch.device):
    """torch.compile (reduce-overhead) of the torch module at the row's precision, compiled and warmed up, with
    its arguments; or the reason it failed. A copy: the FP32 module stays the other references' source."""
    import copy

    dtype = _TORCH_DTYPE.get(precision, torch.float32)
    module = copy.deepcopy(prep.torch_module).to(device=device, dtype=dtype)
    args = tuple(a.to(device=device, dtype=dtype) if a.is_floating_point() else a.to(device) for a in prep.torch_args)
    torch._dynamo.reset()
    try:
        fast = torch.compile(module, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                fast(*args)
        return fast, args, None
    except Exception as e:
        return None, args, f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"


def run_case(entry, prep: Prepared, precision: str, batch: int, device: str, timing: bool,
             torch_compile: bool, calls: int = 20, validate: bool = True, profile_top: int = 0) -> Row:
    """One row. validate=False skips the build's own validation runs (the comparison below runs the engine
    anyway; CI saves two runs a model); the precision guard runs either way."""
    row = Row(entry.name, precision, batch, source=entry.source)
    compiled = None
    want_compile = timing and torch_compile and prep.torch_module is not None and torch.cuda.is_available() \
        and device != "cpu"
    if want_compile:  # before the GPU turn: compiling is CPU work another shard's timing need not wait for
        compiled = _compiled_peer(prep, precision, torch.device("cuda"))
    try:
        with gpu_turn():
            _build_check_time(row, prep, precision, device, timing, compiled, calls, validate, profile_top)
    finally:
        if compiled is not None:
            torch._dynamo.reset()
        if prep.torch_module is not None:
            prep.torch_module.to(device="cpu", dtype=torch.float32)
    return row


def _build_check_time(row: Row, prep: Prepared, precision: str, device: str, timing: bool, compiled,
                      calls: int, validate: bool, profile_top: int = 0) -> None:
    engine = build(prep, precision, device, validate=validate)
    row.build_s = round(engine.build_seconds, 2)
    row.findings = len(engine.findings)
    dev = engine.target.device
    ctx = engine.create_execution_context()
    feeds = {k: v.to(dev) for k, v in prep.feeds.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = list(ctx.run(feeds).values())
    row.rel_l2 = rel_l2(outs, prep.reference, atol=ORT_ATOL if prep.torch_module is None else 0.0)
    if dev.type == "cuda":
        row.cuda_graph = ("yes" if ctx.uses_cuda_graphs and not ctx.capture_failures else
                          f"no: {ctx.capture_failures[0][:120]}" if ctx.capture_failures else
                          "no: the engine has layers that cannot be captured")
    if precision in ("fp16", "bf16") and prep.torch_module is not None:
        row.torch_rel_l2 = _torch_error(prep, precision, dev)
    elif precision in ("int8", "fp8") and prep.torch_module is not None:
        row.torch_rel_l2 = _fake_quant_error(prep, precision, dev)
    # A random-weight network's FP16 error grows with its depth whoever computes it: within PEER_FACTOR of
    # eager PyTorch's own error at the same precision also passes.
    bound = max(TOLERANCE[precision], PEER_FACTOR * (row.torch_rel_l2 or 0.0))
    row.top1 = top1_agreement(outs, prep.reference)
    mask = mask_agreement(outs, prep.reference, prep.spec.mask_threshold)
    found = detection_agreement(outs, prep.reference, prep.spec.detections)
    if row.rel_l2 <= bound:
        row.status = "ok"
    elif found is not None and found >= DETECTION_IOU:  # a detector's answer is its detections
        row.top1 = found
        row.status = (f"ok (detections above {prep.spec.detections[0]:g}: intersection over union {found:.3f}; "
                      f"rel L2 over {bound:.3g})")
    elif mask is not None and mask >= MASK_AGREEMENT:  # a detector's map: its binarized answer is what it returns
        row.top1 = mask
        row.status = f"ok (mask at {prep.spec.mask_threshold:g} agrees on {100 * mask:.2f}%; rel L2 over {bound:.3g})"
    elif precision != "fp32" and prep.torch_module is None and row.top1 == 1.0:  # scores moved, answers not
        row.status = f"ok (top-1 unchanged; rel L2 over tolerance {bound:.3g})"
    else:
        row.status = f"mismatch (tolerance {bound:.3g})"
    if not timing:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row.kiln_ms = round(time_ms(lambda: ctx.run(feeds, copy_outputs=False), dev, calls), 4)
    if prep.torch_module is None:  # a real ONNX file: onnxruntime's CPU time stands in for eager
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        sess = ort.InferenceSession(prep.spec.onnx_path, opts, providers=["CPUExecutionProvider"])
        row.eager_ms = round(time_ms(lambda: sess.run(None, prep.spec.feeds), torch.device("cpu"), 3, 3, 1), 4)
    else:
        module, args = _torch_peer(prep, precision, dev)
        with torch.no_grad():
            try:
                row.eager_ms = round(time_ms(lambda: module(*args), dev, calls), 4)
            except Exception as e:  # eager at this precision may not run (BF16 LSTM on the CPU, say)
                row.status += f"; eager failed: {type(e).__name__}"
            if compiled is not None:
                fast, cargs, failure = compiled
                if failure:
                    row.status += f"; {failure}"
                else:
                    row.compile_ms = round(time_ms(lambda: fast(*cargs), dev, calls), 4)
    peer = row.compile_ms or row.eager_ms
    row.ratio = round(row.kiln_ms / peer, 3) if peer else None
    if profile_top:
        print_profile(row, engine, ctx, feeds, profile_top, compiled)


def print_profile(row: Row, engine, ctx, feeds: dict, top: int, compiled=None) -> None:
    """Where a timed case's time goes. On a GPU: the `top` kernels of one graph replay by GPU time, and the same
    for torch.compile's peer (what it runs instead). On the CPU: the `top` slowest layers, run layer by layer."""
    if ctx.device.type == "cuda":
        from run import kernel_profile  # bench/run.py

        peers = [("kiln", lambda f: ctx.run(f, copy_outputs=False), feeds)]
        if compiled is not None and compiled[0] is not None:
            peers.append(("torch.compile", lambda args: compiled[0](*args), compiled[1]))
        for who, fn, arg in peers:
            with torch.no_grad():
                kernels = kernel_profile(fn, arg, runs=5, top=1000)
            total = sum(k["ms"] for k in kernels)
            print(f"-- {row.model} {row.precision} b{row.batch} {who}: {sum(k['calls'] for k in kernels)} kernels, "
                  f"{total:.4f} ms of GPU time", flush=True)
            for k in kernels[:top]:
                print(f"   {k['ms']:8.4f} ms {100 * k['share']:5.1f}% x{k['calls']:<3} {k['kernel'][:110]}", flush=True)
        return
    from kiln.tools.bench import layer_profile

    layers = sorted(layer_profile(engine, feeds, iterations=5), key=lambda x: -x.mean_ms)
    print(f"-- {row.model} {row.precision} b{row.batch}: {len(layers)} layers, "
          f"{sum(x.mean_ms for x in layers):.3f} ms layer by layer", flush=True)
    for x in layers[:top]:
        print(f"   {x.mean_ms:8.4f} ms {x.share:5.1f}%  {x.op_type:<22} {x.precision:<5} {x.tactic or '-':<34} "
              f"{x.name[:70]}", flush=True)


def run(entries, precisions, batches, device: str, size: str, timing: bool, torch_compile: bool,
        case_timeout: float, time_limit_s: float, log=print, on_row=None, profile_top: int = 0) -> list[Row]:
    """Every case of every entry; on_row(rows) after each row (main writes the files as it goes)."""
    rows = _Rows(on_row)
    _cases(rows, entries, precisions, batches, device, size, timing, torch_compile, case_timeout, time_limit_s, log,
           profile_top)
    return list(rows)


class _Rows(list):
    def __init__(self, on_row):
        super().__init__()
        self.on_row = on_row

    def append(self, row):
        super().append(row)
        if self.on_row:
            self.on_row(list(self))

    def __iadd__(self, more):
        for r in more:
            self.append(r)
        return self


def _cases(rows, entries, precisions, batches, device, size, timing, torch_compile, case_timeout, time_limit_s,
           log, profile_top: int = 0) -> None:
    start = time.perf_counter()
    for entry in entries:
        missing = [m for m in entry.needs if __import__("importlib").util.find_spec(m) is None]
        for batch in batches:
            cases = [Row(entry.name, p, batch, source=entry.source) for p in precisions]
            if missing:
                for r in cases:
                    r.status = f"skipped: needs {', '.join(missing)}"
                rows += cases
                continue
            if time_limit_s and time.perf_counter() - start > time_limit_s:
                for r in cases:
                    r.status = "skipped: the zoo's time limit was reached"
                rows += cases
                continue
            try:
                with time_limit(case_timeout):
                    prep = prepare(entry, size, batch)
            except BaseException as e:  # noqa: BLE001  (a model that cannot be made or exported is a row)
                if isinstance(e, KeyboardInterrupt):
                    raise
                for r in cases:
                    r.status = f"failed: export: {error_summary(e, 300)}"
                rows += cases
                log(f"{entry.name} b{batch}: export failed: {error_summary(e, 300)}")
                continue
            if prep.spec.fixed_batch is not None and batch != prep.spec.fixed_batch:
                for r in cases:
                    r.status = f"skipped: the model's batch is fixed at {prep.spec.fixed_batch}"
                rows += cases
                continue
            for precision in precisions:
                t0 = time.perf_counter()
                try:
                    with time_limit(case_timeout):
                        row = run_case(entry, prep, precision, batch, device, timing, torch_compile,
                                       profile_top=profile_top)
                except BaseException as e:  # noqa: BLE001
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    row = Row(entry.name, precision, batch, source=entry.source,
                              status=f"failed: {error_summary(e, 300)}")
                    if os.environ.get("ZOO_TRACEBACK"):
                        traceback.print_exc()
                finally:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                rows.append(row)
                log(f"{entry.name} {precision} b{batch}: {row.status} (rel L2 {row.rel_l2}, kiln {row.kiln_ms} ms, "
                    f"compile {row.compile_ms}, eager {row.eager_ms}, build {row.build_s} s; "
                    f"{time.perf_counter() - t0:.1f} s)")


def _fmt(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v or v in (float("inf"),):
            return str(v)
        if v == 0:
            return "0"
        return f"{v:.2e}" if abs(v) < 1e-2 else f"{v:.{digits}f}"
    return str(v)


def table(rows: list[Row]) -> str:
    head = ("| model | precision | batch | Kiln ms | torch.compile ms | eager ms | ratio | rel L2 vs FP32 ref | "
            "torch's own rel L2 | top-1 agree | build s | CUDA graph | status |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r.model} | {r.precision} | {r.batch} | {_fmt(r.kiln_ms)} | {_fmt(r.compile_ms)} | {_fmt(r.eager_ms)} | "
        f"{_fmt(r.ratio)} | {_fmt(r.rel_l2)} | {_fmt(r.torch_rel_l2)} | {_fmt(r.top1)} | {_fmt(r.build_s, 1)} | "
        f"{(r.cuda_graph or '-').replace('|', '/')} | {r.status.replace('|', '/')} |\n" for r in rows)


def summary(rows: list[Row]) -> str:
    lines = []
    for p in dict.fromkeys(r.precision for r in rows):
        mine = [r for r in rows if r.precision == p and not r.status.startswith("skipped")]
        ok = sum(r.status.startswith("ok") for r in mine)
        ratios = [r.ratio for r in mine if r.ratio and r.status.startswith("ok")]
        geo = float(np.exp(np.mean(np.log(ratios)))) if ratios else None
        lines.append(f"- {p}: {ok} of {len(mine)} cases built and matched"
                     + (f"; geometric mean ratio {geo:.2f} over {len(ratios)}" if geo else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--precisions", default="fp32")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    ap.add_argument("--size", default="real", choices=("real", "tiny"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--case-timeout", type=float, default=300.0)
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds for the whole zoo (0: none)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print each timed case's N slowest layers (run layer by layer)")
    ap.add_argument("--shard", default="", help="I/N: every Nth model from the Ith (parallel runs)")
    ap.add_argument("--exclude-tactics", default="", help="comma-separated tactic name patterns no build may use")
    ap.add_argument("--skip-passes", default="", help="comma-separated fusion passes no build runs (kiln build "
                    "--skipPasses)")
    ap.add_argument("--timing-cache", default="", help="a timing cache file every build reads and writes")
    a = ap.parse_args(argv)
    global EXCLUDE_TACTICS, SKIP_PASSES, TIMING_CACHE
    EXCLUDE_TACTICS = tuple(p.strip() for p in a.exclude_tactics.split(",") if p.strip())
    SKIP_PASSES = tuple(p.strip() for p in a.skip_passes.split(",") if p.strip())
    TIMING_CACHE = a.timing_cache or None
    entries = zoo_models.by_name(a.models.split(",")) if a.models else list(zoo_models.ZOO)
    if a.shard:
        i, n = (int(v) for v in a.shard.split("/"))
        entries = entries[i::n]
    precisions = [p.strip() for p in a.precisions.split(",") if p.strip()]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise SystemExit(f"unknown precision(s) {bad}; choose from {sorted(PRECISIONS)}")
    batches = [int(b) for b in a.batches.split(",")]
    os.makedirs(a.out, exist_ok=True)
    device = a.device
    gpu = (torch.cuda.get_device_name(0) if torch.cuda.is_available() and device != "cpu"
           else f"the CPU ({platform.machine()}, {os.cpu_count()} CPUs)")
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python bench/zoo.py " + " ".join(sys.argv[1:] if argv is None else argv)
    def write(rows) -> str:
        text = (f"# Kiln model zoo\n\n{started} on {gpu}; torch {torch.__version__}; command: `{command}`\n\n"
                f"{summary(rows)}\n\n{table(rows)}")
        with open(os.path.join(a.out, "zoo.md"), "w") as f:
            f.write(text)
        with open(os.path.join(a.out, "zoo.json"), "w") as f:
            json.dump({"date": started, "device": gpu, "torch": torch.__version__, "command": command,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
        return text

    from kiln.progress import terminal_progress

    # A bar of finished cases on a terminal's stderr; the per-case lines and the table stay on stdout.
    with terminal_progress("zoo", len(entries) * len(batches) * len(precisions), "cases") as bar:
        def on_row(rows) -> None:
            r = rows[-1]
            bar.advance(f"{r.model} {r.precision} b{r.batch}: {r.status.split(':')[0]}")
            write(rows)

        rows = run(entries, precisions, batches, device, a.size, not a.no_timing, not a.no_torch_compile,
                   a.case_timeout, a.time_limit, log=lambda s: print(s, flush=True), on_row=on_row,
                   profile_top=a.profile)
    print(write(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
