"""`kiln bench ENGINE`: trtexec-style timing, with PyTorch peers in the same run.

    kiln bench model.kiln --iterations=200 --baseline eager,compile --torch mypkg.models:make_model --dumpProfile

Timing (tools/timing.py): warm-up, then at least --iterations runs and
--duration seconds; Throughput, Latency min/max/mean/median/p90/p95/p99, Enqueue
Time, GPU Compute Time (CUDA events) and, with --h2d, the host-to-device and
device-to-host copies. Inputs rotate among four random sets (or --loadInputs).

--baseline eager,compile runs the same inputs through the PyTorch module from
--torch MODULE:FACTORY (a callable returning an nn.Module): eager FP32 (plus the
engine's FP16/BF16, and channels_last for 4-D inputs on a GPU), and
torch.compile in modes max-autotune-no-cudagraphs and reduce-overhead at the
engine's precision. A mode that crashes or times out is reported as failed.
Ratios are the peer's median latency over the engine's.

--dumpProfile times every layer (the engine run layer by layer, without the
CUDA graph, so the sum exceeds the graph's time) and gives each layer's share.
--exportTimes / --exportProfile / --exportJson write JSON (trtexec's shapes for
the first two).
"""

from __future__ import annotations

import argparse
import copy
import signal
import statistics
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from ..console import console, device_note
from ..errors import ConfigError
from ..ir import dtypes
from ..ir.shapes import fmt_shape
from ..json_file import atomic_write_json
from ..samples import check_feeds_in_profile, load_samples, random_feeds
from .compare import layer_name
from .engine_args import (
    add_verify_key_flag,
    load_engine,
    parse_shapes_arg,
    verify_key_of,
)
from .timing import Timings, time_fn
from .timing import render as render_timings
from .user_code import load_torch_module

COMPILE_MODES = ("max-autotune-no-cudagraphs", "reduce-overhead")
BASELINES = ("eager", "compile")
_LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PeerResult:
    name: str
    ok: bool
    timings: dict | None = None
    error: str = ""
    speedup: float | None = None  # peer median latency / engine median latency (>1: Kiln is faster)
    setup_s: float | None = None  # e.g. torch.compile's compile time


@dataclass
class LayerTime:
    index: int
    name: str
    op_type: str
    precision: str
    tactic: str
    count: int
    total_ms: float
    mean_ms: float
    median_ms: float
    share: float  # percent of the summed layer time


@dataclass
class BenchResult:
    target: str
    device_note: str
    precision: str
    shapes: dict
    batch: int
    mode: str  # "CUDA graph replay" or "layer by layer"
    timings: Timings
    peers: list[PeerResult] = field(default_factory=list)
    layers: list[LayerTime] = field(default_factory=list)
    profile_iterations: int = 0

    def to_json(self) -> dict:
        return {
            "target": self.target, "device_note": self.device_note, "precision": self.precision,
            "shapes": self.shapes, "batch": self.batch, "mode": self.mode,
            "engine": self.timings.to_json(), "peers": [asdict(p) for p in self.peers],
            "layers": [asdict(x) for x in self.layers], "profile_iterations": self.profile_iterations,
        }

    def export_profile(self) -> list[dict]:
        """trtexec's --exportProfile shape:
        [{"count": N}, {"name", "timeMs", "averageMs", "medianMs", "percentage"}]."""
        return [{"count": self.profile_iterations}] + [
            {"name": x.name, "timeMs": x.total_ms, "averageMs": x.mean_ms, "medianMs": x.median_ms,
             "percentage": x.share, "layerType": x.op_type, "precision": x.precision, "tactic": x.tactic}
            for x in self.layers]


# --- inputs ----------------------------------------------------------------------------------------------


def input_sets_for(engine, profile: int = 0, shapes: dict | None = None, samples: list[dict] | None = None,
                   count: int = 4) -> list[dict[str, torch.Tensor]]:
    """Torch input sets (CPU): the given samples, or `count` seeded random sets at opt/`shapes`."""
    raw = samples or [random_feeds(engine, profile, seed, shapes) for seed in range(count)]
    sets = []
    for s in raw:
        sets.append({k: (x if isinstance(x, torch.Tensor) else dtypes.to_torch(x)) for k, x in s.items()})
    for i, s in enumerate(sets):
        check_feeds_in_profile(engine, s, profile, f"input set {i}")
    return sets


def _to(sets, device):
    return [{k: x.to(device) for k, x in s.items()} for s in sets]


# --- per-layer profile ---------------------------------------------------------------------------------


