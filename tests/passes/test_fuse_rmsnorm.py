import numpy as np

from kiln.passes import fuse_rmsnorm

from .util import check_pass, helper, model, ops, rand


def test_exported_rmsnorm_chain_becomes_one_layer():
    m = model([
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["xn", "g"], ["y"]),
    ], [("x", [2, 3, 16])], [("y", [2, 3, 16])],
        {"two": np.float32(2), "axes": np.array([-1], np.int64), "eps": np.float32(1e-6), "g": rand(16, seed=3)},
        opset=18)
    _, after = check_pass(fuse_rmsnorm, m, {"x": rand(2, 3, 16)}, atol=1e-5)
    assert ops(after) == ["kiln::RMSNorm"] and len(after.nodes[0].sources) == 7
    assert after.nodes[0].inputs == ["x", "g"]
