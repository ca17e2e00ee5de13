"""Optional model inputs bound as what they hold: an engine's bindings are tensors, so a model input of type
optional(T) becomes, when it is given, an input of type T named NAME__value and an Optional node that wraps
it, and when it is absent, an Optional node with no input (an empty optional). Which are given is fixed per
engine. A T that is a sequence is then bound element by element (frontend/sequence_inputs.py).

    model = bind_optional_inputs(model, {"state": False})   # the engine runs with 'state' empty
"""

from __future__ import annotations

import onnx
from onnx import helper

from .input_binding import bind_inputs


def optional_inputs(model: onnx.ModelProto) -> list[str]:
    """The names of the model's inputs typed optional(...), in input order."""
    return [v.name for v in model.graph.input if v.type.WhichOneof("value") == "optional_type"]


def value_name(name: str) -> str:
    """The input that carries optional input `name`'s value when it is given."""
    return f"{name}__value"


def bind_optional_inputs(model: onnx.ModelProto, present: dict[str, bool]) -> onnx.ModelProto:
    """A copy of `model` whose optional inputs named in `present` are bound: given (True) or empty (False)."""

    def bind(vi):
        held = vi.type.optional_type.elem_type
        if present[vi.name]:
            return ([helper.make_value_info(value_name(vi.name), held)],
                    [helper.make_node("Optional", [value_name(vi.name)], [vi.name], name=f"{vi.name}/bound")])
        return [], [helper.make_node("Optional", [], [vi.name], name=f"{vi.name}/bound", type=held)]

    return bind_inputs(model, "optional", optional_inputs(model), present, bind)