def layer_profile(engine, feeds: dict, profile: int = 0, iterations: int = 10) -> list[LayerTime]:
    """Time every device layer (run_layerwise: eager, one layer at a time) over `iterations` runs."""
    ctx = engine.create_execution_context(profile=profile, cuda_graphs=False)
    dev = ctx.device
    cuda = dev.type == "cuda"
    feeds = {k: x.to(dev) if isinstance(x, torch.Tensor) else x for k, x in feeds.items()}
    nodes: dict[int, object] = {}
    samples: dict[int, list[float]] = {}
    pending: list[tuple[int, object, object]] = []
    state: dict = {}

    def observer(node, outs):
        key = id(node)
        if outs is None:
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                state[key] = e
            else:
                state[key] = time.perf_counter()
            return
        nodes[key] = node
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            pending.append((key, state.pop(key), e))
        else:
            samples.setdefault(key, []).append((time.perf_counter() - state.pop(key)) * 1000)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx.run_layerwise(feeds, lambda n, o: None)  # warm-up
        if cuda:
            torch.cuda.synchronize(dev)
        for _ in range(max(iterations, 1)):
            ctx.run_layerwise(feeds, observer)
            if cuda:
                torch.cuda.synchronize(dev)
                for key, a, b in pending:
                    samples.setdefault(key, []).append(a.elapsed_time(b))
                pending.clear()
    order = {id(n): i for i, n in enumerate(engine.graph.nodes)}
    total = sum(sum(v) for v in samples.values()) or 1.0
    rows = []
    for key, ts in samples.items():
        n = nodes[key]
        rows.append(LayerTime(index=order.get(key, -1), name=layer_name(n), op_type=n.op_type, precision=n.precision,
                              tactic=n.tactic, count=len(ts), total_ms=sum(ts), mean_ms=statistics.fmean(ts),
                              median_ms=statistics.median(ts), share=100.0 * sum(ts) / total))
    rows.sort(key=lambda r: r.index)
    return rows


