from kiln.passes import fuse_skip_layernorm

from .util import check_pass, helper, model, ops, rand


def test_residual_add_and_layernorm_fuse_and_keep_the_sum():
    m = model([
        helper.make_node("Add", ["x", "r"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
        helper.make_node("Relu", ["s"], ["z"]),  # the residual stream is read again
    ], [("x", [2, 3, 8]), ("r", [2, 3, 8])], [("y", [2, 3, 8]), ("z", [2, 3, 8])],
        {"g": rand(8), "b": rand(8, seed=1)})
    _, after = check_pass(fuse_skip_layernorm, m, {"x": rand(2, 3, 8, seed=2), "r": rand(2, 3, 8, seed=3)}, atol=1e-5)
    assert ops(after) == ["kiln::SkipLayerNorm", "Relu"]
    assert after.nodes[0].outputs == ["y", "s"]
