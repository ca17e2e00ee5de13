"""`torch.compile(model, backend="kiln")`: the FX graph's supported regions become Kiln engines.

    compiled = torch.compile(model, backend="kiln", options={"precision": "fp16"})
    y = compiled(x)

Dynamo hands the backend one FX graph per stretch of Python it could trace (a print, or a branch on a
tensor's value, ends a graph: the "graph break"; dynamo runs that Python itself). In each graph:

1. Every node is checked against Kiln: the ONNX operators its torch call exports to (`_ONNX_OPS`) must
   all be in Kiln's operator registry, its inputs must be tensors (not Python sizes), and an in-place
   call must write only a value nothing else reads. Anything else (custom operators, size arithmetic)
   stays in PyTorch.
2. `CapabilityBasedPartitioner` groups the supported nodes into regions (no cycles through PyTorch).
3. On the first call, each region is exported with torch.onnx.export on the tensors it receives and
   built with `kiln.build`, its parameters frozen into the engine (an inference backend: engines carry
   no autograd history). Building at the first call, not while dynamo compiles, keeps the exporter's own
   tracing out of dynamo's. A region that fails to export or build runs in PyTorch instead, and a
   warning names it and says why.

Dynamic shapes: a dimension dynamo made symbolic (after a recompile, or `torch._dynamo.mark_dynamic(x,
0, min=1, max=64)`) becomes a profile axis. min and max come from `options["min_shapes"/"max_shapes"]`
when given, else from the symbol's range; opt is the size of the example. A symbol with no upper bound
starts at the example's size, and a larger size at run time rebuilds the region with a wider profile
(and says so): Kiln never runs a shape outside a profile.

Options (`options={...}`): precision (fp32, tf32, fp16, bf16), workspace (bytes for the tactic search),
timing_cache (a JSON file), min_shapes / opt_shapes / max_shapes ({forward argument name or position:
shape}), device (auto: the inputs' device; cpu, cuda, cuda:N), optimization_level (0..5),
min_block_size (regions with fewer operators stay in PyTorch; default 1). Any other key is refused.
"""

from __future__ import annotations

import difflib
import math
import operator
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .errors import ConfigError, KilnError

_PRECISIONS = {"fp32": {}, "float32": {}, "tf32": {"tf32": True}, "fp16": {"fp16": True},
               "float16": {"fp16": True}, "bf16": {"bf16": True}, "bfloat16": {"bf16": True}}
OPTIONS = ("precision", "workspace", "timing_cache", "min_shapes", "opt_shapes", "max_shapes", "device",
           "optimization_level", "min_block_size")

