"""PyTorch modules in: export to ONNX with torch.onnx.export(dynamo=True), and with its TorchScript exporter
where torch.export cannot trace the module (ExportFallbackWarning says so).

    model, hints = from_torch(mlp, (x,), dynamic_shapes={"x": {0: Dim("batch", min=1, max=32)}})
    engine = kiln.build(model, BuildConfig(profiles=[hints.to_profile()]))

The ModelProto holds its weights (no external files) and keeps dynamic axes
symbolic. ProfileHints records each dynamic axis of each ONNX input with the
bounds the caller gave torch (Dim min/max) and the example input's size, which
becomes the profile's opt.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import warnings
from dataclasses import dataclass, field

import onnx
import torch

from ..engine.profile import Profile
from ..errors import ConfigError, KilnError, UnsupportedError
from ..ir.shapes import fmt_shape
from . import external_data
from .opset import RECOMMENDED_OPSET


@dataclass(frozen=True)
class DynamicAxis:
    """One dynamic axis of an exported model's input."""

    input: str  # ONNX input name
    axis: int
    name: str | None  # the symbolic dimension in the ONNX model ("batch"), if named
    min: int  # from the torch Dim's min (1 when it has none)
    opt: int | None  # the example input's size on this axis
    max: int | None  # from the torch Dim's max (None when unbounded)

    def to_json(self) -> dict:
        return {"input": self.input, "axis": self.axis, "name": self.name,
                "min": self.min, "opt": self.opt, "max": self.max}


@dataclass
class ProfileHints:
    """What an optimization profile for the exported model needs: example shapes and dynamic axes."""

    shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)  # example (opt) shape per ONNX input
    axes: list[DynamicAxis] = field(default_factory=list)

    @property
    def dynamic(self) -> bool:
        return bool(self.axes)

    def to_profile(self) -> Profile:
        """A kiln Profile: min/max from the Dims' bounds, opt from the example inputs.

        Raises ConfigError naming the axis when a bound is missing.
        """
        out = {}
        for name, opt in self.shapes.items():
            if opt is None:
                raise ConfigError(
                    f"input '{name}' of the exported model has no example shape Kiln could match to it; "
                    "give the profile yourself (kiln.Profile or --minShapes/--optShapes/--maxShapes)."
                )
            lo, hi = list(opt), list(opt)
            for ax in (a for a in self.axes if a.input == name):
                label = f"axis {ax.axis}" + (f" ('{ax.name}')" if ax.name else "")
                if ax.max is None:
                    raise ConfigError(
                        f"input '{name}' {label} is dynamic but has no upper bound; export with "
                        f"torch.export.Dim('{ax.name or 'dim'}', min={ax.min}, max=N), or give --maxShapes for it."
                    )
                if not ax.min <= opt[ax.axis] <= ax.max:
                    raise ConfigError(
                        f"input '{name}' {label}: the example size {opt[ax.axis]} is outside the Dim's range "
                        f"{ax.min}..{ax.max}."
                    )
                lo[ax.axis], hi[ax.axis] = ax.min, ax.max
            out[name] = (tuple(lo), tuple(opt), tuple(hi))
        return Profile(out)

    def to_json(self) -> dict:
        return {
            "shapes": {k: list(v) if v is not None else None for k, v in self.shapes.items()},
            "axes": [a.to_json() for a in self.axes],
        }

    def __str__(self) -> str:
        parts = [f"{k}: {fmt_shape(v) if v is not None else '?'}" for k, v in self.shapes.items()]
        axes = [f"{a.input}[{a.axis}] {a.name or ''} {a.min}..{a.max if a.max is not None else 'inf'}"
                for a in self.axes]
        return "; ".join(parts) + (" | dynamic: " + ", ".join(axes) if axes else "")


def from_torch(
    module: torch.nn.Module,
    example_inputs,
    dynamic_shapes=None,
    opset: int = 18,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
) -> tuple[onnx.ModelProto, ProfileHints]:
    """Export `module` to ONNX (torch.onnx.export, dynamo=True) and return (ModelProto, ProfileHints).

    `example_inputs`: a tensor or a tuple of positional arguments. `dynamic_shapes`
    follows torch.export: a dict keyed by forward's argument names (or a tuple by
    position) of {axis: torch.export.Dim(...)}. The module is exported in eval
    mode (its training flags are restored afterwards).
    """
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}.")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not isinstance(opset, int) or opset < RECOMMENDED_OPSET:
        raise ConfigError(f"opset {opset} is too old: Kiln exports at ai.onnx opset {RECOMMENDED_OPSET} or newer.")
    cls = type(module).__name__
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with _quiet():
            model = torch.onnx.export(
                module, args, dynamo=True, dynamic_shapes=dynamic_shapes, opset_version=opset,
                input_names=input_names, output_names=output_names, verbose=False, report=False,
            ).model_proto
    except ImportError as e:
        raise KilnError(
            f"exporting {cls} needs the ONNX exporter's dependencies ({e}); install them with "
            "`pip install onnxscript`."
        ) from None
    except Exception as e:  # noqa: BLE001 - OnnxExporterError, torch.export UserError, ...: try the other exporter
        model = _torchscript_export(module, args, dynamic_shapes, opset, input_names, output_names,
                                    f"torch.onnx.export with dynamo=True, opset {opset}: {_summary(e)}")
    finally:
        for m, training in modes.items():
            m.training = training
    external = [s.where for s in external_data.iter_tensors(model) if external_data.is_external(s.tensor)]
    if external:  # model_proto serializes in-memory weights; this would be an exporter change
        raise KilnError(f"the exported model of {cls} keeps {external[0]} in an external file; "
                        "Kiln expected embedded weights.")
    return model, profile_hints(model, module, args, dynamic_shapes)


