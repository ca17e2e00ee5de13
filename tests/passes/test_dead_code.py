from kiln.passes import dead_code

from .util import check_pass, helper, model, ops, rand


def test_unread_nodes_and_weights_are_dropped():
    m = model([
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Add", ["x", "w"], ["unused"]),
    ], [("x", [4])], [("y", [4])], {"w": rand(4)})
    _, after = check_pass(dead_code, m, {"x": rand(4)})
    assert ops(after) == ["Relu"] and after.initializers == {}
