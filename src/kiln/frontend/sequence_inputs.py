"""Sequence-typed model inputs bound as tensors: an engine's bindings are tensors (as TensorRT's are), so a
model input of type sequence(tensor(T)) becomes one tensor input per element and a SequenceConstruct
that rebuilds the sequence inside the graph. The element count is fixed per engine, like a static shape.

    model = bind_sequence_inputs(model, {"seq": 3})   # inputs seq__0, seq__1, seq__2 replace 'seq'
"""

from __future__ import annotations

import onnx
from onnx import helper

from .input_binding import bind_inputs


def sequence_inputs(model: onnx.ModelProto) -> list[str]:
    """The names of the model's inputs typed sequence(tensor(...)), in input order."""
    return [v.name for v in model.graph.input if v.type.WhichOneof("value") == "sequence_type"
            and v.type.sequence_type.elem_type.WhichOneof("value") == "tensor_type"]


def element_names(name: str, length: int) -> list[str]:
    """The tensor inputs that carry the elements of sequence input `name`."""
    return [f"{name}__{i}" for i in range(length)]


def bind_sequence_inputs(model: onnx.ModelProto, lengths: dict[str, int]) -> onnx.ModelProto:
    """A copy of `model` whose sequence inputs named in `lengths` are tensor inputs, `lengths[name]` of them."""

    def bind(vi):
        elem = vi.type.sequence_type.elem_type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in elem.shape.dim] \
            if elem.HasField("shape") else None
        names = element_names(vi.name, lengths[vi.name])
        infos = [helper.make_tensor_value_info(n, elem.elem_type, shape) for n in names]
        if names:
            return infos, [helper.make_node("SequenceConstruct", names, [vi.name], name=f"{vi.name}/bound")]
        return infos, [helper.make_node("SequenceEmpty", [], [vi.name], name=f"{vi.name}/bound",
                                        dtype=elem.elem_type or onnx.TensorProto.FLOAT)]

    return bind_inputs(model, "sequence", sequence_inputs(model), lengths, bind)
