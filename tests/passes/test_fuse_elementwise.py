import numpy as np
import pytest
import torch

from kiln.kernels import elementwise
from kiln.passes import fuse_elementwise

from .util import check_pass, helper, model, onnx, ops, rand


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


def test_squeeze_excite_hard_sigmoid_and_scale_become_one_program():
    # MobileNetV3: x * HardSigmoid(conv(pool(x))), the scale [N, C, 1, 1] against [N, C, H, W]
    m = model([
        helper.make_node("Relu", ["s"], ["r"]),  # stands in for the convolution computing the scale
        helper.make_node("HardSigmoid", ["r"], ["h"], alpha=1 / 6, beta=0.5),
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Mul", ["e", "h"], ["y"]),
    ], [("x", [2, 4, 3, 3]), ("s", [2, 4, 1, 1])], [("y", [2, 4, 3, 3])])
    feeds = {"x": rand(2, 4, 3, 3), "s": rand(2, 4, 1, 1, seed=1)}
    _, after = check_pass(fuse_elementwise, m, feeds)
    assert ops(after) == ["kiln::Elementwise"]
    assert after.nodes[0].attrs["program"] == [
        "Relu t0 i0", f"HardSigmoid t1 t0 c{float(np.float32(1 / 6))!r} c0.5", "Exp t2 i1", "Mul t3 t2 t1"]
    # the program runs in the generated kernel on a channels-last x as the graph did
    x = torch.from_numpy(feeds["x"]).contiguous(memory_format=torch.channels_last)
    s = torch.from_numpy(feeds["s"])
    got = elementwise.run(after.nodes[0].attrs["program"], [s, x], block=32)
    want = torch.exp(x) * torch.clamp(torch.relu(s) / 6 + 0.5, 0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("opset", [9, 13])
def test_attributes_and_constant_operands_become_literals(opset):
    clip = (helper.make_node("Clip", ["a"], ["b"], min=-1.0, max=2.0) if opset < 11 else
            helper.make_node("Clip", ["a", "lo", "hi"], ["b"]))
    m = model([
        helper.make_node("LeakyRelu", ["x"], ["a"], alpha=0.2),
        clip,
        helper.make_node("Pow", ["b", "two"], ["c"]),
        helper.make_node("Elu", ["c"], ["d"]),
        helper.make_node("Softplus", ["d"], ["y"]),
    ], [("x", [3, 5])], [("y", [3, 5])],
        {"lo": np.array(-1.0, np.float32), "hi": np.array(2.0, np.float32), "two": np.array(2.0, np.float32)},
        opset=opset)
    _, after = check_pass(fuse_elementwise, m, {"x": rand(3, 5) * 3})
    assert ops(after) == ["kiln::Elementwise"]
    assert after.nodes[0].attrs["program"] == [
        f"LeakyRelu t0 i0 c{float(np.float32(0.2))!r}", "Clip t1 t0 c-1.0 c2.0", "Pow t2 t1 c2.0", "Elu t3 t2 c1.0",
        "Softplus t4 t3"]


def test_gelu_where_and_hard_swish():
    m = model([
        helper.make_node("Gelu", ["x"], ["g"], approximate="tanh"),
        helper.make_node("HardSwish", ["g"], ["h"]),
        helper.make_node("Greater", ["x", "zero"], ["mask"]),
        helper.make_node("Where", ["mask", "h", "ninf"], ["y"]),
    ], [("x", [4, 6])], [("y", [4, 6])], {"zero": np.array(0.0, np.float32), "ninf": np.array(-np.inf, np.float32)},
        opset=20)
    _, after = check_pass(fuse_elementwise, m, {"x": rand(4, 6)})
    assert ops(after) == ["Greater", "kiln::Elementwise"]
    assert after.nodes[1].attrs["program"] == ["GeluTanh t0 i0", "HardSwish t1 t0", "Where t2 i1 t1 c-inf"]


def test_what_a_program_cannot_carry_stays_outside():
    m = model([
        helper.make_node("Exp", ["x"], ["a"]),
        helper.make_node("Pow", ["a", "p"], ["b"]),  # a tensor exponent
        helper.make_node("Clip", ["b", "lo"], ["c"]),  # a tensor bound
        helper.make_node("Neg", ["c"], ["y"]),
    ], [("x", [5]), ("p", [5]), ("lo", [])], [("y", [5])])
    _, after = check_pass(fuse_elementwise, m, {"x": rand(5), "p": rand(5, seed=1), "lo": rand(seed=2)})
    assert ops(after) == ["Exp", "Pow", "Clip", "Neg"]


def test_a_lone_binary_op_between_two_activations_is_a_one_line_layer():
    # EfficientNet's squeeze-excite scale, a C2f residual: the op where broadcasts and strided views meet
    m = model([
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Split", ["a"], ["p", "q"], axis=1),
        helper.make_node("ReduceMean", ["p"], ["s"], axes=[2, 3]),
        helper.make_node("Mul", ["q", "s"], ["m"]),  # two computed activations: one line
        helper.make_node("Add", ["m", "x2"], ["y"]),  # alone (m is an output too) on a model input: stays an Add
    ], [("x", [2, 4, 3, 3]), ("x2", [2, 2, 3, 3])], [("y", [2, 2, 3, 3]), ("m", [2, 2, 3, 3])], opset=13)
    _, after = check_pass(fuse_elementwise, m, {"x": rand(2, 4, 3, 3), "x2": rand(2, 2, 3, 3, seed=1)})
    assert ops(after) == ["Relu", "Split", "ReduceMean", "kiln::Elementwise", "Add"]
    assert after.nodes[3].attrs["program"] == ["Mul t0 i0 i1"]


def test_a_lone_op_on_shape_arithmetic_stays():
    m = model([
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Cast", ["s"], ["f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["f"], ["n"], keepdims=0),
        helper.make_node("Mul", ["a", "n"], ["y"]),  # alone (a is an output too); n comes from the shape
    ], [("x", [2, 3])], [("y", [2, 3]), ("a", [2, 3])], opset=13)
    _, after = check_pass(fuse_elementwise, m, {"x": rand(2, 3)})
    assert ops(after)[-1] == "Mul"
