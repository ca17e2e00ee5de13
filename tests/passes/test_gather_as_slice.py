import numpy as np

from kiln.passes import gather_as_slice

from .util import check_pass, helper, model, ops, rand


def test_constant_index_gathers_become_views():
    m = model([
        helper.make_node("Gather", ["x", "first"], ["a"], axis=1),  # x[:, 0]
        helper.make_node("Gather", ["x", "last"], ["b"], axis=0),  # x[-1]
        helper.make_node("Gather", ["x", "one"], ["c"], axis=2),  # x[..., [1]] keeps the axis
    ], [("x", [3, 4, 5])], [("a", [3, 5]), ("b", [4, 5]), ("c", [3, 4, 1])],
        {"first": np.int64(0), "last": np.int64(-1), "one": np.array([1], np.int64)}, opset=18)
    _, after = check_pass(gather_as_slice, m, {"x": rand(3, 4, 5)})
    assert ops(after) == ["Slice", "Squeeze", "Slice", "Squeeze", "Slice"]


def test_gather_of_several_indices_stays():
    m = model([helper.make_node("Gather", ["x", "i"], ["y"], axis=0)], [("x", [4, 2])], [("y", [2, 2])],
              {"i": np.array([3, 1], np.int64)}, opset=18)
    _, after = check_pass(gather_as_slice, m, {"x": rand(4, 2)})
    assert ops(after) == ["Gather"]
