"""`onnx.backend.base.Backend` for Kiln, so ONNX's own conformance cases run against it.

Each `run` builds a real Kiln engine (CPU target unless asked otherwise) for the
shapes of the inputs it is given, then executes it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from .ir import dtypes
from .ir.from_onnx import model_to_graph
from .ops import unsupported_reason


class KilnRep(BackendRep):
    def __init__(self, model: onnx.ModelProto, device: str, input_names: list[str]):
        self.model = model
        self.device = "cpu" if device.upper() == "CPU" else "cuda"
        self.input_names = input_names
        self._engines: dict = {}

    def run(self, inputs, **kwargs):
        from .engine.builder import BuildConfig, build

        feeds = dict(inputs) if isinstance(inputs, dict) else dict(zip(self.input_names, inputs))
        key = tuple((k, np.shape(v)) for k, v in feeds.items())
        engine = self._engines.get(key)
        if engine is None:
            shapes = {k: tuple(np.shape(v)) for k, v in feeds.items()}
            config = BuildConfig(shapes=shapes, device=self.device, progress=False, validate=False)
            engine = build(self.model, config)
            self._engines[key] = engine
        outputs = engine.create_execution_context().run(feeds)
        return tuple(dtypes.to_numpy(t) if hasattr(t, "detach") else t for t in outputs.values())


class KilnBackend(Backend):
    @classmethod
    def is_compatible(cls, model, device="CPU", **kwargs):
        graph = model_to_graph(model)
        return all(unsupported_reason(n) is None for n in graph.walk())

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        from .engine.builder import check_supported

        graph = model_to_graph(model)
        check_supported(graph)  # unsupported ops fail here, before any run
        return KilnRep(model, device, [v.name for v in graph.inputs])

    @classmethod
    def run_model(cls, model, inputs, device="CPU", **kwargs):
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        if device.upper() == "CPU":
            return True
        import torch

        return device.upper() == "CUDA" and torch.cuda.is_available()


prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
supports_device = KilnBackend.supports_device
is_compatible = KilnBackend.is_compatible