F = torch.nn.functional
# torch calls (functions, Tensor methods by name, modules by class) and the ONNX operators they export to.
_ONNX_OPS: dict[object, tuple[str, ...]] = {
    torch.conv1d: ("Conv",), torch.conv2d: ("Conv",), torch.conv3d: ("Conv",), F.conv1d: ("Conv",),
    F.conv2d: ("Conv",), F.conv3d: ("Conv",), F.conv_transpose2d: ("ConvTranspose",), F.linear: ("Gemm", "MatMul"),
    torch.matmul: ("MatMul",), torch.mm: ("MatMul",), torch.bmm: ("MatMul",), torch.addmm: ("Gemm",),
    operator.matmul: ("MatMul",),
    torch.relu: ("Relu",), F.relu: ("Relu",), torch.relu_: ("Relu",), F.gelu: ("Gelu", "Erf", "Tanh"),
    torch.sigmoid: ("Sigmoid",), F.sigmoid: ("Sigmoid",), torch.tanh: ("Tanh",), F.tanh: ("Tanh",),
    F.silu: ("Sigmoid", "Mul"), F.hardswish: ("HardSwish",), F.hardsigmoid: ("HardSigmoid",),
    F.leaky_relu: ("LeakyRelu",), F.elu: ("Elu",), F.softplus: ("Softplus",), F.mish: ("Mish",),
    F.relu6: ("Clip",), F.hardtanh: ("Clip",), torch.clamp: ("Clip",), torch.clip: ("Clip",),
    torch.softmax: ("Softmax",), F.softmax: ("Softmax",), F.log_softmax: ("LogSoftmax",),
    torch.log_softmax: ("LogSoftmax",),
    F.layer_norm: ("LayerNormalization",), F.batch_norm: ("BatchNormalization",),
    F.group_norm: ("GroupNormalization",), F.instance_norm: ("InstanceNormalization",),
    F.max_pool2d: ("MaxPool",), F.avg_pool2d: ("AveragePool",), F.adaptive_avg_pool2d: ("GlobalAveragePool",
                                                                                        "AveragePool"),
    F.dropout: ("Identity",), F.pad: ("Pad",), F.scaled_dot_product_attention: ("MatMul", "Softmax"),
    F.embedding: ("Gather",), F.interpolate: ("Resize",),
    torch.add: ("Add",), torch.sub: ("Sub",), torch.mul: ("Mul",), torch.div: ("Div",),
    operator.add: ("Add",), operator.sub: ("Sub",), operator.mul: ("Mul",), operator.truediv: ("Div",),
    operator.iadd: ("Add",), operator.imul: ("Mul",), operator.neg: ("Neg",), operator.pow: ("Pow",),
    torch.neg: ("Neg",), torch.exp: ("Exp",), torch.log: ("Log",), torch.sqrt: ("Sqrt",), torch.rsqrt: ("Sqrt",
                                                                                                        "Reciprocal"),
    torch.abs: ("Abs",), torch.pow: ("Pow",), torch.erf: ("Erf",), torch.sin: ("Sin",), torch.cos: ("Cos",),
    torch.maximum: ("Max",), torch.minimum: ("Min",), torch.where: ("Where",),
    torch.cat: ("Concat",), torch.concat: ("Concat",), torch.flatten: ("Flatten", "Reshape"),
    torch.transpose: ("Transpose",), torch.permute: ("Transpose",), torch.reshape: ("Reshape",),
    torch.squeeze: ("Squeeze",), torch.unsqueeze: ("Unsqueeze",),
    torch.sum: ("ReduceSum",), torch.mean: ("ReduceMean",), torch.amax: ("ReduceMax",),
    torch.cumsum: ("CumSum",), torch.cumprod: ("CumProd",),
}
_METHOD_OPS: dict[str, tuple[str, ...]] = {
    "relu": ("Relu",), "relu_": ("Relu",), "sigmoid": ("Sigmoid",), "tanh": ("Tanh",), "softmax": ("Softmax",),
    "add": ("Add",), "add_": ("Add",), "sub": ("Sub",), "mul": ("Mul",), "mul_": ("Mul",), "div": ("Div",),
    "exp": ("Exp",), "pow": ("Pow",), "sqrt": ("Sqrt",), "abs": ("Abs",), "neg": ("Neg",),
    "flatten": ("Flatten", "Reshape"), "transpose": ("Transpose",), "permute": ("Transpose",),
    "reshape": ("Reshape",), "view": ("Reshape",), "contiguous": ("Identity",), "squeeze": ("Squeeze",),
    "unsqueeze": ("Unsqueeze",), "sum": ("ReduceSum",), "mean": ("ReduceMean",), "matmul": ("MatMul",),
    "clamp": ("Clip",), "float": ("Cast",), "half": ("Cast",), "to": ("Cast",), "type_as": ("Cast",),
}
_MODULE_OPS: dict[type, tuple[str, ...]] = {
    torch.nn.Conv1d: ("Conv",), torch.nn.Conv2d: ("Conv",), torch.nn.Conv3d: ("Conv",), torch.nn.Linear: ("Gemm",),
    torch.nn.ReLU: ("Relu",), torch.nn.GELU: ("Gelu",), torch.nn.SiLU: ("Sigmoid", "Mul"),
    torch.nn.Sigmoid: ("Sigmoid",), torch.nn.Tanh: ("Tanh",), torch.nn.BatchNorm2d: ("BatchNormalization",),
    torch.nn.LayerNorm: ("LayerNormalization",), torch.nn.MaxPool2d: ("MaxPool",),
    torch.nn.AvgPool2d: ("AveragePool",), torch.nn.AdaptiveAvgPool2d: ("GlobalAveragePool",),
    torch.nn.Flatten: ("Flatten",), torch.nn.Dropout: ("Identity",), torch.nn.Softmax: ("Softmax",),
    torch.nn.Identity: ("Identity",),
}
# Tensor-method conversions that only keep the value as it is, or change its dtype.
_MUTATING_METHODS = re.compile(r".*[^_]_$")


