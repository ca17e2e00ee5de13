from kiln.passes import fuse_elementwise

from .util import check_pass, helper, model, ops, rand


def test_chain_becomes_one_program_with_inline_scalars():
    m = model([
        helper.make_node("Add", ["x", "r"], ["a"]),
        helper.make_node("Mul", ["a", "half"], ["b"]),
        helper.make_node("Sigmoid", ["b"], ["c"]),
        helper.make_node("Mul", ["c", "x"], ["y"]),
    ], [("x", [3, 5]), ("r", [3, 5])], [("y", [3, 5])], {"half": rand(1).reshape(()) * 0 + 0.5})
    _, after = check_pass(fuse_elementwise, m, {"x": rand(3, 5), "r": rand(3, 5, seed=1)})
    assert ops(after) == ["kiln::Elementwise"]
    assert after.nodes[0].attrs["program"] == ["Add t0 i0 i1", "Mul t1 t0 c0.5", "Sigmoid t2 t1", "Mul t3 t2 i0"]


def test_value_read_outside_the_chain_ends_the_region():
    m = model([
        helper.make_node("Exp", ["x"], ["a"]),
        helper.make_node("Neg", ["a"], ["y"]),
    ], [("x", [4])], [("y", [4]), ("a", [4])])
    _, after = check_pass(fuse_elementwise, m, {"x": rand(4)})
    assert ops(after) == ["Exp", "Neg"]
