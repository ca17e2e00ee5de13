from kiln.passes import remove_noops

from .util import check_pass, helper, model, ops, rand


def test_identity_dropout_and_cancelling_transposes_go():
    m = model([
        helper.make_node("Identity", ["x"], ["a"]),
        helper.make_node("Dropout", ["a"], ["b"]),
        helper.make_node("Transpose", ["b"], ["c"], perm=[1, 2, 0]),
        helper.make_node("Transpose", ["c"], ["d"], perm=[2, 0, 1]),
        helper.make_node("Relu", ["d"], ["y"]),
    ], [("x", [2, 3, 4])], [("y", [2, 3, 4])])
    _, after = check_pass(remove_noops, m, {"x": rand(2, 3, 4)})
    assert ops(after) == ["Relu"]
    assert after.nodes[0].inputs == ["x"]


def test_identity_producing_a_graph_output_stays():
    m = model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["y"])],
              [("x", [4])], [("y", [4])])
    _, after = check_pass(remove_noops, m, {"x": rand(4)})
    assert ops(after) == ["Relu", "Identity"]