class ExportFallbackWarning(UserWarning):
    """torch.export could not trace the module; the TorchScript exporter made its ONNX model instead."""


def _torchscript_export(module, args: tuple, dynamic_shapes, opset: int, input_names, output_names,
                        failure: str) -> onnx.ModelProto:
    """The module through torch.onnx's TorchScript exporter (dynamo=False), after torch.export failed on it (5-D
    attention inputs, views of non-contiguous tensors): the same weights traced on the example inputs, with
    the dynamic axes of `dynamic_shapes` named after their Dims. Warns, naming torch.export's failure."""
    cls = type(module).__name__
    tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    params = _forward_params(module)
    names = list(input_names or [params[i] if i < len(params) else f"input_{i}" for i in tensor_args])
    specs = _arg_specs(module, len(args), dynamic_shapes)
    dynamic_axes = {}
    for name, i in zip(names, tensor_args):
        axes = {axis: getattr(dim, "__name__", None) or f"{name}_{axis}" for axis, dim in specs[i].items()}
        if axes:
            dynamic_axes[name] = axes
    buffer = io.BytesIO()
    try:
        with _quiet():
            torch.onnx.export(module, args, buffer, dynamo=False, opset_version=opset, input_names=names,
                              output_names=output_names, dynamic_axes=dynamic_axes or None)
        model = onnx.load_from_string(buffer.getvalue())
    except Exception as e:  # noqa: BLE001 - both exporters' messages go to the user
        raise UnsupportedError(
            f"exporting {cls} to ONNX failed: {failure}; the TorchScript exporter (dynamo=False), tried next, "
            f"said: {_summary(e)}") from None
    warnings.warn(ExportFallbackWarning(
        f"{cls}: torch.export could not trace it ({failure}); exported with the TorchScript exporter "
        "(dynamo=False) instead, which traced the example inputs' path through forward."), stacklevel=3)
    return model


@contextlib.contextmanager
def _quiet():
    """Keep the exporter's progress lines, graph dumps and warnings off the user's console."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        yield


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _summary(e: BaseException) -> str:
    """The exporter's message in a few lines: the underlying exception and where forward raised it."""
    text = _ANSI.sub("", str(e))
    m = re.search(r"## Exception summary\s*\n(.*?)(?:\n\s*\(Refer to the full stack trace|\n## |\Z)", text, re.S)
    body = m.group(1) if m else text
    lines = [ln.strip() for ln in body.strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    first = re.sub(r"^<class '(?:[\w.]+\.)?(\w+)'>:", r"\1:", lines[0])
    out = first if len(first) < 400 else first[:400] + "..."
    for i, ln in enumerate(lines):
        if ln.startswith("The following call raised this error"):
            where = " ".join(lines[i + 1:i + 3])
            out += f" (raised at {where})"
            break
    return out


def _finite(v) -> int | None:
    try:
        v = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if v < 2**62 else None


def _forward_params(module: torch.nn.Module) -> list[str]:
    """The names of forward's parameters, in order ([] where Python cannot tell them)."""
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _arg_specs(module: torch.nn.Module, n_args: int, dynamic_shapes) -> list[dict[int, object]]:
    """dynamic_shapes as one {axis: spec} per positional argument."""
    per_arg: list = [None] * n_args
    if isinstance(dynamic_shapes, dict):
        params = _forward_params(module)
        for key, spec in dynamic_shapes.items():
            if key in params and params.index(key) < n_args:
                per_arg[params.index(key)] = spec
    elif isinstance(dynamic_shapes, (list, tuple)):
        for i, spec in enumerate(list(dynamic_shapes)[:n_args]):
            per_arg[i] = spec
    out = []
    for spec in per_arg:
        if isinstance(spec, dict):
            out.append({int(k): v for k, v in spec.items() if isinstance(k, int)})
        elif isinstance(spec, (list, tuple)):
            out.append({i: v for i, v in enumerate(spec) if v is not None})
        else:
            out.append({})
    return out


def profile_hints(model: onnx.ModelProto, module: torch.nn.Module, args: tuple, dynamic_shapes=None) -> ProfileHints:
    """Match the exported model's inputs to the example arguments and the Dims the caller gave."""
    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    # The exporter lists one ONNX input per tensor argument, in order; other layouts are not matched.
    matched = len(tensor_args) == len(inputs)
    specs = _arg_specs(module, len(args), dynamic_shapes)
    hints = ProfileHints()
    for k, vi in enumerate(inputs):
        example = args[tensor_args[k]] if matched else None
        spec = specs[tensor_args[k]] if matched else {}
        hints.shapes[vi.name] = tuple(example.shape) if example is not None else None
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                continue
            dim = spec.get(axis)
            lo = _finite(getattr(dim, "min", None))
            hi = _finite(getattr(dim, "max", None))
            name = d.dim_param or getattr(dim, "__name__", None)
            opt = int(example.shape[axis]) if example is not None and axis < example.dim() else None
            hints.axes.append(DynamicAxis(vi.name, axis, name, max(lo or 1, 1), opt, hi))
    return hints