def _onnx_ops(node: torch.fx.Node, modules: dict) -> tuple[str, ...] | None:
    if node.op == "call_function":
        return _ONNX_OPS.get(node.target)
    if node.op == "call_method":
        return _METHOD_OPS.get(node.target)
    if node.op == "call_module":
        return _MODULE_OPS.get(type(modules.get(node.target)))
    return None


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _writes_in_place(node: torch.fx.Node, modules: dict) -> bool:
    if node.op == "call_method" and _MUTATING_METHODS.match(str(node.target)):
        return True
    if node.op == "call_function" and (getattr(node.target, "__name__", "").endswith("_")
                                       or node.target in (operator.iadd, operator.imul)):
        return True
    if node.kwargs.get("inplace"):
        return True
    return node.op == "call_module" and bool(getattr(modules.get(node.target), "inplace", False))


class KilnSupport:
    """Whether a node of dynamo's graph can run inside a Kiln engine (torch.fx OperatorSupport protocol)."""

    def __init__(self, constants: set):
        from .ops.registry import lookup

        self._lookup = lookup
        self._constants = constants  # placeholders holding parameters: frozen into the engines
        self.reasons: dict[str, str] = {}  # node name -> why it stays in PyTorch

    def is_node_supported(self, modules, node: torch.fx.Node) -> bool:
        why = self._why_not(modules, node)
        if why and node.op not in ("placeholder", "output", "get_attr"):
            self.reasons[node.name] = why
        return why is None

    def _why_not(self, modules, node) -> str | None:
        if node.op not in ("call_function", "call_method", "call_module"):
            return "not an operator"
        ops = _onnx_ops(node, modules)
        if ops is None:
            return f"{_label(node, modules)} has no ONNX mapping Kiln knows"
        missing = [op for op in ops if self._lookup(op) is None]
        if missing:
            return f"Kiln has no {', '.join(missing)} operator"
        if not _is_tensor(node.meta.get("example_value")):
            return "its result is not one tensor"
        for a in node.all_input_nodes:
            if not _is_tensor(a.meta.get("example_value")):
                return f"input '{a.name}' is a Python value computed at run time, not a tensor"
        if node.target in (F.avg_pool2d, F.avg_pool1d) and node.kwargs.get("divisor_override") is not None:
            return "torch.onnx.export drops avg_pool's divisor_override"
        if _writes_in_place(node, modules):
            target = node.args[0] if node.args else None
            if not isinstance(target, torch.fx.Node) or target.op == "placeholder" or len(target.users) > 1:
                return "it writes in place into a value that is read elsewhere"
        return None


def _label(node: torch.fx.Node, modules: dict | None = None) -> str:
    if node.op == "call_module" and modules is not None:
        return type(modules.get(node.target)).__name__
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


# --- options -----------------------------------------------------------------------------------------


