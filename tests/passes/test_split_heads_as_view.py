import numpy as np

from kiln.passes import split_heads_as_view

from .util import check_pass, helper, model, ops, rand


def _chain(second):
    return model([
        helper.make_node("Reshape", ["x", "merge"], ["m"]),  # [S, B*H, D]
        helper.make_node("Transpose", ["m"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "split"], ["y"]),
    ], [("x", [5, 2, 12])], [("y", None)],
        {"merge": np.array([5, -1, 4], np.int64), "split": np.array(second, np.int64)})


def test_sequence_first_head_split_becomes_a_view():
    # nn.MultiheadAttention: [S=5, B=2, E=12] -> [B, H=3, S, D=4]
    _, after = check_pass(split_heads_as_view, _chain([-1, 3, 5, 4]), {"x": rand(5, 2, 12)})
    assert ops(after) == ["Reshape", "Transpose"]
    assert after.nodes[1].attrs["perm"] == [1, 2, 0, 3]


def test_other_regroupings_stay():
    _, after = check_pass(split_heads_as_view, _chain([-1, 3, 4, 5]), {"x": rand(5, 2, 12)})  # S and D swapped
    assert ops(after) == ["Reshape", "Transpose", "Reshape"]
