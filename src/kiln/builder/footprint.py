"""What an engine will allocate, estimated from its profiles and checked against the memory there is.

The build's validation run feeds every profile's opt and max shapes through the engine on its target. A
dimension of -3 or 2**40, or a profile whose tensors at max cannot fit, would otherwise end in an allocator
error deep inside that run; here it is refused naming the input, the layer and the bytes. Two checks:

- check_inputs, before anything else of the build: every dimension is 0 or more, and the weights plus the
  inputs at each profile's max fit (what calibration and the optimization passes need no less than).
- check, on the graph the engine runs (after fusion and placement, before the precision guard's and the
  validation's runs): the weights, the inputs, and the peak of the intermediate tensors live at once.

The peak comes from a liveness walk over the engine's layers in their order, each layer run on "meta"
tensors (shapes and dtypes, no data) at the profile's max shapes; a value is dropped after its last reader,
as the runtime drops it (context._liveness). A fused layer's internals (an attention's score matrix) are not
counted: the engine never holds them as tensors. Views (Reshape, Expand, Slice...) share their base's bytes.
Everything is a lower bound, so a refusal is never a false alarm: kernels' scratch memory and the copies a
layer makes of its inputs come on top, a float tensor counts at the narrowest type the build may give it,
and where a layer's output sizes depend on values (NonZero, a shape read from data, control flow) the
walk ends there. (torch's meta kernels of elementwise ops are Python references whose first call imports
torch._dynamo: the first walk in a process pays that import once.)
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field

import torch

from ..engine.profile import Profile
from ..engine.target import Target
from ..errors import ConfigError, ShapeError
from ..ir.graph import Graph
from ..ir.shapes import fmt_shape
from ..ops.registry import lookup
from ..passes.rewrite import host_values

# A host (shape-arithmetic) value larger than this is not computed for real: the walk keeps its size only.
HOST_VALUE_LIMIT = 64 * 2**20
_META, _CPU = torch.device("meta"), torch.device("cpu")


def _gib(n: int) -> str:
    """Bytes as messages show them: 20.32 GiB, 4.00 MiB, 512 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def available_bytes(target: Target) -> int | None:
    """Free memory where the build's tensors live: the GPU's free memory, else the host's available memory."""
    if target.kind == "cuda":
        try:
            return torch.cuda.mem_get_info(target.index)[0]
        except Exception:  # noqa: BLE001 - no answer: do not guess
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _where(target: Target) -> str:
    return "the GPU's free memory" if target.kind == "cuda" else "the host's available memory"


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype or torch.float32).element_size()


def float_bytes_floor(precision: str, quantized: str | None) -> int | None:
    """The fewest bytes a float element may take in an engine of this build (None: as the graph says): INT8/FP8
    builds may store activations in 1 byte, FP16/BF16 builds in 2."""
    if quantized:
        return 1
    return 2 if precision in ("float16", "bfloat16") else None


def _nbytes(t: torch.Tensor, floor: int | None) -> int:
    size = t.element_size()
    if floor is not None and t.dtype.is_floating_point:
        size = min(size, floor)
    return t.numel() * size


@dataclass
class Footprint:
    """Bytes an engine holds at once at one set of input shapes (a lower bound; see the module docstring)."""

    weights: int
    inputs: int
    activations: int  # the peak of the layers' outputs live at once (graph outputs included)
    peak_layer: str | None = None  # the layer whose outputs brought the peak
    # The largest tensors live at the peak, largest first: (value name, its shape, bytes, and for a view the
    # shape of the tensor it views, which stays allocated while any view of it lives; else None).
    largest: list = field(default_factory=list)
    layers: int = 0  # layers walked
    stopped: str | None = None  # why the walk ended before the last layer

    @property
    def total(self) -> int:
        return self.weights + self.inputs + self.activations


def weight_bytes(graph: Graph, float_bytes: int | None = None) -> int:
    return sum(_nbytes(t, float_bytes) for t in graph.initializers.values() if isinstance(t, torch.Tensor))