@dataclass
class Options:
    precision: str = "fp32"
    workspace: int | None = None
    timing_cache: str | None = None
    min_shapes: dict = field(default_factory=dict)
    opt_shapes: dict = field(default_factory=dict)
    max_shapes: dict = field(default_factory=dict)
    device: str = "auto"
    optimization_level: int = 3
    min_block_size: int = 1

    @classmethod
    def parse(cls, options: dict | None) -> Options:
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"torch.compile(backend='kiln'): options={options!r} must be a dict of Kiln's settings, "
                              f"e.g. options={{'precision': 'fp16'}}; the keys are {list(OPTIONS)}.")
        options = dict(options or {})
        unknown = sorted(str(k) for k in options if k not in OPTIONS)
        if unknown:
            hints = "".join(f" ('{k}': did you mean '{close[0]}'?)" for k in unknown
                            if (close := difflib.get_close_matches(k, OPTIONS, n=1)))
            raise ConfigError(f"torch.compile(backend='kiln'): unknown option(s) {unknown}{hints}; Kiln's backend "
                              f"takes {list(OPTIONS)}.")
        o = cls(**options)
        if not isinstance(o.device, str) or not (o.device in ("auto", "cpu", "cuda")
                                                 or re.fullmatch(r"cuda:\d+", o.device)):
            raise ConfigError(f"torch.compile(backend='kiln'): option device={o.device!r} is not one of auto, cpu, "
                              "cuda, cuda:N.")
        if not (isinstance(o.optimization_level, int) and 0 <= o.optimization_level <= 5):
            raise ConfigError(f"torch.compile(backend='kiln'): option optimization_level={o.optimization_level!r} "
                              "must be an integer 0..5 (as trtexec's --builderOptimizationLevel).")
        if o.timing_cache is not None and not isinstance(o.timing_cache, (str, os.PathLike)):
            raise ConfigError(f"torch.compile(backend='kiln'): option timing_cache={o.timing_cache!r} must be a file "
                              "path.")
        if o.precision not in _PRECISIONS:
            raise ConfigError(f"torch.compile(backend='kiln'): option precision='{o.precision}' is not one of "
                              f"{sorted(_PRECISIONS)}.")
        if o.workspace is not None and not (isinstance(o.workspace, int) and o.workspace > 0):
            raise ConfigError(f"torch.compile(backend='kiln'): option workspace={o.workspace!r} must be a positive "
                              "number of bytes.")
        for k in ("min_shapes", "opt_shapes", "max_shapes"):
            if not isinstance(getattr(o, k), dict):
                raise ConfigError(f"torch.compile(backend='kiln'): option {k} must be a dict of forward argument "
                                  "name (or position) to shape.")
        if not (isinstance(o.min_block_size, int) and o.min_block_size >= 1):
            raise ConfigError("torch.compile(backend='kiln'): option min_block_size must be an integer >= 1.")
        return o

    def build_config(self, profile, device: str):
        from .builder.config import BuildConfig

        return BuildConfig(profiles=[profile], device=device, workspace_bytes=self.workspace,
                           timing_cache=self.timing_cache, optimization_level=self.optimization_level,
                           progress=False, **_PRECISIONS[self.precision])


# --- symbolic sizes to profiles ------------------------------------------------------------------------


def _argument_name(node: torch.fx.Node) -> str | None:
    """The forward argument a dynamo placeholder holds ("x" for L['x']), if it is one."""
    ga = node.meta.get("grapharg")
    src = getattr(getattr(ga, "source", None), "name", None)
    src = src() if callable(src) else src
    m = re.fullmatch(r"L\['(\w+)'\]", src or "")
    return m.group(1) if m else None


class SymbolRanges:
    """min/opt/max of each symbolic size of one dynamo graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, options: Options):
        self.lo, self.opt, self.hi = {}, {}, {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        shape_env = None
        for n in placeholders:
            ev = n.meta.get("example_value")
            if _is_tensor(ev) and getattr(ev, "fake_mode", None) is not None:
                shape_env = ev.fake_mode.shape_env
                break
        self.unbounded: set = set()
        if shape_env is None:
            return
        for sym, rng in shape_env.var_to_range.items():
            hint = _hints(shape_env).get(sym)
            if hint is None:
                continue
            self.opt[sym] = int(hint)
            self.lo[sym] = max(1, int(rng.lower)) if _finite(rng.lower) else 1
            if _finite(rng.upper):
                self.hi[sym] = int(rng.upper)
            else:
                self.hi[sym] = int(hint)
                self.unbounded.add(sym)
        position = {n: i for i, n in enumerate(p for p in placeholders if _is_tensor(p.meta.get("example_value"))
                                                and not isinstance(p.meta.get("example_value"), torch.nn.Parameter))}
        for key, table in (("min_shapes", self.lo), ("opt_shapes", self.opt), ("max_shapes", self.hi)):
            given = getattr(options, key)
            for name, shape in given.items():
                node = next((p for p in placeholders if _argument_name(p) == name or position.get(p) == name), None)
                if node is None:
                    continue  # an input of another graph of the same model (after a graph break)
                ev = node.meta["example_value"]
                if len(shape) != ev.dim():
                    raise ConfigError(f"torch.compile(backend='kiln'): option {key}['{name}'] has {len(shape)} "
                                      f"dimensions; the input has {ev.dim()}.")
                for d, size in zip(ev.shape, shape):
                    sym = _symbol(d)
                    if sym is not None:
                        table[sym] = int(size)
                        if key == "max_shapes":
                            self.unbounded.discard(sym)

    def at(self, dim, which: str) -> int:
        """A dimension (int or SymInt) evaluated at the symbols' min, opt or max."""
        if not isinstance(dim, torch.SymInt):
            return int(dim)
        expr = dim.node.expr
        values = {"min": self.lo, "opt": self.opt, "max": self.hi}[which]
        return int(expr.subs({s: values.get(s, self.opt.get(s, 1)) for s in expr.free_symbols}))


