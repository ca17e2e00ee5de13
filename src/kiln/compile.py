"""kiln.compile: a PyTorch module in, a callable engine out (Torch-TensorRT's habit).

    trt_model = kiln.compile(model, inputs=[kiln.Input((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))],
                             precision="fp16")
    y = trt_model(x)          # behaves like model(x)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine.builder import build
from .engine.config import BuildConfig, Profile
from .errors import ConfigError

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

    def example(self) -> torch.Tensor:
        shape = self.shapes()[1]
        if self.dtype.is_floating_point:
            return torch.randn(shape).to(self.dtype)
        return torch.zeros(shape, dtype=self.dtype)


class CompiledModule:
    """Calls the engine with the module's positional arguments; returns what the module returns
    (one tensor, or a tuple when the module returns several)."""

    def __init__(self, engine, single_output: bool):
        self.engine = engine
        self.context = engine.create_execution_context()
        self._single = single_output

    def __call__(self, *args):
        outs = list(self.context.run(list(args)).values())
        return outs[0] if self._single else tuple(outs)


def compile(module: torch.nn.Module, inputs, precision: str = "fp32", device: str = "auto",
            opset: int = 18, **build_options) -> CompiledModule:
    if precision not in _PRECISIONS:
        raise ConfigError(f"precision '{precision}' is not one of {sorted(_PRECISIONS)}.")
    from .frontend.torch_export import from_torch

    specs = [x if isinstance(x, Input) else Input(tuple(x.shape), dtype=x.dtype) for x in inputs]
    examples = [x if isinstance(x, torch.Tensor) else s.example() for x, s in zip(inputs, specs)]
    dynamic = []
    for i, s in enumerate(specs):
        lo, _, hi = s.shapes()
        dims = {a: torch.export.Dim(f"in{i}_d{a}", min=lo[a], max=hi[a]) for a in range(len(lo)) if lo[a] != hi[a]}
        dynamic.append(dims or None)
    module = module.eval()
    with torch.no_grad():
        sample = module(*examples)
    model, _ = from_torch(module, tuple(examples), dynamic_shapes=tuple(dynamic) if any(dynamic) else None, opset=opset)
    names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    profile = Profile({n: s.shapes() for n, s in zip(names, specs)})
    config = BuildConfig(profiles=[profile], device=device, **_PRECISIONS[precision], **build_options)
    engine = build(model, config)
    return CompiledModule(engine, single_output=isinstance(sample, torch.Tensor))
