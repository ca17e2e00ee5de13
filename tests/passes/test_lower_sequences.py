import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import dead_code, lower_sequences

from .util import check_pass, ops, rand

F, I64 = TensorProto.FLOAT, TensorProto.INT64
vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, inits=None, opset=18):
    graph = helper.make_graph(nodes, "t", [vi(k, F if k != "pos" else I64, s) for k, s in inputs],
                              [vi(k, F if k != "n" else I64, None) for k in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


class _Pipeline:  # the pass, then dead_code dropping the sequence ops nothing reads any more
    @staticmethod
    def run(graph):
        lower_sequences.run(graph)
        dead_code.run(graph)


_FEEDS = {"a": rand(2, 3), "b": rand(1, 3, seed=1), "c": rand(3, 3, seed=2)}
_INPUTS = [("a", [2, 3]), ("b", [1, 3]), ("c", [3, 3])]


def test_a_chain_of_known_elements_becomes_concat_identity_and_a_weight():
    nodes = [helper.make_node("SequenceEmpty", [], ["e"], dtype=F),
             helper.make_node("SequenceInsert", ["e", "a"], ["s1"]),
             helper.make_node("SequenceInsert", ["s1", "b", "front"], ["s2"]),
             helper.make_node("SequenceInsert", ["s2", "c"], ["s3"]),
             helper.make_node("SequenceErase", ["s3", "middle"], ["s4"]),  # [b, a, c] -> [b, c]
             helper.make_node("ConcatFromSequence", ["s4"], ["y"], axis=0),
             helper.make_node("SequenceAt", ["s3", "last"], ["z"]),
             helper.make_node("SequenceLength", ["s3"], ["n"])]
    m = _model(nodes, _INPUTS, ["y", "z", "n"], {"front": np.array(0, np.int64), "middle": np.array(1, np.int64),
                                                 "last": np.array(-1, np.int64)})
    _, after = check_pass(_Pipeline, m, _FEEDS)
    assert ops(after) == ["Concat", "Identity"]
    assert after.nodes[0].inputs == ["b", "c"] and after.nodes[1].inputs == ["c"]
    assert int(after.initializers["n"]) == 3


@pytest.mark.parametrize("axis", [0, -1, 2])
def test_stacking_with_new_axis_unsqueezes_each_element(axis):
    nodes = [helper.make_node("SequenceConstruct", ["a", "a"], ["s"]),
             helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=axis, new_axis=1)]
    _, after = check_pass(_Pipeline, _model(nodes, _INPUTS[:1], ["y"]), {"a": _FEEDS["a"]})
    assert ops(after) == ["Unsqueeze", "Unsqueeze", "Concat"]


@pytest.mark.parametrize("opset", [11, 18])
def test_split_to_sequence_with_constant_sizes_becomes_split(opset):
    nodes = [helper.make_node("SplitToSequence", ["c", "sizes"], ["s"], axis=1),
             helper.make_node("SequenceAt", ["s", "one"], ["z"]),
             helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=1)]
    m = _model(nodes, _INPUTS[2:], ["z", "y"], {"sizes": np.array([1, 2], np.int64), "one": np.array(1, np.int64)},
               opset)
    _, after = check_pass(_Pipeline, m, {"c": _FEEDS["c"]})
    assert ops(after) == ["Split", "Identity", "Concat"]
    assert (after.nodes[0].attrs.get("split") == [1, 2]) is (opset < 13)  # an attribute before opset 13, else an input


def test_a_position_read_from_data_keeps_the_sequence():
    nodes = [helper.make_node("SequenceConstruct", ["a", "b"], ["s"]),
             helper.make_node("SequenceAt", ["s", "pos"], ["y"])]
    m = _model(nodes, _INPUTS[:2] + [("pos", [])], ["y"])
    _, after = check_pass(_Pipeline, m, {**{k: _FEEDS[k] for k in "ab"}, "pos": np.array(1, np.int64)})
    assert ops(after) == ["SequenceConstruct", "SequenceAt"]