def _hints(shape_env) -> dict:
    """The symbols' example values (torch 2.14 renamed var_to_val to backed_var_to_val)."""
    hints = getattr(shape_env, "backed_var_to_val", None)
    return hints if hints is not None else shape_env.var_to_val


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v)) and abs(float(v)) < 2**62
    except (TypeError, ValueError, OverflowError):
        return False


def _symbol(dim):
    if isinstance(dim, torch.SymInt) and dim.node.expr.is_Symbol:
        return dim.node.expr
    return None


def _is_dynamic(dim) -> bool:
    return isinstance(dim, torch.SymInt) and bool(dim.node.expr.free_symbols)


# --- one region: an engine, or PyTorch ------------------------------------------------------------------


class _Frozen(torch.nn.Module):
    """The region with its parameters as buffers, so the exported ONNX holds them as initializers."""

    def __init__(self, region: torch.nn.Module, constants: dict[int, torch.Tensor], arity: int):
        super().__init__()
        self.region, self.arity = region, arity
        self.positions = sorted(constants)
        for i in self.positions:
            self.register_buffer(f"const_{i}", constants[i].detach(), persistent=False)

    def forward(self, *args):
        it = iter(args)
        full = [getattr(self, f"const_{i}") if i in self.positions else next(it) for i in range(self.arity)]
        return self.region(*full)


