"""Hand tests for optional.py: Optional, OptionalHasElement, OptionalGetElement, against Python's None/value
semantics, and an optional that stays empty through a built engine (saved and loaded: Optional's type
attribute round-trips)."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.engine.interpreter import call_node
from kiln.errors import KilnError
from kiln.ir.graph import Node

X = torch.arange(6.0).reshape(2, 3)


def _call(op, *args):
    node = Node(op, [f"in{i}" if a is not None else "" for i, a in enumerate(args)], ["out"],
                name=f"{op.lower()}_under_test", opset=18)
    (out,) = call_node(node, list(args))
    return out


@pytest.mark.parametrize("value", [X, [X, X + 1], None])
def test_optional_holds_its_value_and_says_whether_it_has_one(value):
    held = _call("Optional", value)
    assert held is value
    assert _call("OptionalHasElement", held).item() is (value is not None)
    if value is not None:
        assert _call("OptionalGetElement", held) is value


def test_getting_from_an_empty_optional_names_the_node():
    with pytest.raises(KilnError, match="'optionalgetelement_under_test'.*is empty"):
        _call("OptionalGetElement", None)


def test_an_empty_optional_through_an_engine(tmp_path):
    held = helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Optional", [], ["none"], type=held),
             helper.make_node("OptionalHasElement", ["none"], ["has_none"]),
             helper.make_node("Optional", ["x"], ["some"]),
             helper.make_node("OptionalHasElement", ["some"], ["has_some"]),
             helper.make_node("OptionalGetElement", ["some"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("has_none", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("has_some", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                               helper.make_value_info("none", helper.make_optional_type_proto(held))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    engine.save(tmp_path / "optional.kiln")
    for e in (engine, kiln.load(tmp_path / "optional.kiln")):
        got = e.create_execution_context().run({"x": X.numpy()})
        assert got["has_none"].item() is False and got["has_some"].item() is True and got["none"] is None
        np.testing.assert_array_equal(got["y"], X.numpy())
