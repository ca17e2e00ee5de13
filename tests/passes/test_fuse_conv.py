from kiln.passes import fuse_conv

from .util import check_pass, helper, model, ops, rand

X = ("x", [1, 4, 6, 6])


def test_conv_add_relu_becomes_one_layer():
    m = model([
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Add", ["c", "x"], ["s"], name="residual"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ], [X], [("y", [1, 4, 6, 6])], {"w": rand(4, 4, 3, 3), "b": rand(4, seed=1)})
    _, after = check_pass(fuse_conv, m, {"x": rand(1, 4, 6, 6, seed=2)}, atol=1e-4)
    assert ops(after) == ["kiln::FusedConv"]
    fused = after.nodes[0]
    assert fused.name == "conv + residual + relu" and fused.attrs["activation"] == "Relu"
    assert fused.inputs == ["x", "w", "b", "x"]


def test_conv_silu_and_clip():
    for act_nodes, name in [
        ([helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])], "Silu"),
        ([helper.make_node("Clip", ["c", "lo", "hi"], ["y"])], "Clip"),
    ]:
        m = model([helper.make_node("Conv", ["x", "w"], ["c"])] + act_nodes, [X], [("y", [1, 2, 6, 6])],
                  {"w": rand(2, 4, 1, 1), "lo": rand(1).reshape(()) * 0, "hi": rand(1).reshape(()) * 0 + 6})
        _, after = check_pass(fuse_conv, m, {"x": rand(1, 4, 6, 6, seed=2)}, atol=1e-4)
        assert ops(after) == ["kiln::FusedConv"] and after.nodes[0].attrs["activation"] == name


def test_conv_output_read_twice_keeps_the_activation_separate():
    m = model([
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Relu", ["c"], ["y"]),
        helper.make_node("Neg", ["c"], ["z"]),
    ], [X], [("y", [1, 2, 6, 6]), ("z", [1, 2, 6, 6])], {"w": rand(2, 4, 1, 1)})
    _, after = check_pass(fuse_conv, m, {"x": rand(1, 4, 6, 6)})
    assert ops(after) == ["Conv", "Relu", "Neg"]
    assert after.findings and "2 readers" in after.findings[0]["reason"]


def test_conv_without_bias_gets_a_zero_bias():
    # torch's fused cuDNN calls would otherwise allocate and zero a bias on every call
    m = model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"])],
              [X], [("y", [1, 2, 6, 6])], {"w": rand(2, 4, 1, 1)})
    _, after = check_pass(fuse_conv, m, {"x": rand(1, 4, 6, 6, seed=2)}, atol=1e-4)
    fused = after.nodes[0]
    assert ops(after) == ["kiln::FusedConv"] and fused.inputs[2] == "conv.zero_bias"
    bias = after.initializers["conv.zero_bias"]
    assert bias.shape == (2,) and not bias.any()


def test_a_depthwise_conv_takes_its_hardswish_and_silu():
    """MobileNetV3's and EfficientNet's depthwise layers: the activation joins the grouped convolution, whose
    tactics (tactics/triton_conv.py) apply it in their epilogue."""
    for act_nodes, name in [
        ([helper.make_node("HardSwish", ["c"], ["y"])], "HardSwish"),
        ([helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])], "Silu"),
    ]:
        m = model([helper.make_node("Conv", ["x", "w", "b"], ["c"], group=4, pads=[1, 1, 1, 1])] + act_nodes, [X],
                  [("y", [1, 4, 6, 6])], {"w": rand(4, 1, 3, 3), "b": rand(4, seed=1)})
        _, after = check_pass(fuse_conv, m, {"x": rand(1, 4, 6, 6, seed=2)}, atol=1e-4)
        fused = after.nodes[0]
        assert ops(after) == ["kiln::FusedConv"] and fused.attrs["activation"] == name and fused.attrs["group"] == 4