class KilnRegion(torch.nn.Module):
    """A supported region: runs its Kiln engine, or its PyTorch graph when it could not be built."""

    def __init__(self, name: str, region: torch.fx.GraphModule, placeholders: list, constants: dict[int, torch.Tensor],
                 ranges: SymbolRanges, options: Options):
        super().__init__()
        self.name, self.region, self.options, self.ranges = name, region, options, ranges
        self.constants = constants
        self.arity = len(placeholders)
        self.dynamic_positions = [i for i in range(self.arity) if i not in constants]
        self.fake_inputs = [p.meta.get("example_value") for p in placeholders]
        self.ops = [_label(n) for n in region.graph.nodes if n.op.startswith("call_")]
        self.engine = self.context = self.profile = None
        self.tried = False  # built (or failed to) on the first call's inputs
        self.single = False
        self.fallback_reason = ""

    def describe(self) -> str:
        shown = ", ".join(self.ops[:6]) + (f" and {len(self.ops) - 6} more" if len(self.ops) > 6 else "")
        return f"region '{self.name}' ({len(self.ops)} operator(s): {shown})"

    def _profile(self, examples: list[torch.Tensor]):
        from .engine.profile import Profile

        shapes = {}
        for k, pos in enumerate(self.dynamic_positions):
            fake, real = self.fake_inputs[pos], examples[k]
            dims = fake.shape if _is_tensor(fake) else real.shape
            lo = tuple(min(self.ranges.at(d, "min"), r) if _is_dynamic(d) else r for d, r in zip(dims, real.shape))
            hi = tuple(max(self.ranges.at(d, "max"), r) if _is_dynamic(d) else r for d, r in zip(dims, real.shape))
            if self.profile is not None:  # a rebuild widens the profile (to a power of two), never narrows it
                old_lo, _, old_hi = self.profile.shapes[f"in{k}"]
                lo = tuple(min(a, b) for a, b in zip(lo, old_lo))
                hi = tuple(max(b, 1 << (a - 1).bit_length()) if a > b else b for a, b in zip(hi, old_hi))
            shapes[f"in{k}"] = (lo, tuple(real.shape), hi)
        return Profile(shapes)

    def build(self, examples: list[torch.Tensor]) -> bool:
        """Export and build the engine for these example inputs; False (and a warning) when it fails."""
        from .build import build
        from .frontend.torch_export import from_torch

        profile = self._profile(examples)
        dynamic = [{a: torch.export.Dim.AUTO for a in range(x.dim()) if profile.shapes[f"in{k}"][0][a]
                    != profile.shapes[f"in{k}"][2][a]} or None for k, x in enumerate(examples)]
        frozen = _Frozen(self.region, self.constants, self.arity)
        try:
            with torch.no_grad():
                sample = frozen(*examples)
            self.single = _is_tensor(sample)
            n_out = 1 if self.single else len(sample)
            model, _ = from_torch(frozen, tuple(examples), dynamic_shapes=(tuple(dynamic),) if any(dynamic) else None,
                                  input_names=[f"in{k}" for k in range(len(examples))],
                                  output_names=[f"out{k}" for k in range(n_out)])
            _static_axes_fixed(model, profile)
            device = self.options.device
            if device == "auto":
                device = str(examples[0].device) if examples else "auto"
            engine = build(model, self.options.build_config(profile, device))
            if [v.name for v in engine.outputs] != [f"out{k}" for k in range(n_out)]:
                raise KilnError(f"the engine's outputs {[v.name for v in engine.outputs]} do not match the region's "
                                f"{n_out} output(s)")
            context = engine.create_execution_context()
            _same_layout(list(context.run(list(examples)).values()), [sample] if self.single else list(sample))
        except Exception as e:  # noqa: BLE001  (any failure keeps the region in PyTorch, with its reason)
            self.fallback_reason = f"{type(e).__name__}: {e}" if not isinstance(e, KilnError) else str(e)
            warnings.warn(f"torch.compile(backend='kiln'): {self.describe()} runs in PyTorch: it could not be built "
                          f"as a Kiln engine ({self.fallback_reason.splitlines()[0][:500]})", stacklevel=2)
            self.engine = self.context = None
            return False
        self.engine, self.profile, self.context, self.fallback_reason = engine, profile, context, ""
        return True

    def _outside(self, feeds: list[torch.Tensor]) -> bool:
        for k, x in enumerate(feeds):
            lo, _, hi = self.profile.shapes[f"in{k}"]
            if len(lo) != x.dim() or any(not a <= s <= b for a, s, b in zip(lo, x.shape, hi)):
                return True
        return False

    def forward(self, *args):
        feeds = [args[i] for i in self.dynamic_positions]
        if not self.tried:
            self.tried = True
            self.build([x.detach() for x in feeds])
        elif self.context is not None and self._outside(feeds):
            shapes = ", ".join(f"in{k} {list(x.shape)}" for k, x in enumerate(feeds))
            warnings.warn(f"torch.compile(backend='kiln'): {self.describe()} gets {shapes}, outside its profile "
                          f"{self.profile.to_json()}; rebuilding it with a profile that covers them.", stacklevel=2)
            self.build([x.detach() for x in feeds])
        if self.context is None:
            return self.region(*args)
        outs = list(self.context.run(feeds).values())
        home = feeds[0].device if feeds else None
        if home is not None and home != self.context.device:
            outs = [t.to(home) for t in outs]
        return outs[0] if self.single else tuple(outs)


def _same_layout(engine_outs: list, torch_outs: list) -> None:
    """The engine's outputs on the first inputs have PyTorch's shapes and dtypes (a complex tensor, which
    ONNX export turns into a real one with a trailing axis of 2, does not)."""
    for k, (e, t) in enumerate(zip(engine_outs, torch_outs)):
        if not _is_tensor(t) or tuple(e.shape) != tuple(t.shape) or e.dtype != t.dtype:
            want = f"{t.dtype} {list(t.shape)}" if _is_tensor(t) else type(t).__name__
            raise KilnError(f"output out{k} of the engine is {e.dtype} {list(e.shape)} where PyTorch returns {want}")


