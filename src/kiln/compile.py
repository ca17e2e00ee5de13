"""kiln.compile: a PyTorch module in, a callable engine out (Torch-TensorRT's habit).

    trt_model = kiln.compile(model, inputs=[kiln.Input((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))],
                             precision="fp16")
    y = trt_model(x)          # behaves like model(x)

Keyword arguments (a Hugging Face model's input_ids=, attention_mask=) are given as kwarg_inputs and
passed the same way at call time; the result has the structure the module returns (a tensor, a tuple, a
dict or a transformers ModelOutput), rebuilt around the engine's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from .build import build
from .builder.config import BuildConfig
from .engine.profile import Profile
from .errors import ConfigError, InputError

_PRECISIONS = {"fp32": {}, "float32": {}, "tf32": {"tf32": True}, "fp16": {"fp16": True},
               "float16": {"fp16": True}, "bf16": {"bf16": True}, "bfloat16": {"bf16": True}}


@dataclass
class Input:
    """An input with a shape range. Give one shape for a fixed input, or min/opt/max for a dynamic one."""

    min_shape: tuple
    opt_shape: tuple | None = None
    max_shape: tuple | None = None
    dtype: torch.dtype = torch.float32

    def shapes(self):
        opt = self.opt_shape or self.min_shape
        return tuple(self.min_shape), tuple(opt), tuple(self.max_shape or opt)

    def example(self, device=None) -> torch.Tensor:
        shape = self.shapes()[1]
        if self.dtype.is_floating_point:
            return torch.randn(shape).to(device=device, dtype=self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=device)


class _Positional(torch.nn.Module):
    """The module with its keyword arguments taken by position, for export (engine inputs are positional)."""

    def __init__(self, module: torch.nn.Module, n_positional: int, keywords: list[str]):
        super().__init__()
        self.module, self.n, self.keywords = module, n_positional, keywords

    def forward(self, *args):
        return self.module(*args[:self.n], **dict(zip(self.keywords, args[self.n:])))


class CompiledModule:
    """Calls the engine with the module's arguments (positional as compiled, then the compiled keywords by
    name) and returns what the module returns: the engine's outputs put back into the module's output
    structure. Tensors on another device than the engine's are moved to it, and the outputs back."""

    def __init__(self, engine, output_spec=None, output_leaves=None, keywords=(), n_positional=None,
                 single_output: bool = False):
        self.engine = engine
        self.context = engine.create_execution_context()
        self._spec = output_spec
        self._leaves = output_leaves  # the sample's leaves: tensors become engine outputs, others are kept
        self._keywords = list(keywords)
        self._n = len(engine.inputs) - len(self._keywords) if n_positional is None else n_positional
        self._single = single_output  # without a structure: one tensor, or a tuple of them

    def _feeds(self, args, kwargs) -> list:
        if len(args) != self._n:
            raise InputError(f"the compiled module takes {self._n} positional argument(s), {len(args)} given.")
        unknown = sorted(set(kwargs) - set(self._keywords))
        missing = [k for k in self._keywords if k not in kwargs]
        if unknown or missing:
            raise InputError(f"the compiled module takes keyword argument(s) {self._keywords} as compiled; "
                             f"unknown: {unknown}, missing: {missing}.")
        return [*args, *(kwargs[k] for k in self._keywords)]

    def __call__(self, *args, **kwargs):
        feeds = self._feeds(args, kwargs)
        devices = {x.device for x in feeds if isinstance(x, torch.Tensor)}
        outs = list(self.context.run(feeds).values())
        if len(devices) == 1 and (home := devices.pop()) != self.context.device:
            outs = [t.to(home) if isinstance(t, torch.Tensor) else t for t in outs]
        if self._spec is None:
            return outs[0] if self._single else tuple(outs)
        it = iter(outs)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self._leaves]
        return pytree.tree_unflatten(leaves, self._spec)


def compile(module: torch.nn.Module, inputs=(), precision: str = "fp32", device: str = "auto",
            opset: int = 18, kwarg_inputs: dict | None = None, **build_options) -> CompiledModule:
    """Export `module` to ONNX with example inputs (kiln.Input shape ranges, or tensors for fixed shapes),
    build an engine and return a callable that behaves like the module."""
    if precision not in _PRECISIONS:
        raise ConfigError(f"precision '{precision}' is not one of {sorted(_PRECISIONS)}.")
    from .frontend.torch_export import from_torch

    kwarg_inputs = dict(kwarg_inputs or {})
    given = list(inputs) + list(kwarg_inputs.values())
    specs = [x if isinstance(x, Input) else Input(tuple(x.shape), dtype=x.dtype) for x in given]
    # Examples where the module's weights are (a CUDA module is exported from CUDA tensors)
    home = next((p.device for p in module.parameters()), None)
    examples = [x if isinstance(x, torch.Tensor) else s.example(home) for x, s in zip(given, specs)]
    dynamic = []
    for i, s in enumerate(specs):
        lo, _, hi = s.shapes()
        dims = {a: torch.export.Dim(f"in{i}_d{a}", min=lo[a], max=hi[a]) for a in range(len(lo)) if lo[a] != hi[a]}
        dynamic.append(dims or None)
    module = module.eval()
    n_positional = len(list(inputs))
    target = _Positional(module, n_positional, list(kwarg_inputs)) if kwarg_inputs else module
    with torch.no_grad():
        sample = target(*examples)
    shapes = tuple(dynamic) if any(dynamic) else None
    if shapes and kwarg_inputs:  # forward(*args): torch.export takes the varargs' specs as one element
        shapes = (shapes,)
    model, _ = from_torch(target, tuple(examples), dynamic_shapes=shapes, opset=opset)
    names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    profile = Profile({n: s.shapes() for n, s in zip(names, specs)})
    config = BuildConfig(profiles=[profile], device=device, **_PRECISIONS[precision], **build_options)
    engine = build(model, config)
    leaves, spec = pytree.tree_flatten(sample)
    if sum(isinstance(x, torch.Tensor) for x in leaves) != len(engine.outputs):
        # The exporter dropped or merged outputs (a constant output, say): no structure to rebuild.
        return CompiledModule(engine, keywords=list(kwarg_inputs), n_positional=n_positional,
                              single_output=isinstance(sample, torch.Tensor))
    return CompiledModule(engine, spec, leaves, keywords=list(kwarg_inputs), n_positional=n_positional)
