from kiln.passes import fold_constants

from .util import check_pass, helper, model, ops, rand


def test_constant_subgraph_becomes_a_weight():
    m = model([
        helper.make_node("Constant", [], ["c"], value_float=2.0),
        helper.make_node("Mul", ["w", "c"], ["w2"]),  # weights only: folded
        helper.make_node("Add", ["x", "w2"], ["y"]),  # reads an input: kept
    ], [("x", [4])], [("y", [4])], {"w": rand(4)})
    _, after = check_pass(fold_constants, m, {"x": rand(4, seed=1)})
    assert ops(after) == ["Add"]
    assert "w2" in after.initializers


def test_shape_of_an_activation_is_not_folded():
    m = model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])],
              [("x", ["N", 4])], [("y", ["N", 4])])
    _, after = check_pass(fold_constants, m, {"x": rand(3, 4)})
    assert ops(after) == ["Shape", "Reshape"]