def _meta_inputs(graph: Graph, shapes: dict) -> dict[str, torch.Tensor]:
    return {v.name: torch.empty(tuple(shapes[v.name]), dtype=v.dtype or torch.float32, device="meta")
            for v in graph.inputs}


def estimate(graph: Graph, shapes: dict, float_bytes: int | None = None) -> Footprint:
    """The footprint of running `graph` on inputs of these shapes (name -> shape; at a profile's max for the
    check). float_bytes: float_bytes_floor of the build."""
    from ..engine.context import (
        _liveness,  # the runtime's own rule for when a value is dropped
    )

    inputs = _meta_inputs(graph, shapes)
    host = host_values(graph)
    keep = set(graph.initializers) | set(inputs) | {v.name for v in graph.outputs} | host
    free_after = _liveness(graph, keep)
    env: dict = {**graph.initializers, **inputs}
    meta_copies: dict[str, torch.Tensor] = {}  # host values as device layers read them (sizes only)
    free_roots = {id(t) for t in inputs.values()}  # views of inputs and weights cost nothing more
    owners: dict[int, list] = {}  # id of a base tensor -> [base, bytes, values viewing it]
    root_of: dict[str, int] = {}
    live = 0
    fp = Footprint(weight_bytes(graph, float_bytes), sum(_nbytes(t, float_bytes) for t in inputs.values()), 0)

    def as_meta(name: str, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        if name not in meta_copies:
            meta_copies[name] = t.to("meta")
            free_roots.add(id(meta_copies[name]))
        return meta_copies[name]

    devices = [n.device for n in graph.nodes]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, node in enumerate(graph.nodes):
                entry = lookup(node.op_type, node.domain)
                if entry.uses_scope:  # If/Loop/Scan: what their bodies hold depends on values (a trip count)
                    fp.stopped = f"layer '{node.label}' ({node.op_type}) runs a subgraph; the walk ends there"
                    break
                args = [env.get(name) if name else None for name in node.inputs]
                on_host = all(o in host for o in node.outputs if o)
                meta_args = [a if pos in entry.host_inputs else as_meta(name, a)
                             for pos, (name, a) in enumerate(zip(node.inputs, args))]
                outs, why = _outputs(node, meta_args, env)
                if on_host and (outs is None or sum(t.numel() * t.element_size() for t in outs
                                                    if isinstance(t, torch.Tensor)) <= HOST_VALUE_LIMIT):
                    # Shape arithmetic, computed for real: its values are later layers' shapes.
                    real, failed = _outputs(node, args, env, _CPU)
                    if real is not None or outs is None:
                        outs, why = real, failed
                if outs is None:
                    fp.stopped = (f"the sizes from layer '{node.label}' ({node.op_type}) on cannot be derived "
                                  f"without running it ({why})")
                    break
                fp.layers = i + 1
                for name, t in zip(node.outputs, outs):
                    if not name or not isinstance(t, torch.Tensor):
                        continue
                    env[name] = t
                    if on_host:
                        continue  # host values: computed once per shape, small (or kept as a size only)
                    root = t._base if t._base is not None else t
                    if id(root) in free_roots:
                        continue
                    owner = owners.get(id(root))
                    if owner is None:
                        owner = owners[id(root)] = [root, _nbytes(root, float_bytes), 0]
                        live += owner[1]
                    owner[2] += 1
                    root_of[name] = id(root)
                if live > fp.activations:
                    fp.activations, fp.peak_layer = live, node.label
                    fp.largest = _largest(env, root_of, owners)
                for name in free_after.get(i, ()):
                    env.pop(name, None)
                    rid = root_of.pop(name, None)
                    if rid is not None:
                        owners[rid][2] -= 1
                        if owners[rid][2] == 0:
                            live -= owners.pop(rid)[1]
    finally:
        for node, dev in zip(graph.nodes, devices):
            node.device = dev
    return fp


def _outputs(node, args: list, env: dict, device=_META) -> tuple:
    """(the node's outputs, None), or (None, why it could not run) (its reference implementation, on `device`)."""
    from ..engine.interpreter import call_node

    node.device = device
    try:
        return call_node(node, args, env, "reference"), None
    except Exception as e:  # noqa: BLE001 - whatever stops it, the walk ends at this layer
        return None, str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _largest(env: dict, root_of: dict, owners: dict, n: int = 2) -> list:
    """The n largest tensors live now, each named once (by one value reading it): Footprint.largest's rows."""
    seen, rows = set(), []
    for name, rid in root_of.items():
        if rid not in seen:
            seen.add(rid)
            base = owners[rid][0]
            rows.append((name, tuple(env[name].shape), owners[rid][1],
                         None if env[name] is base else tuple(base.shape)))
    return sorted(rows, key=lambda r: -r[2])[:n]


def _describe(row) -> str:
    name, shape, nbytes, base = row
    return f"'{name}' {fmt_shape(shape)}" + (f" (a view of a {fmt_shape(base)} tensor)" if base else "") + \
        f" {_gib(nbytes)}"


def _check_dims(profiles: list[Profile]) -> None:
    for idx, prof in enumerate(profiles):
        for name, shapes in prof.shapes.items():
            for which, shape in zip(("min", "opt", "max"), shapes):
                for axis, d in enumerate(shape):
                    if not isinstance(d, int) or d < 0:
                        raise ShapeError(f"profile {idx}, input '{name}' axis {axis}: the {which} shape "
                                         f"{fmt_shape(shape)} has dimension {d}; a dimension is 0 or more.")


def check_inputs(graph: Graph, profiles: list[Profile], target: Target, float_bytes: int | None = None) -> None:
    """Before the build does anything: refuse negative dimensions, and profiles whose inputs at max plus the
    weights exceed free memory (the layers' activations are counted by check, on the optimized graph)."""
    _check_dims(profiles)
    dtypes = {v.name: v.dtype for v in graph.inputs}
    weights = weight_bytes(graph, float_bytes)
    free = available_bytes(target)
    for idx, prof in enumerate(profiles):
        sizes = {name: math.prod(shapes[2]) * _floored(dtypes.get(name), float_bytes)
                 for name, shapes in prof.shapes.items()}
        total = sum(sizes.values())
        if free is not None and sizes and weights + total > free:
            name = max(sizes, key=sizes.get)
            raise ConfigError(
                f"profile {idx} cannot fit in memory: at its max shapes the inputs alone take {_gib(total)} (input "
                f"'{name}' at {fmt_shape(prof.shapes[name][2])} is {_gib(sizes[name])}), plus {_gib(weights)} of "
                f"weights, but {_where(target)} is {_gib(free)}, and the layers' activations need more on top. "
                "Lower the profile's max (--maxShapes).")


def _floored(dtype, float_bytes: int | None) -> int:
    size = _itemsize(dtype)
    if float_bytes is not None and (dtype or torch.float32).is_floating_point:
        size = min(size, float_bytes)
    return size


def check(graph: Graph, profiles: list[Profile], target: Target, float_bytes: int | None = None) -> list[Footprint]:
    """On the graph the engine runs (optimized and placed): refuse a profile whose weights, inputs and peak of
    live activations at its max shapes exceed free memory, naming the layer at the peak. Returns each profile's
    footprint."""
    free = available_bytes(target)
    out = []
    for idx, prof in enumerate(profiles):
        fp = estimate(graph, {k: s[2] for k, s in prof.shapes.items()}, float_bytes)
        out.append(fp)
        if free is None or fp.total <= free:
            continue
        peak = ""
        if fp.peak_layer is not None:
            biggest = ", ".join(_describe(row) for row in fp.largest)
            peak = f" (the peak is reached at layer '{fp.peak_layer}'; largest live: {biggest})"
        partial = f"; counted up to where the walk stopped: {fp.stopped}" if fp.stopped else ""
        raise ConfigError(
            f"profile {idx} cannot fit in memory: at its max shapes the engine needs at least {_gib(fp.total)}: "
            f"{_gib(fp.weights)} of weights, {_gib(fp.inputs)} of inputs and {_gib(fp.activations)} of "
            f"intermediate activations live at once{peak}{partial}, but {_where(target)} is {_gib(free)}. "
            "Lower the profile's max (--maxShapes).")
    return out
