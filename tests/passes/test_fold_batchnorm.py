import numpy as np

from kiln.passes import fold_batchnorm

from .util import check_pass, helper, model, ops, rand


def _bn_inits(c):
    return {"g": 1 + 0.1 * rand(c, seed=2), "b": rand(c, seed=3), "m": rand(c, seed=4),
            "v": (1 + np.abs(rand(c, seed=5))).astype(np.float32)}


def test_batchnorm_folds_into_conv():
    m = model([
        helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], epsilon=1e-3),
    ], [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])], {"w": rand(4, 3, 3, 3), "cb": rand(4, seed=1), **_bn_inits(4)})
    _, after = check_pass(fold_batchnorm, m, {"x": rand(1, 3, 8, 8, seed=9)}, atol=1e-4)
    assert ops(after) == ["Conv"]
    assert after.nodes[0].sources == ["Conv_0", "BatchNormalization_1"]


def test_batchnorm_folds_into_gemm_with_transposed_weight():
    m = model([
        helper.make_node("Gemm", ["x", "w"], ["c"], transB=1),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]),
    ], [("x", [2, 6])], [("y", [2, 4])], {"w": rand(4, 6), **_bn_inits(4)})
    _, after = check_pass(fold_batchnorm, m, {"x": rand(2, 6, seed=9)}, atol=1e-4)
    assert ops(after) == ["Gemm"]


def test_conv_read_twice_is_not_folded_and_says_why():
    m = model([
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"]),
        helper.make_node("Relu", ["c"], ["z"]),
    ], [("x", [1, 3, 4, 4])], [("y", [1, 4, 4, 4]), ("z", [1, 4, 4, 4])], {"w": rand(4, 3, 1, 1), **_bn_inits(4)})
    _, after = check_pass(fold_batchnorm, m, {"x": rand(1, 3, 4, 4)})
    assert "BatchNormalization" in ops(after)
    assert after.findings[0]["reason"] == "Conv output has 2 readers"