# --- PyTorch peers ------------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _with_timeout(seconds: float, fn):
    """fn() with a wall-clock limit (SIGALRM: main thread on POSIX only; elsewhere no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        return fn()

    def handler(signum, frame):
        raise _Timeout(f"timed out after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _call_module(module, names):
    def fn(feeds):
        return module(*[feeds[n] for n in names])

    return fn


def _peer_variants(module, engine, device, baselines, compile_modes):
    """(name, make_fn, input dtype, channels_last) for each requested peer."""
    prec = engine.precision
    low = _LOW.get(prec)
    out = []
    if "eager" in baselines:
        out.append(("PyTorch eager (float32)", "eager", torch.float32, False, None))
        if low is not None:
            out.append((f"PyTorch eager ({prec})", "eager", low, False, None))
        if device.type == "cuda" and any(len(v.shape or ()) == 4 for v in engine.inputs):
            out.append((f"PyTorch eager channels_last ({prec if low else 'float32'})", "eager",
                        low or torch.float32, True, None))
    if "compile" in baselines:
        for mode in compile_modes:
            out.append((f"torch.compile {mode} ({prec if low else 'float32'})", "compile", low or torch.float32,
                        False, mode))
    return out


def run_peers(module: torch.nn.Module, engine, input_sets: list[dict], engine_timings: Timings, *,
              baselines=BASELINES, compile_modes=COMPILE_MODES, compile_timeout: float = 600.0,
              iterations: int = 100, warmup_ms: float = 200.0, duration_s: float = 0.0, h2d: bool = False,
              on_peer=None) -> list[PeerResult]:
    device = engine.target.device
    names = [v.name for v in engine.inputs]
    ref_median = statistics.median(engine_timings.latency_ms)
    results = []
    for name, kind, dtype, channels_last, mode in _peer_variants(module, engine, device, baselines, compile_modes):
        if on_peer:
            on_peer(name)
        res = PeerResult(name=name, ok=False)
        try:
            m = copy.deepcopy(module).eval().to(device)
            if dtype != torch.float32:
                m = m.to(dtype)
            sets = [{k: (x.to(dtype) if x.is_floating_point() else x) for k, x in s.items()} for s in input_sets]
            if channels_last:
                m = m.to(memory_format=torch.channels_last)
                sets = [{k: (x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x)
                         for k, x in s.items()} for s in sets]
            if not h2d:
                sets = _to(sets, device)
            fn = _call_module(m, names)
            if kind == "compile":
                torch._dynamo.reset()
                compiled = torch.compile(m, mode=mode)
                fn = _call_module(compiled, names)
                first = sets[0] if not h2d else {k: x.to(device) for k, x in sets[0].items()}
                t0 = time.perf_counter()
                with torch.inference_mode(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the compiler's own deprecation chatter
                    _with_timeout(compile_timeout, lambda: (fn(first), _sync(device)))
                res.setup_s = time.perf_counter() - t0
            with torch.inference_mode():
                t = time_fn(fn, sets, device, iterations=iterations, warmup_ms=warmup_ms, duration_s=duration_s,
                            h2d=h2d)
            res.ok = True
            res.timings = t.to_json()
            res.speedup = statistics.median(t.latency_ms) / ref_median if ref_median else None
        except (Exception, _Timeout) as e:  # a crashing peer is a result, not an error of ours
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            res.error = f"{type(e).__name__}: {msg}"[:300]
        finally:
            if kind == "compile":
                try:
                    torch._dynamo.reset()
                except Exception:
                    pass
        results.append(res)
    return results


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the benchmark -----------------------------------------------------------------------------------------


def bench(engine, *, samples: list[dict] | None = None, profile: int = 0, shapes: dict | None = None,
          iterations: int = 100, warmup_ms: float = 200.0, duration_s: float = 0.0, h2d: bool = False,
          cuda_graphs: bool | None = None, torch_module: torch.nn.Module | None = None, baselines=(),
          compile_modes=COMPILE_MODES, compile_timeout: float = 600.0, dump_profile: bool = False,
          profile_iterations: int = 10, device: str = "auto", on_step=None) -> BenchResult:
    """Time an engine (Engine or .kiln path), optionally its PyTorch peers and its layers."""
    engine = load_engine(engine, device)
    baselines = tuple(baselines or ())
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ConfigError(f"--baseline: {unknown} unknown; choose from {list(BASELINES)} "
                          "(e.g. --baseline eager,compile).")
    if baselines and torch_module is None:
        raise ConfigError("--baseline needs the PyTorch model: pass --torch MODULE:FACTORY (a callable returning the "
                          "nn.Module the engine was built from).")
    if iterations < 1:
        raise ConfigError("--iterations must be at least 1.")
    step = on_step or (lambda msg: None)
    sets = input_sets_for(engine, profile, shapes, samples)
    dev = engine.target.device
    ctx = engine.create_execution_context(profile=profile, cuda_graphs=cuda_graphs)
    run_sets = sets if h2d and dev.type == "cuda" else _to(sets, dev)  # with --h2d, time_fn uploads each run
    ctx.run(_to(sets[:1], dev)[0])  # input checks up front
    step("timing the engine")
    t = time_fn(lambda f: ctx.run(f, copy_outputs=False), run_sets, dev, iterations=iterations,
                warmup_ms=warmup_ms, duration_s=duration_s, h2d=h2d)
    first = next(iter(sets[0].values())) if sets[0] else torch.zeros(1)
    t.batch = int(first.shape[0]) if first.dim() else 1
    res = BenchResult(target=engine.target.describe(), device_note=device_note(engine.target),
                      precision=engine.precision, shapes={k: list(x.shape) for k, x in sets[0].items()},
                      batch=t.batch, mode="CUDA graph replay" if ctx.uses_cuda_graphs else "layer by layer",
                      timings=t)
    if baselines:
        res.peers = run_peers(torch_module, engine, sets, t, baselines=baselines, compile_modes=compile_modes,
                              compile_timeout=compile_timeout, iterations=iterations, warmup_ms=warmup_ms,
                              duration_s=duration_s, h2d=h2d, on_peer=lambda n: step(f"timing {n}"))
    if dump_profile:
        step("per-layer profile")
        res.layers = layer_profile(engine, sets[0], profile, profile_iterations)
        res.profile_iterations = profile_iterations
    return res


def _speedup(x: float | None) -> str:
    if x is None:
        return "speedup n/a"
    return f"Kiln {x:.2f}x faster" if x >= 1 else f"Kiln {1 / x:.2f}x slower"


def _ms(s: dict | None, key="median") -> str:
    return f"{s[key]:.4f} ms" if s else "-"


def render(res: BenchResult, con) -> None:
    shape_text = ", ".join(f"{k}: {fmt_shape(v)}" for k, v in res.shapes.items())
    con.print(f"Engine on {res.target} with {shape_text} ({res.mode}), precision {res.precision}")
    if not res.timings.gpu_ms:
        con.print(f"Note: {res.device_note}.")
    render_timings(res.timings, con)
    if not res.timings.h2d_ms and res.target.startswith("CPU"):
        con.print("H2D/D2H Latency: n/a (CPU target: inputs already in host memory)")
    if res.peers:
        j = res.timings.to_json()
        con.print("=== Peers (same inputs, same run; speedup = peer median latency / Kiln median latency) ===")
        width = max(len(p.name) for p in res.peers) + 2
        con.print(f"{'Kiln engine (' + res.precision + ')':<{width}} median {_ms(j['latency_ms'])}, "
                  f"p99 {_ms(j['latency_ms'], 'p99')}")
        for p in res.peers:
            if p.ok:
                extra = f", compile {p.setup_s:.1f} s" if p.setup_s is not None else ""
                con.print(f"{p.name:<{width}} median {_ms(p.timings['latency_ms'])}, p99 "
                          f"{_ms(p.timings['latency_ms'], 'p99')}  ->  {_speedup(p.speedup)}{extra}")
            else:
                con.print(f"{p.name:<{width}} FAILED: {p.error}")
    if res.layers:
        con.print(f"=== Profile ({res.profile_iterations} iterations, layer by layer without the CUDA graph) ===")
        con.print(f"{'Time(ms)':>10} {'Avg.(ms)':>10} {'Median(ms)':>11} {'Time(%)':>8}   Layer")
        for x in res.layers:
            con.print(f"{x.total_ms:>10.4f} {x.mean_ms:>10.4f} {x.median_ms:>11.4f} {x.share:>8.1f}   {x.name} "
                      f"({x.op_type}, {x.precision}, {x.tactic})")
        total = sum(x.total_ms for x in res.layers)
        con.print(f"{total:>10.4f} {total / max(res.profile_iterations, 1):>10.4f} {'':>11} {100.0:>8.1f}   Total")


# --- command line --------------------------------------------------------------------------------------------


def add_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="time an engine trtexec-style, against PyTorch eager and torch.compile",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", metavar="ENGINE", help="the engine file (.kiln)")
    p.add_argument("--shapes", default="", metavar="SPEC", help="input shapes, x:8x3x224x224,... (default: opt)")
    p.add_argument("--profile", type=int, default=0, help="optimization profile")
    p.add_argument("--loadInputs", metavar="PATH",
                   help="a .npz keyed by input name, a folder of .npz, or NAME:FILE.npy")
    p.add_argument("--warmUp", type=float, default=200.0, help="warm-up time in ms (default 200)")
    p.add_argument("--iterations", type=int, default=100, help="timed runs, at least (default 100)")
    p.add_argument("--duration", type=float, default=0.0, help="time for at least this many seconds")
    p.add_argument("--h2d", action="store_true", help="inputs from host memory and outputs back: time H2D and D2H")
    p.add_argument("--noCudaGraph", action="store_true", help="run layer by layer instead of one CUDA graph")
    p.add_argument("--baseline", default="", metavar="LIST", help="peers in the same run: eager,compile")
    p.add_argument("--torch", metavar="MODULE:FACTORY", help="callable returning the PyTorch module (for --baseline)")
    p.add_argument("--compileModes", default=",".join(COMPILE_MODES), metavar="LIST",
                   help=f"torch.compile modes for --baseline compile (default {','.join(COMPILE_MODES)})")
    p.add_argument("--compileTimeout", type=float, default=600.0, metavar="S",
                   help="give up on a torch.compile mode after this many seconds (reported as failed)")
    p.add_argument("--dumpProfile", action="store_true", help="per-layer time and share of the total")
    p.add_argument("--profileIterations", type=int, default=10, help="runs for --dumpProfile (default 10)")
    p.add_argument("--exportTimes", metavar="FILE", help="per-iteration times as JSON")
    p.add_argument("--exportProfile", metavar="FILE", help="per-layer profile as JSON (implies --dumpProfile)")
    p.add_argument("--exportJson", metavar="FILE", help="the whole result as JSON")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    add_verify_key_flag(p)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    con = console()
    engine = load_engine(args.engine, args.device, verify_key=verify_key_of(args))
    shapes = parse_shapes_arg(args.shapes, engine)
    samples = load_samples(args.loadInputs, [v.name for v in engine.inputs]) if args.loadInputs else None
    baselines = [b.strip() for b in args.baseline.split(",") if b.strip()]
    module = load_torch_module(args.torch) if args.torch else None
    if args.torch and not baselines:
        baselines = list(BASELINES)
    modes = [m.strip() for m in args.compileModes.split(",") if m.strip()]
    res = bench(engine, samples=samples, profile=args.profile, shapes=shapes, iterations=args.iterations,
                warmup_ms=args.warmUp, duration_s=args.duration, h2d=args.h2d,
                cuda_graphs=False if args.noCudaGraph else None, torch_module=module, baselines=baselines,
                compile_modes=modes, compile_timeout=args.compileTimeout,
                dump_profile=args.dumpProfile or bool(args.exportProfile), profile_iterations=args.profileIterations,
                on_step=lambda m: console(stderr=True).print(f"kiln bench: {m}"))
    render(res, con)
    for path, obj in ((args.exportTimes, res.timings.export_times() if args.exportTimes else None),
                      (args.exportProfile, res.export_profile() if args.exportProfile else None),
                      (args.exportJson, res.to_json() if args.exportJson else None)):
        if path:
            atomic_write_json(path, obj)
            con.print(f"Written: {path}")
    return 0
