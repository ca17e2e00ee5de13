"""Value types Kiln refuses (as TensorRT does): maps, sequences of anything but tensors, and strings fail at
import with an UnsupportedError naming the graph value, the node that uses it and the type. Sequences of
tensors and optionals are built (ops/sequence.py, ops/optional.py); as model inputs they must be bound as
tensors first."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
import kiln.backend
from kiln.errors import UnsupportedError


def _identity_model(value_type):
    node = helper.make_node("Identity", ["x"], ["y"], name="pass_through")
    graph = helper.make_graph([node], "g", [helper.make_value_info("x", value_type)],
                              [helper.make_value_info("y", value_type)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("value_type, shown", [
    (helper.make_sequence_type_proto(helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, None))), "sequence(sequence(tensor(float)))"),
    (helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [3])),
     "map(int64, tensor(float))"),
])
def test_non_tensor_values_are_refused_naming_the_node(value_type, shown):
    model = _identity_model(value_type)
    with pytest.raises(UnsupportedError) as e:
        kiln.backend.prepare(model, "CPU")
    msg = str(e.value)
    assert "'x'" in msg and "'pass_through' (Identity)" in msg and shown in msg and "dense tensors" in msg
    with pytest.raises(UnsupportedError):
        kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))


def test_a_sequence_input_is_bound_as_tensors():
    """kiln.build refuses a sequence input, naming it and the rewrite; kiln.backend binds one tensor per element."""
    model = _identity_model(helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None)))
    with pytest.raises(UnsupportedError, match=r"\['x'\] are sequences.*bind_sequence_inputs"):
        kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    xs = [np.arange(3, dtype=np.float32), np.ones((2, 2), np.float32)]
    (ys,) = kiln.backend.prepare(model, "CPU").run([xs])
    assert isinstance(ys, list) and len(ys) == 2
    for y, x in zip(ys, xs):
        np.testing.assert_array_equal(y, x)
    bound = kiln.frontend.bind_sequence_inputs(model, {"x": 2})
    assert [v.name for v in bound.graph.input] == ["x__0", "x__1"] and bound.graph.node[0].op_type == "SequenceConstruct"


def test_an_optional_input_is_bound_as_given_or_empty():
    """kiln.build refuses an optional input, naming it and the rewrite; kiln.backend binds it per run, as its
    value or as empty (None in, None out)."""
    model = _identity_model(helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.INT64, [3])))
    with pytest.raises(UnsupportedError, match=r"\['x'\] are optional values.*bind_optional_inputs"):
        kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    rep = kiln.backend.prepare(model, "CPU")
    x = np.array([1, 2, 3], np.int64)
    np.testing.assert_array_equal(rep.run([x])[0], x)
    assert rep.run([None]) == (None,)


def test_string_tensors_are_refused_naming_the_node():
    node = helper.make_node("Equal", ["a", "b"], ["y"], name="same_label")
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, TensorProto.STRING, [2]) for k in "ab"],
        [helper.make_tensor_value_info("y", TensorProto.BOOL, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)
    with pytest.raises(UnsupportedError, match=r"'a' \(used by node 'same_label' \(Equal\)\).*STRING"):
        kiln.backend.prepare(model, "CPU")


def test_tensor_identity_still_builds():
    model = _identity_model(helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3]))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = kiln.backend.prepare(model, "CPU").run([x])
    np.testing.assert_array_equal(y, x)
