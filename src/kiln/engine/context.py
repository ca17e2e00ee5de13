"""ExecutionContext: runs an engine on inputs, one CUDA graph per input shape.

On a GPU the first run at a new input shape is eager: it computes the shape
arithmetic (host nodes) on the CPU and uploads what the device needs. Then the
device work is captured once as a CUDA graph; later runs at that shape copy the
inputs into the graph's static buffers and replay it, with no Python per layer.

Device inputs fed again from the same addresses (a serving loop's reused buffers) get a
graph of their own that reads them where they are, as TensorRT's bound tensor addresses do:
the call makes no input copy, a host and a device cost that matters at batch 1
(docs/design/small-kernels.md). Up to BOUND_GRAPHS per shape, sharing the copying graph's
memory pool.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import ChainMap
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InputError, ShapeError, summary
from ..ir import dtypes
from ..ir.dtypes import FLOAT_TYPES
from ..ir.graph import reads
from ..ops.registry import lookup
from . import streams
from .interpreter import call_node, cast_input, casts, compute_type, run_node

BOUND_GRAPHS = 4  # address-bound graphs per input shape; inputs at other addresses are copied


def _dtype_text(dtype: torch.dtype) -> str:
    """The dtype's name, also for dtypes no engine takes (complex, bool tensors from another library)."""
    try:
        return dtypes.name_of(dtype)
    except KeyError:
        return str(dtype).removeprefix("torch.")


class NonFiniteInputWarning(UserWarning):
    pass


class CaptureFallbackWarning(UserWarning):
    pass


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: dict[str, torch.Tensor]
    outputs: list[torch.Tensor]
    pool_bytes: int
    # Device copies of host values the graph reads: they must live as long as the graph.
    uploads: dict  # name (or (name, dtype) for a cast copy) -> device tensor
    # Graphs reading the caller's own input buffers, by their addresses (None: that capture failed), and
    # how often other addresses were seen: a second sighting gets its graph.
    bound: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)


@dataclass
class _Stats:
    peak_activation_bytes: int = 0
    pool_bytes: dict = field(default_factory=dict)


def _liveness(graph, keep: set[str]) -> dict[int, list[str]]:
    """Values to drop after node i (their last reader), except `keep`."""
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for name in reads(node):  # including values read inside If/Loop/Scan bodies
            last[name] = i
        for name in node.outputs:
            if name:
                last.setdefault(name, i)
    free: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            free.setdefault(i, []).append(name)
    return free