def _static_axes_fixed(model, profile) -> None:
    """The exporter may specialize an axis asked to be dynamic (a size it found fixed): the profile keeps
    that axis at the example's size."""
    for vi in model.graph.input:
        if vi.name not in profile.shapes:
            continue
        lo, opt, hi = (list(s) for s in profile.shapes[vi.name])
        for a, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and a < len(opt):
                lo[a] = hi[a] = opt[a]
        profile.shapes[vi.name] = (tuple(lo), tuple(opt), tuple(hi))


# --- the backend ---------------------------------------------------------------------------------------


@dataclass
class Partitioning:
    """What the backend did with one dynamo graph (kept on the returned callable as `.kiln`)."""

    regions: list[KilnRegion] = field(default_factory=list)
    in_pytorch: dict[str, str] = field(default_factory=dict)  # node -> why it stays in PyTorch

    @property
    def engines(self) -> int:
        return sum(r.engine is not None for r in self.regions)


def _constants(gm: torch.fx.GraphModule, example_inputs) -> dict[torch.fx.Node, torch.Tensor]:
    """Placeholders that hold the module's parameters and buffers (dynamo lifts them to graph inputs)."""
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        ga = node.meta.get("grapharg")
        src = getattr(getattr(ga, "source", None), "name", "")
        src = src() if callable(src) else src
        if isinstance(value, torch.nn.Parameter) or "._parameters[" in (src or "") or "._buffers[" in (src or ""):
            out[node] = value
    return out


def kiln_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """The torch.compile backend: returns a callable that runs `gm` with its supported regions as engines."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

    if kwargs:
        raise ConfigError(f"torch.compile(backend='kiln') does not take {sorted(kwargs)} (mode= is inductor's); "
                          f"pass Kiln's settings as options={{...}} with keys {list(OPTIONS)}.")
    opts = Options.parse(options)
    constants = _constants(gm, example_inputs)
    support = KilnSupport(set(constants))
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    partitions = [p for p in partitioner.propose_partitions()
                  if sum(n.op.startswith("call_") for n in p.nodes) >= opts.min_block_size]
    result = Partitioning(in_pytorch=dict(support.reasons))
    if not partitions:
        return _attach(gm.forward, result)
    fused = partitioner.fuse_partitions(partitions, prefix="kiln_region_")
    ranges = SymbolRanges(gm, example_inputs, opts)
    by_name = {n.name: v for n, v in constants.items()}
    for node in list(fused.graph.nodes):
        if node.op != "call_module" or not str(node.target).startswith("kiln_region_"):
            continue
        sub = fused.get_submodule(node.target)
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        consts = {i: by_name[a.name] for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node)
                  and a.name in by_name}
        region = KilnRegion(str(node.target), sub, placeholders, consts, ranges, opts)
        setattr(fused, node.target, region)
        result.regions.append(region)
    fused.recompile()
    return _attach(fused.forward, result)


def _attach(fn, result: Partitioning):
    def run(*args):
        return fn(*args)

    run.kiln = result
    return run


def register() -> None:
    """Register "kiln" with torch.compile, unless torch's entry-point discovery already did."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "kiln" not in _COMPILER_FNS:
        register_backend(compiler_fn=kiln_backend, name="kiln")


def registered_by_entry_point() -> bool:
    """Whether Kiln's installed package metadata names this module's "kiln" in torch's `torch_dynamo_backends` group
    (only Kiln's own metadata is read: scanning every installed distribution would slow `import kiln`)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        eps = distribution("kiln").entry_points
    except PackageNotFoundError:
        return False
    # The value too: metadata written before this module moved names a module that no longer exists.
    return any(ep.group == "torch_dynamo_backends" and ep.name == "kiln" and ep.value == f"{__name__}:kiln_backend"
               for ep in eps)
