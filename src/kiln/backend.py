"""`onnx.backend.base.Backend` for Kiln, so ONNX's own conformance cases run against it.

Each `run` builds a real Kiln engine (CPU target unless asked otherwise) for the
shapes of the inputs it is given, then executes it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from .errors import InputError
from .frontend.optional_inputs import bind_optional_inputs, optional_inputs, value_name
from .frontend.sequence_inputs import (
    bind_sequence_inputs,
    element_names,
    sequence_inputs,
)
from .ir import dtypes
from .ir.from_onnx import model_to_graph
from .ops import unsupported_reason


class KilnRep(BackendRep):
    """A prepared model: one engine per input shape, the `max_engines` most recently used kept (LRU)."""

    max_engines = 8

    def __init__(self, model: onnx.ModelProto, device: str, input_names: list[str]):
        self.model = model
        self.device = "cpu" if device.upper() == "CPU" else "cuda"
        self.input_names = input_names
        self._engines: OrderedDict = OrderedDict()

    def _feeds(self, inputs) -> dict:
        if isinstance(inputs, dict):
            return dict(inputs)
        inputs = list(inputs)
        if len(inputs) > len(self.input_names):
            raise InputError(f"{len(inputs)} inputs were given by position, but the model has "
                             f"{len(self.input_names)}: {self.input_names}. Pass one array per model input.")
        return dict(zip(self.input_names, inputs))

    def run(self, inputs, **kwargs):
        from .build import build
        from .builder.config import BuildConfig

        feeds = self._feeds(inputs)
        # An optional input is bound as what it holds, or as empty where it is None (frontend/optional_inputs.py);
        # a sequence input (a list of arrays) as one tensor input per element (frontend/sequence_inputs.py).
        model = self.model
        present = {k: feeds[k] is not None for k in optional_inputs(model) if k in feeds}
        if present:
            model = bind_optional_inputs(model, present)
            for k, given in present.items():
                value = feeds.pop(k)
                if given:
                    feeds[value_name(k)] = value
        lengths = {k: len(feeds[k]) for k in sequence_inputs(model) if k in feeds}
        for k, n in lengths.items():
            feeds.update(zip(element_names(k, n), feeds.pop(k)))
        key = tuple((k, np.shape(v)) for k, v in feeds.items())
        if present:  # which optionals were given changes the graph, not only the shapes
            key = (tuple(present.items()), *key)
        engine = self._engines.get(key)
        if engine is None:
            shapes = {k: tuple(np.shape(v)) for k, v in feeds.items()}
            config = BuildConfig(shapes=shapes, device=self.device, progress=False, validate=False)
            engine = build(bind_sequence_inputs(model, lengths) if lengths else model, config)
            self._engines[key] = engine
            while len(self._engines) > self.max_engines:
                self._engines.popitem(last=False)
        self._engines.move_to_end(key)
        outputs = engine.create_execution_context().run(feeds)
        return tuple(_numpy(t) for t in outputs.values())


def _numpy(t):
    """An output as numpy: a tensor as an array, a sequence as a list of arrays, an empty optional as None."""
    if isinstance(t, list):
        return [_numpy(x) for x in t]
    return dtypes.to_numpy(t) if hasattr(t, "detach") else t


class KilnBackend(Backend):
    @classmethod
    def is_compatible(cls, model, device="CPU", **kwargs):
        from .errors import KilnError
        from .frontend.check import preflight

        try:
            preflight(model, "the model")
        except KilnError:
            return False
        graph = model_to_graph(_bound_once(model))
        return all(unsupported_reason(n) is None for n in graph.walk())

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        from .builder.builder import check_supported
        from .frontend.check import preflight

        preflight(model, "the model")  # a missing initializer or a cycle is a ModelError here, not a KeyError
        check_supported(model_to_graph(_bound_once(model)))  # unsupported ops fail here, before any run
        inits = {t.name for t in model.graph.initializer}
        return KilnRep(model, device, [v.name for v in model.graph.input if v.name not in inits])

    @classmethod
    def run_model(cls, model, inputs, device="CPU", **kwargs):
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        if device.upper() == "CPU":
            return True
        import torch

        return device.upper() == "CUDA" and torch.cuda.is_available()


def _bound_once(model):
    """The model with each optional input given and each sequence input bound as one tensor: its ops and types,
    for the checks before a run."""
    optionals = optional_inputs(model)
    if optionals:
        model = bind_optional_inputs(model, dict.fromkeys(optionals, True))
    seqs = sequence_inputs(model)
    return bind_sequence_inputs(model, dict.fromkeys(seqs, 1)) if seqs else model


prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
supports_device = KilnBackend.supports_device
is_compatible = KilnBackend.is_compatible
