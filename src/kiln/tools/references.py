"""The references Kiln's engines are checked against: an ONNX model run by onnxruntime on the CPU, or a PyTorch
module in eager mode, and the check that a reference and an engine have the same bindings. onnxruntime is only
ever a reference here: it never runs Kiln's work."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, InputError, ModelError
from ..ir import dtypes
from ..ir.shapes import fmt_shape
from .user_code import load_torch_module


@dataclass
class Binding:
    name: str
    dtype: str | None  # short name, e.g. "float32"
    shape: tuple | None  # ints for static axes, str/None for dynamic ones


def engine_bindings(engine) -> tuple[list[Binding], list[Binding]]:
    def conv(values):
        return [Binding(v.name, dtypes.name_of(v.dtype) if v.dtype is not None else None,
                        tuple(v.shape) if v.shape is not None else None) for v in values]

    return conv(engine.inputs), conv(engine.outputs)


def _vi_binding(vi) -> Binding:
    t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    dtype = None
    shape = None
    if t is not None:
        if t.elem_type:
            try:
                dtype = dtypes.name_of(dtypes.onnx_to_torch(t.elem_type))
            except KeyError:
                dtype = dtypes.onnx_type_name(t.elem_type).lower()
        if t.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    return Binding(vi.name, dtype, shape)


class OnnxReference:
    """An ONNX model run by onnxruntime on the CPU: the reference Kiln's engines are checked against."""

    kind = "onnxruntime"

    def __init__(self, model, extra_outputs=None):
        """model: path or onnx.ModelProto. extra_outputs: intermediate tensor names to return too, or a
        callable proto -> names (so the model is read once)."""
        import onnx

        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError("the ONNX reference needs onnxruntime: pip install 'kiln[reference]'.") from None
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not path.is_file():
                raise ModelError(f"reference model '{path}' does not exist.")
            self.source = str(path)
            try:
                proto = onnx.load(str(path))
            except Exception as e:  # noqa: BLE001 - protobuf and onnx raise many kinds for a damaged file
                raise ModelError(f"reference model '{path}' cannot be read as ONNX ({e}).") from None
        else:
            proto = model
            self.source = "ONNX model (in memory)"
        self.model = proto
        inits = {t.name for t in proto.graph.initializer}
        self.inputs = [_vi_binding(vi) for vi in proto.graph.input if vi.name not in inits]
        self.outputs = [_vi_binding(vi) for vi in proto.graph.output]
        if callable(extra_outputs):
            extra_outputs = extra_outputs(proto)
        self.extra_outputs = [n for n in (extra_outputs or []) if n not in {o.name for o in self.outputs}]
        if self.extra_outputs:
            proto = _with_outputs(proto, self.extra_outputs)
        opts = ort.SessionOptions()
        # Numerically neutral rewrites only: the reference should compute what the graph says.
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.log_severity_level = 3
        try:
            self.session = _ort_session(ort, proto, opts)
        except Exception as e:  # noqa: BLE001 - onnxruntime's own exception types
            raise ModelError(f"onnxruntime cannot load the reference model {self.source}: {e}") from None

    def describe(self) -> str:
        return f"onnxruntime {__import__('onnxruntime').__version__} (CPU) on {self.source}"

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
        names = names or [o.name for o in self.outputs]
        ort_feeds = {}
        for k, x in feeds.items():
            x = np.asarray(x.float().numpy() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x)
            ort_feeds[k] = x
        try:
            outs = self.session.run(names, ort_feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime's own exception types
            raise InputError(f"onnxruntime could not run the reference on these inputs: {e}") from None
        return dict(zip(names, (np.asarray(o) for o in outs)))


def _ort_session(ort, proto, opts):
    if proto.ByteSize() < 1_800_000_000:
        return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    import onnx

    folder = tempfile.mkdtemp(prefix="kiln-ref-")
    path = os.path.join(folder, "model.onnx")
    onnx.save(proto, path, save_as_external_data=True, location="weights.bin")
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _with_outputs(proto, names: list[str]):
    """A copy of the model that also returns the intermediate tensors `names`."""
    import onnx

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    known = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        known = {vi.name: vi for vi in inferred.graph.value_info}
    except Exception:  # noqa: BLE001, S110 - without inferred types the outputs are added untyped
        pass
    for name in names:
        vi = known.get(name)
        if vi is not None:
            model.graph.output.append(vi)
        else:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return model


def onnx_node_outputs(proto) -> list[str]:
    """Tensors computed by the main graph's nodes (what --layerwise can mark as outputs)."""
    return [o for n in proto.graph.node for o in n.output if o]


class TorchReference:
    """A PyTorch module as the reference (API): called with the engine's inputs in binding order."""

    kind = "pytorch"

    def __init__(self, module: torch.nn.Module, input_names: list[str], output_names: list[str],
                 device: str | torch.device = "cpu"):
        self.module = module.eval()
        self.device = torch.device(device)
        self.inputs = [Binding(n, None, None) for n in input_names]
        self.outputs = [Binding(n, None, None) for n in output_names]
        self.extra_outputs: list[str] = []
        self.source = type(module).__name__

    def describe(self) -> str:
        return f"PyTorch {torch.__version__.split('+')[0]} eager ({self.source}, {self.device})"

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> dict[str, np.ndarray]:
        args = [torch.as_tensor(np.asarray(feeds[b.name])).to(self.device) for b in self.inputs]
        with torch.inference_mode():
            out = self.module(*args)
        if isinstance(out, torch.Tensor):
            out = [out]
        elif isinstance(out, dict):
            out = list(out.values())
        else:
            out = list(out)
        if len(out) != len(self.outputs):
            raise InputError(
                f"the PyTorch reference returns {len(out)} output(s) but the engine has {len(self.outputs)} "
                f"({[b.name for b in self.outputs]}); they are matched by position."
            )
        res = {b.name: dtypes.to_numpy(t) for b, t in zip(self.outputs, out)}
        return {k: res[k] for k in (names or res)}


def make_reference(ref: Any, engine, extra_outputs: list[str] | None = None):
    """REF as a path to .onnx, an onnx.ModelProto, a torch.nn.Module, 'module:factory', or a ready reference."""
    import onnx

    if isinstance(ref, (OnnxReference, TorchReference)):
        return ref
    names_in = [v.name for v in engine.inputs]
    names_out = [v.name for v in engine.outputs]
    if isinstance(ref, torch.nn.Module):
        return TorchReference(ref, names_in, names_out)
    if isinstance(ref, onnx.ModelProto):
        return OnnxReference(ref, extra_outputs)
    ref = str(ref)
    if not Path(ref).exists() and ":" in ref and not ref.endswith(".onnx"):
        return TorchReference(load_torch_module(ref, "reference"), names_in, names_out)
    if Path(ref).suffix == ".kiln":
        raise ConfigError(f"the reference '{ref}' is an engine; the reference must be the ONNX model "
                          "(run by onnxruntime) or a PyTorch module (MODULE:FACTORY).")
    return OnnxReference(ref, extra_outputs)


def check_bindings(reference, engine) -> None:
    """Raise one InputError that names every binding that differs between reference and engine."""
    e_in, e_out = engine_bindings(engine)
    problems = []
    for what, refs, engs in (("input", reference.inputs, e_in), ("output", reference.outputs, e_out)):
        rn, en = [b.name for b in refs], [b.name for b in engs]
        if isinstance(reference, TorchReference):
            continue
        only_ref = [n for n in rn if n not in en]
        only_eng = [n for n in en if n not in rn]
        if only_ref or only_eng:
            problems.append(
                f"{what} names differ: the reference has {rn}, the engine has {en}"
                + (f" (only in the reference: {only_ref}" if only_ref else " (")
                + (f"{'; ' if only_ref else ''}only in the engine: {only_eng})" if only_eng else ")")
            )
        byname = {b.name: b for b in engs}
        for r in refs:
            e = byname.get(r.name)
            if e is None:
                continue
            if r.dtype and e.dtype and r.dtype != e.dtype:
                problems.append(f"{what} '{r.name}' is {r.dtype} in the reference but {e.dtype} in the engine")
            if r.shape is not None and e.shape is not None:
                if len(r.shape) != len(e.shape):
                    problems.append(f"{what} '{r.name}' has rank {len(r.shape)} ({fmt_shape(r.shape)}) in the reference "
                                    f"but rank {len(e.shape)} ({fmt_shape(e.shape)}) in the engine")
                else:
                    bad = [a for a, (x, y) in enumerate(zip(r.shape, e.shape))
                           if isinstance(x, int) and isinstance(y, int) and x != y and x > 0 and y > 0]
                    if bad:
                        problems.append(f"{what} '{r.name}' has shape {fmt_shape(r.shape)} in the reference but "
                                        f"{fmt_shape(e.shape)} in the engine (axis {', '.join(map(str, bad))})")
    if problems:
        raise InputError("the reference and the engine do not have the same bindings: " + "; ".join(problems)
                         + ". Compare the engine with the model it was built from.")
