import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import dead_code, inline_control_flow

from .util import check_pass, ops, rand

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, inits=None, opset=17):
    graph = helper.make_graph(nodes, "t", inputs, outputs,
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run_pass(graph):
    inline_control_flow.run(graph)
    dead_code.run(graph)


class _Pipeline:  # check_pass takes a module with run(graph)
    run = staticmethod(_run_pass)


@pytest.mark.parametrize("cond", [True, False])
def test_if_on_a_constant_becomes_its_branch(cond):
    bias = numpy_helper.from_array(np.array([1, 2, 3], np.float32), "bias")
    then = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["t"])], "then", [], [vi("t", F, [3])],
                             initializer=[bias])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [vi("e", F, [3])])
    m = _model([helper.make_node("If", ["c"], ["y"], name="choose", then_branch=then, else_branch=other)],
               [vi("x", F, [3])], [vi("y", F, [3])], {"c": np.array(cond)})
    _, after = check_pass(_Pipeline, m, {"x": rand(3)})
    assert ops(after) == (["Add"] if cond else ["Neg"])  # the branch's node writes the If's output itself


def _counting_loop(trips, opset=17):
    """acc += x * i for i < trips, a scan output of every acc; the body's If adds 1 on even iterations."""
    one = helper.make_graph([helper.make_node("Add", ["acc_i", "unit"], ["plus"])], "even", [], [vi("plus", F, [2])],
                            initializer=[numpy_helper.from_array(np.ones(2, np.float32), "unit")])
    same = helper.make_graph([helper.make_node("Identity", ["acc_i"], ["kept"])], "odd", [], [vi("kept", F, [2])])
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i_f"], to=F),
         helper.make_node("Mul", ["x", "i_f"], ["step"]),
         helper.make_node("Add", ["acc_in", "step"], ["acc_i"]),
         helper.make_node("Mod", ["i", "two"], ["parity"]),
         helper.make_node("Equal", ["parity", "zero"], ["even"]),
         helper.make_node("If", ["even"], ["acc_out"], then_branch=one, else_branch=same),
         helper.make_node("Identity", ["acc_out"], ["scan"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [vi("i", I64, []), vi("cond_in", BOOL, []), vi("acc_in", F, [2])],
        [vi("cond_out", BOOL, []), vi("acc_out", F, [2]), vi("scan", F, [2])],
        initializer=[numpy_helper.from_array(np.array(2, np.int64), "two"),
                     numpy_helper.from_array(np.array(0, np.int64), "zero")])
    loop = helper.make_node("Loop", ["M", "", "acc0"], ["acc", "accs"], name="count", body=body)
    return _model([loop], [vi("x", F, [2]), vi("acc0", F, [2])], [vi("acc", F, [2]), vi("accs", F, None)],
                  {"M": np.array(trips, np.int64)}, opset)


@pytest.mark.parametrize("opset", [11, 17])
def test_a_loop_of_constant_count_is_unrolled_and_its_ifs_inlined(opset):
    _, after = check_pass(_Pipeline, _counting_loop(5, opset), {"x": rand(2), "acc0": rand(2, seed=1)})
    kinds = set(ops(after))
    assert not {"Loop", "If"} & kinds and "Concat" in kinds
    assert sum(op == "Unsqueeze" for op in ops(after)) == 5  # one per stacked scan slice


def test_a_loop_longer_than_the_limit_stays():
    _, after = check_pass(_Pipeline, _counting_loop(inline_control_flow.MAX_TRIPS + 1),
                          {"x": rand(2), "acc0": rand(2, seed=1)})
    assert ops(after) == ["Loop"]


def test_a_loop_whose_condition_reads_data_stays():
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
         helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"])],
        "body", [vi("i", I64, []), vi("cond_in", BOOL, []), vi("acc_in", F, [2])],
        [vi("cond_out", BOOL, []), vi("acc_out", F, [2])])
    m = _model([helper.make_node("Loop", ["M", "go", "acc0"], ["acc"], body=body)],
               [vi("x", F, [2]), vi("acc0", F, [2])], [vi("acc", F, [2])],
               {"M": np.array(10, np.int64), "go": np.array(True), "limit": np.array(3.0, np.float32)})
    _, after = check_pass(_Pipeline, m, {"x": np.ones(2, np.float32), "acc0": np.zeros(2, np.float32)})
    assert ops(after) == ["Loop"]


def test_a_loop_that_stops_on_a_constant_condition_is_unrolled():
    """No trip count: the body's condition (i + 1 < 3, from the iteration number alone) ends it."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
         helper.make_node("Add", ["i", "one"], ["next"]),
         helper.make_node("Less", ["next", "three"], ["cond_out"])],
        "body", [vi("i", I64, []), vi("cond_in", BOOL, []), vi("acc_in", F, [2])],
        [vi("cond_out", BOOL, []), vi("acc_out", F, [2])])
    m = _model([helper.make_node("Loop", ["", "go", "acc0"], ["acc"], body=body)],
               [vi("x", F, [2]), vi("acc0", F, [2])], [vi("acc", F, [2])],
               {"go": np.array(True), "one": np.array(1, np.int64), "three": np.array(3, np.int64)})
    _, after = check_pass(_Pipeline, m, {"x": rand(2), "acc0": rand(2, seed=1)})
    assert ops(after) == ["Add", "Add", "Add"]


def test_two_loops_of_one_name_unroll_apart():
    """ONNX does not require unique node names: the copies of two Loops named alike must not share values."""
    first = _counting_loop(3)
    second = _counting_loop(2)
    loop2 = second.graph.node[0]
    loop2.input[1:] = ["", "acc"]  # the second loop starts from the first one's result
    loop2.output[:] = ["acc2", "accs2"]
    first.graph.node.append(loop2)
    first.graph.initializer.append(numpy_helper.from_array(np.array(2, np.int64), "M2"))
    loop2.input[0] = "M2"
    first.graph.output.extend([vi("acc2", F, [2]), vi("accs2", F, None)])
    _, after = check_pass(_Pipeline, first, {"x": rand(2), "acc0": rand(2, seed=1)})
    assert "Loop" not in ops(after)
    written = [o for n in after.nodes for o in n.outputs if o]
    assert len(written) == len(set(written)) and not set(written) & set(after.initializers)  # each value once