class ExecutionContext:
    def __init__(self, engine, profile: int = 0, cuda_graphs: bool | None = None):
        self.engine = engine
        self.device = engine.target.device
        self._weights = engine.weights_on_target()
        self._entries = [lookup(n.op_type, n.domain) for n in engine.graph.nodes]
        keep = set(self._weights) | {v.name for v in engine.inputs} | {v.name for v in engine.outputs}
        # Host values are computed once per input shape and reused by the captured graph.
        keep |= {o for n in engine.graph.nodes if n.placement == "host" for o in n.outputs}
        self._free_after = _liveness(engine.graph, keep)
        use_graphs = engine.build_config.get("cuda_graphs", True) if cuda_graphs is None else cuda_graphs
        self.uses_cuda_graphs = bool(use_graphs and engine.capturable and self.device.type == "cuda")
        # Layers captured on an auxiliary stream, beside the main chain (engine/streams.py).
        aux = engine.build_config.get("max_aux_streams", 0) and self.uses_cuda_graphs
        self._branches = streams.plan(engine.graph) if aux else {}
        self._forks = {x for b in self._branches.values() for x in b.after}
        self._aux = torch.cuda.Stream(self.device) if self._branches else None
        self._captured: dict[tuple, _Captured | None] = {}
        self.capture_failures: list[str] = []
        self._weight_uploads: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, tuple] = {}
        self._input_names = [v.name for v in engine.inputs]
        self._output_names = [v.name for v in engine.outputs]
        self._checked: set[tuple] = set()  # signatures of device feeds already checked: the replay's fast path
        self.stats = _Stats()
        self.set_optimization_profile(profile)

    # --- profiles and shapes --------------------------------------------------
    def set_optimization_profile(self, index: int) -> None:
        n = self.engine.num_optimization_profiles
        if not 0 <= index < n:
            raise ShapeError(f"optimization profile {index} does not exist; this engine has {n} (0..{n - 1}).")
        self.profile = index
        self._checked.clear()  # shapes were checked against the old profile's ranges

    def set_input_shape(self, name: str, shape) -> None:
        self.check_shape(name, tuple(shape))
        self._shapes[name] = tuple(shape)

    def check_shape(self, name: str, shape: tuple) -> None:
        binding = next((v for v in self.engine.inputs if v.name == name), None)
        if binding is None:
            raise InputError(f"'{name}' is not an input of this engine; "
                             f"its inputs are {[v.name for v in self.engine.inputs]}.")
        lo, _, hi = self.engine.get_profile_shape(self.profile, name)
        if len(shape) != len(lo):
            raise ShapeError(
                f"input '{name}' has rank {len(shape)} (shape {list(shape)}) but the engine expects rank "
                f"{len(lo)} (profile {self.profile}: min {list(lo)}, max {list(hi)})."
            )
        for axis, (d, a, b) in enumerate(zip(shape, lo, hi)):
            if not a <= d <= b:
                if a == b:
                    raise ShapeError(
                        f"input '{name}' axis {axis} is {d}, but the engine was built for exactly {a} there "
                        f"(profile {self.profile}); rebuild with a profile that covers {d}."
                    )
                raise ShapeError(
                    f"input '{name}' axis {axis} is {d}, outside optimization profile {self.profile}'s range "
                    f"[{a}, {b}]; choose another profile or rebuild with --minShapes/--maxShapes covering {d}."
                )

    # --- running --------------------------------------------------------------
    def _normalize(self, feeds) -> tuple[dict[str, torch.Tensor], bool]:
        names = self._input_names
        if not isinstance(feeds, dict):  # a list in input order, or one tensor
            feeds = list(feeds) if isinstance(feeds, (list, tuple)) else [feeds]
            if len(feeds) != len(names):
                raise InputError(f"the engine takes {len(names)} inputs {names}, but {len(feeds)} were given.")
            feeds = dict(zip(names, feeds))
        # At batch 1 the device waits for these checks: repeat signatures of device feeds skip them.
        sig = tuple((k, x.dtype, x.shape, x.device) if type(x) is torch.Tensor else None for k, x in feeds.items())
        if sig in self._checked:
            return feeds, False
        unknown = [k for k in feeds if k not in names]
        if unknown:
            raise InputError(f"unknown input(s) {unknown}; this engine's inputs are {names}.")
        missing = [k for k in names if k not in feeds]
        if missing:
            raise InputError(f"missing input(s) {missing}; this engine's inputs are {names}.")
        as_numpy = False
        out = {}
        for v in self.engine.inputs:
            x = feeds[v.name]
            if isinstance(x, np.ndarray) or np.isscalar(x):
                as_numpy = True
                x = np.asarray(x)
                if x.dtype.kind in "OUS":
                    raise InputError(f"input '{v.name}' holds {x.dtype} values; "
                                     f"the engine expects {dtypes.name_of(v.dtype)}.")
                x = dtypes.to_torch(x)
            elif not isinstance(x, torch.Tensor):
                raise InputError(f"input '{v.name}' is a {type(x).__name__}; pass a torch tensor or a numpy array.")
            if v.dtype is not None and x.dtype != v.dtype:
                raise InputError(
                    f"input '{v.name}' is {_dtype_text(x.dtype)} but the engine expects "
                    f"{dtypes.name_of(v.dtype)}; convert it before running."
                )
            self.check_shape(v.name, tuple(x.shape))
            if x.device.type == "cpu" and x.dtype in FLOAT_TYPES and x.numel() and not torch.isfinite(x).all():
                warnings.warn(f"input '{v.name}' contains NaN or Inf values; outputs will likely be NaN.",
                              NonFiniteInputWarning, stacklevel=3)
            out[v.name] = x
        if list(feeds) == names and all(type(x) is torch.Tensor and x.device.type != "cpu" for x in feeds.values()):
            self._checked.add(sig)  # device tensors: no value check (NaN warning) is skipped by the fast path
        return out, as_numpy

    def run(self, feeds, copy_outputs: bool = True):
        """Run the engine. feeds: dict name -> tensor/array, or a list in input order.
        Returns a dict name -> output (numpy if the inputs were numpy). copy_outputs=False returns the
        engine's own output buffers: the next run may overwrite them."""
        inputs, as_numpy = self._normalize(feeds)
        outs = self._replay(inputs) if self.uses_cuda_graphs else self._eager(inputs)
        if copy_outputs or as_numpy:
            outs = [_copied(t) for t in outs]
        result = dict(zip(self._output_names, outs))
        if as_numpy:  # a sequence output (ops/sequence.py) comes back as a list of arrays, an empty optional as None
            return {k: _as_numpy(t) for k, t in result.items()}
        return result

    __call__ = run

    def _numerics(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        tf32 = self.engine.build_config.get("tf32", False)
        return _tf32(tf32)

    def run_layerwise(self, feeds, observer) -> dict:
        """Run eagerly (no CUDA graph), calling observer(node, outputs) after every device layer
        and observer(node, None) just before it. Used by layer-wise compare and per-layer profiling."""
        inputs, _ = self._normalize(feeds)
        return dict(zip(self._output_names, self._eager(inputs, observer)))

    def run_with_inputs_hook(self, feeds, on_args) -> dict:
        """Eager run calling on_args(node, args) with each device layer's actual inputs (tactic timing)."""
        inputs, _ = self._normalize(feeds)
        return dict(zip(self._output_names, self._eager(inputs, on_args=on_args)))

    def _eager(self, inputs: dict[str, torch.Tensor], observer=None, on_args=None) -> list[torch.Tensor]:
        env = dict(self._weights)
        env.update({k: x.to(self.device) for k, x in inputs.items()})
        uploads = self._uploads()
        with self._numerics():
            self._forward(env, uploads, run_host=True, observer=observer, on_args=on_args)
        outs = self._collect(env, uploads)
        self._keep_weight_uploads(uploads)
        return outs

    def _uploads(self) -> dict[str, torch.Tensor]:
        """Device copies of host values for one run: weights' copies are reused, shape-dependent ones are not."""
        return dict(self._weight_uploads)

    def _keep_weight_uploads(self, uploads: dict) -> None:
        self._weight_uploads.update({k: t for k, t in uploads.items() if (k[0] if isinstance(k, tuple) else k)
                                     in self._weights})

    def _forward(self, env: dict, uploads: dict, run_host: bool, observer=None, on_args=None, aux=False) -> None:
        """Run the layers in order; aux (only while capturing): branch layers on the auxiliary stream."""
        dev = self.device
        live = peak = 0
        aux = aux and bool(self._branches)
        main, start, ready, joins = None, None, {}, {}
        if aux:
            main = torch.cuda.current_stream(dev)
            start = torch.cuda.Event()  # the auxiliary stream joins the capture after this point
            start.record(main)
        for i, (node, entry) in enumerate(zip(self.engine.graph.nodes, self._entries)):
            if node.placement == "host":
                if run_host:
                    run_node(node, env)
                continue
            args = [env[name] if name else None for name in node.inputs]
            host = [pos for pos, t in enumerate(args)
                    if isinstance(t, torch.Tensor) and t.device != dev and pos not in entry.host_inputs]
            if host:
                # Host values (weights, per-shape constants) reach the device in the layer's precision:
                # cast once on upload, not by a kernel in every replay.
                want = compute_type(node, entry)
                for pos in host:
                    name, t = node.inputs[pos], args[pos]
                    key = (name, want) if casts(entry, pos, t, want) else name
                    if key not in uploads:
                        uploads[key] = cast_input(entry, pos, t, want).to(dev)
                    args[pos] = uploads[key]
            if on_args:
                on_args(node, args)
            if observer:
                observer(node, None)
            scope = env
            if entry.uses_scope and dev.type != "cpu":  # bodies read enclosing values: give them device copies
                body = {n: env[n] for n in reads(node) if n in env and isinstance(env[n], torch.Tensor)
                        and env[n].device != dev}
                scope = ChainMap({n: t.to(dev) for n, t in body.items()}, env) if body else env
            branch = self._branches.get(i) if aux else None
            if branch:
                outs = self._on_aux_stream(node, args, scope, branch, ready, start, joins)
            else:
                for done in joins.pop(i, ()):
                    main.wait_event(done)
                outs = call_node(node, args, scope, node.tactic_for(self.profile))
            for name in self._forks.intersection(node.outputs) if aux else ():
                ready[name] = torch.cuda.Event()
                ready[name].record(main)
            if observer:
                observer(node, outs)
            for name, t in zip(node.outputs, outs):
                if name:
                    env[name] = t
                    if isinstance(t, torch.Tensor):
                        live += t.numel() * t.element_size()
            peak = max(peak, live)
            for name in self._free_after.get(i, ()):
                t = env.pop(name, None)
                if isinstance(t, torch.Tensor) and t.device == dev and name not in uploads:
                    live -= t.numel() * t.element_size()
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, peak)

    def _on_aux_stream(self, node, args, scope, branch, ready, start, joins):
        """Run one branch layer on the auxiliary stream: it waits only for its inputs' producers, and its
        reader (branch.join) will wait for it."""
        main, side = torch.cuda.current_stream(self.device), self._aux
        side.wait_event(start)
        for name in branch.after:
            side.wait_event(ready[name])
        with torch.cuda.stream(side):
            outs = call_node(node, args, scope, node.tactic_for(self.profile))
        # Memory freed on one stream must not be reused while the other still reads it.
        for t in args:
            if isinstance(t, torch.Tensor) and t.device == self.device:
                t.record_stream(side)
        for t in outs:
            if isinstance(t, torch.Tensor):
                t.record_stream(main)
        done = torch.cuda.Event()
        done.record(side)
        joins.setdefault(branch.join, []).append(done)
        return outs

    def _collect(self, env: dict, uploads: dict) -> list[torch.Tensor]:
        outs = []
        for v in self.engine.outputs:
            t = env[v.name]
            if t is None:  # an empty optional output (ops/optional.py)
                outs.append(None)
                continue
            if isinstance(t, list):  # a sequence output: a list of tensors on the device, in the model's type
                keep = v.dtype in FLOAT_TYPES
                outs.append([x.to(self.device, v.dtype if keep and x.dtype in FLOAT_TYPES else x.dtype) for x in t])
                continue
            if t.device != self.device:  # a host value as an output: uploaded once (by the warm-up, not in a capture)
                if v.name not in uploads:
                    uploads[v.name] = t.to(self.device)
                t = uploads[v.name]
            if v.dtype is not None and t.dtype != v.dtype and t.dtype in FLOAT_TYPES and v.dtype in FLOAT_TYPES:
                t = t.to(v.dtype)  # FP16/BF16 engines keep the model's output types
            outs.append(t)
        return outs

    def _replay(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        key = (self.profile, tuple(tuple(x.shape) for x in inputs.values()))
        if key not in self._captured:
            self._captured[key] = self._capture_or_fallback(inputs)
        cap = self._captured[key]
        if cap is None:  # this shape could not be captured: layer by layer
            return self._eager(inputs)
        addresses = tuple(x.data_ptr() for x in inputs.values())
        bound = cap.bound.get(addresses) or self._bind(cap, inputs, addresses)
        if bound is not None:
            bound.graph.replay()
            return bound.outputs
        for name, x in inputs.items():
            cap.inputs[name].copy_(x, non_blocking=True)
        cap.graph.replay()
        return cap.outputs

    def _bind(self, cap: _Captured, inputs: dict[str, torch.Tensor], addresses: tuple) -> _Captured | None:
        """The graph reading these inputs where they are, captured when their addresses come back (None
        until then, or when they cannot be bound: host or strided tensors, BOUND_GRAPHS already taken)."""
        if addresses in cap.bound or len(cap.bound) >= BOUND_GRAPHS or not all(
                x.device == self.device and x.is_contiguous() for x in inputs.values()):
            return None
        if len(cap.seen) > 64:  # addresses that never came back
            cap.seen.clear()
        cap.seen[addresses] = cap.seen.get(addresses, 0) + 1
        if cap.seen[addresses] < 2:
            return None
        try:
            with self._numerics():
                cap.bound[addresses] = self._capture(inputs, bind=True, pool=cap.graph.pool())
        except Exception as e:  # the copying graph still serves these inputs
            torch.cuda.synchronize(self.device)
            self.capture_failures.append(summary(e, 300))
            cap.bound[addresses] = None
        return cap.bound[addresses]

    def _capture_or_fallback(self, inputs: dict[str, torch.Tensor]) -> _Captured | None:
        """Fallback instead of failure: a layer that cannot be captured (it copies from host memory,
        say) makes this shape run layer by layer, with a warning naming the layer."""
        try:
            with self._numerics():  # kernels are chosen at capture; a replay needs no settings
                return self._capture(inputs)
        except Exception as e:
            torch.cuda.synchronize(self.device)
            warnings.warn(f"CUDA graph capture failed ({summary(e, 300)}); this input shape "
                          "runs layer by layer instead (slower at small batch).", CaptureFallbackWarning)
            self.capture_failures.append(summary(e, 300))
            return None

    def _capture(self, inputs: dict[str, torch.Tensor], bind: bool = False, pool=None) -> _Captured:
        """bind: the graph reads `inputs` themselves, not static copies of them; pool: a graph's memory pool
        to share (graphs of one context never run at the same time)."""
        if bind:  # kept in _Captured.inputs: the caller's buffers stay alive, so their addresses stay theirs
            static = dict(inputs)
        else:
            static = {k: torch.empty(x.shape, dtype=x.dtype, device=self.device) for k, x in inputs.items()}
            for k, x in inputs.items():
                static[k].copy_(x)
        uploads = self._uploads()
        env = dict(self._weights)
        env.update(static)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(env, uploads, run_host=True)  # warm-up: host values, uploads, library handles
            self._collect(env, uploads)
        torch.cuda.current_stream(self.device).wait_stream(side)
        host = {o: env[o] for n in self.engine.graph.nodes if n.placement == "host" for o in n.outputs if o}
        env = dict(self._weights)
        env.update(static)
        env.update(host)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.empty_cache()  # torch.cuda.graph empties the cache too; measuring before that would undercount
        before = torch.cuda.memory_reserved(self.device)
        # Captured on the warm-up's stream, so the per-stream workspaces it allocated (kernels/workspace.py) serve
        with torch.cuda.graph(graph, pool=pool, stream=side):
            self._forward(env, uploads, run_host=False, aux=True)
            outs = self._collect(env, uploads)
        pool_bytes = torch.cuda.memory_reserved(self.device) - before
        if not bind:  # a bound graph's share of the pool is counted with the copying graph's
            self.stats.pool_bytes[str(list(inputs.values())[0].shape if inputs else ())] = pool_bytes
        self._keep_weight_uploads(uploads)
        return _Captured(graph, static, outs, pool_bytes, uploads)


def _copied(t):
    """An output's own copy: a tensor's clone, each tensor of a sequence cloned, an empty optional as it is."""
    return [x.clone() for x in t] if isinstance(t, list) else None if t is None else t.clone()


def _as_numpy(t):
    return [dtypes.to_numpy(x) for x in t] if isinstance(t, list) else None if t is None else dtypes.to_numpy(t)


@contextlib.contextmanager
def _tf32(enabled: bool):
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
