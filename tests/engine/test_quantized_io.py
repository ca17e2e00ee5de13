"""8-bit activations between quantized layers (kiln/builder/quantized_io.py), against onnxruntime."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tools.compare import compare

from ..models import residual_blocks


def _layer_values(engine, feeds) -> dict:
    """Every layer output of one layer-by-layer run of the engine on feeds, by name."""
    seen = {}

    def observe(node, outs):  # called before each layer (outs None) and after it
        if outs is not None:
            seen.update(zip(node.outputs, outs))

    engine.create_execution_context().run_layerwise(feeds, observe)
    return seen


def _qdq_conv_chain():
    """x -> Q/DQ(s1) -> Conv -> Relu -> Q/DQ(s2) -> Conv -> Relu -> y, as onnxruntime's quantizer writes it;
    the middle activation also feeds a float Add when `shared` (then it must stay float)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.float32(s), n) for n, s in (("s1", 0.03), ("s2", 0.05))]
    inits += [numpy_helper.from_array(np.int8(0), "z0"), numpy_helper.from_array(np.zeros(8, np.int8), "zw")]
    for i in (1, 2):
        inits += [numpy_helper.from_array(rng.integers(-127, 128, (8, 8 if i == 2 else 3, 3, 3)).astype(np.int8),
                                          f"w{i}"),
                  numpy_helper.from_array(rng.uniform(0.002, 0.01, 8).astype(np.float32), f"sw{i}"),
                  numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), f"b{i}")]
    nodes = []
    for i, (src, scale) in enumerate((("x", "s1"), ("r1", "s2")), start=1):
        nodes += [helper.make_node("QuantizeLinear", [src, scale, "z0"], [f"q{i}"]),
                  helper.make_node("DequantizeLinear", [f"q{i}", scale, "z0"], [f"d{i}"]),
                  helper.make_node("DequantizeLinear", [f"w{i}", f"sw{i}", "zw"], [f"wd{i}"], axis=0),
                  helper.make_node("Conv", [f"d{i}", f"wd{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
                          [helper.make_tensor_value_info("r2", TensorProto.FLOAT, ["N", 8, 6, 6])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_quantized_layers_pass_int8_activations_and_still_match_onnxruntime():
    model = _qdq_conv_chain()
    prof = kiln.Profile({"x": ((1, 3, 6, 6), (2, 3, 6, 6), (4, 3, 6, 6))})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof]))
    first, second = [n for n in engine.graph.nodes if n.op_type == "QConv"]
    assert first.inputs[6] == second.inputs[2]  # the first quantizes its output with the second's input scale
    assert second.attrs["x_quantized"] == 1 and "x_quantized" not in first.attrs
    x = np.random.default_rng(1).standard_normal((3, 3, 6, 6)).astype(np.float32)
    seen = _layer_values(engine, {"x": x})
    assert str(seen["r1"].dtype) == "torch.int8"  # one byte per element between the two layers
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = engine.create_execution_context().run({"x": x})["r2"]
    # onnxruntime rounds r1 to the same int8 grid; the engine differs only where its float epilogue lands
    # within an ulp of a rounding tie: at most one quantization step of r1 times the second conv's weights.
    assert np.abs(got - ref).max() <= 0.1 * max(1.0, np.abs(ref).max())
    result = compare(model, engine, [{"x": x}], layerwise=True)  # the int8 tensor is scaled back to compare
    assert result.outputs[0].passed and all(layer.passed for layer in result.layers)


def test_a_quantized_layer_reading_the_fp32_input_writes_the_engines_float_type():
    """In an FP16 engine the first convolution reads the FP32 graph input; its float output is FP16 like every
    other layer's, not FP32 that the next FP16 layer would cast back."""
    model = _qdq_conv_chain()
    at = next(i for i, n in enumerate(model.graph.node) if n.output == ["r1"])
    del model.graph.node[at]  # r1 now comes from a float AveragePool, so the first conv writes float
    model.graph.node.insert(at, helper.make_node("AveragePool", ["c1"], ["r1"], kernel_shape=[1, 1]))
    prof = kiln.Profile({"x": ((1, 3, 6, 6), (2, 3, 6, 6), (4, 3, 6, 6))})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], fp16=True))
    first = next(n for n in engine.graph.nodes if n.op_type == "QConv")
    seen = _layer_values(engine, {"x": np.ones((2, 3, 6, 6), np.float32)})
    assert seen[first.outputs[0]].dtype == torch.float16


def _residual_block(skip=True):
    """y = LayerNorm(a + b); out = MatMul(y, w) + c + y: y is read by a GEMM (quantized in an INT8 build)
    and as a float residual, as BERT reads each LayerNorm's output. skip=False: y = LayerNorm(a), as BERT's
    embedding norm."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "beta"),
             numpy_helper.from_array((rng.standard_normal((16, 16)) / 4).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "c")]
    nodes = [helper.make_node("Add", ["a", "b"], ["s"])] if skip else []
    nodes += [helper.make_node("LayerNormalization", ["s" if skip else "a", "gamma", "beta"], ["y"], axis=-1),
              helper.make_node("MatMul", ["y", "w"], ["h"]), helper.make_node("Add", ["h", "c"], ["hc"]),
              helper.make_node("Add", ["hc", "y"], ["out"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 8, 16]) for n in ("a", "b", "out")]
    g = helper.make_graph(nodes, "block", io[:2] if skip else io[:1], io[2:], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("skip", [True, False], ids=["add+norm", "norm alone"])
def test_a_layernorm_read_as_float_and_by_a_quantized_gemm_writes_both(tmp_path, skip):
    """A norm without the add before it (a plain LayerNormalization) gets the 8-bit copy too, as a SkipLayerNorm
    without the skip: BERT's first QKV GEMM needs no quantize pass of its own."""
    model = _residual_block(skip)
    rng = np.random.default_rng(1)
    names = "ab" if skip else "a"
    feeds = lambda n: {k: rng.standard_normal((n, 8, 16)).astype(np.float32) for k in names}  # noqa: E731
    prof = kiln.Profile({k: ((1, 8, 16), (2, 8, 16), (4, 8, 16)) for k in names})
    # Entropy calibration on 8 samples clips the plain norm's rows hard (10% of the range off onnxruntime, with
    # or without the copy); the largest value calibration saw keeps it at 1%.
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], int8=True,
                                                calib=[feeds(2) for _ in range(8)],
                                                calib_method="entropy" if skip else "minmax"))
    ln, gemm = [n for n in engine.graph.nodes if n.op_type in ("SkipLayerNorm", "QGemm")]
    assert ln.outputs[2] == gemm.inputs[0] == "y.int8" and ln.inputs[4] == gemm.inputs[2]
    assert (ln.inputs[1] == "") != skip
    assert gemm.attrs["x_quantized"] == 1 and ln.attrs["qtype"] == "int8"
    x = feeds(3)
    seen = _layer_values(engine, x)
    assert seen["y.int8"].dtype == torch.int8 and seen["y"].dtype == torch.float32  # both copies
    scale = engine.graph.initializers[ln.inputs[4]]
    assert torch.equal(seen["y.int8"], torch.clamp(torch.round(seen["y"] / scale), -128, 127).to(torch.int8))
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    got = engine.create_execution_context().run(x)["out"]
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()  # INT8 GEMM error only
    assert compare(model, engine, [x], layerwise=True).outputs[0].passed
    engine.save(tmp_path / "block.kiln")  # the extra output survives the engine file
    again = kiln.load(tmp_path / "block.kiln")
    assert [n.outputs for n in again.graph.nodes] == [n.outputs for n in engine.graph.nodes]
    np.testing.assert_array_equal(again.create_execution_context().run(x)["out"], got)


def test_only_a_last_axis_norm_with_fp32_statistics_and_one_output_becomes_a_skip_layer_norm():
    """What kiln::SkipLayerNorm computes without its skip: LayerNormalization over the last axis, statistics in FP32,
    no Mean/InvStdDev outputs read."""
    from kiln.builder.quantized_io import _plain_norm
    from kiln.ir.graph import Node

    def norm(outputs=("y",), **attrs):
        return Node("LayerNormalization", ["x", "gamma", "beta"], list(outputs), attrs)

    assert _plain_norm(norm()) and _plain_norm(norm(axis=-1, stash_type=1)) and _plain_norm(norm(("y", "", "")))
    assert not _plain_norm(norm(axis=1))  # over more than the last axis (or a rank we would have to know)
    assert not _plain_norm(norm(stash_type=0))  # statistics in the input's type
    assert not _plain_norm(norm(("y", "mean")))  # Mean read by another layer


def _resnet_block():
    """o = Relu(Conv_a(x)); out = Relu(Conv_c(Relu(Conv_b(o))) + o): o is read by Conv_b and as the residual."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    for name, c_in, k in (("a", 4, 3), ("b", 8, 3), ("c", 8, 1)):  # a: 4 channels, enough to quantize
        inits += [numpy_helper.from_array((rng.standard_normal((8, c_in, k, k)) / (c_in * k)).astype(np.float32),
                                          f"w{name}"),
                  numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) / 4, f"b{name}")]
    pads = {"pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["ca"], **pads), helper.make_node("Relu", ["ca"], ["o"]),
             helper.make_node("Conv", ["o", "wb", "bb"], ["cb"], **pads), helper.make_node("Relu", ["cb"], ["p"]),
             helper.make_node("Conv", ["p", "wc", "bc"], ["cc"]), helper.make_node("Add", ["cc", "o"], ["s"]),
             helper.make_node("Relu", ["s"], ["out"])]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 8, 6, 6])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _int8_build(model, seed, method, batch=2):
    rng = np.random.default_rng(seed)
    calib = [{"x": rng.standard_normal((batch, 4, 6, 6)).astype(np.float32)} for _ in range(64)]
    prof = kiln.Profile({"x": ((batch, 4, 6, 6),) * 3})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], int8=True,
                                                calib=calib, calib_method=method))
    x = rng.standard_normal((batch, 4, 6, 6)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return engine, x, ref


def _stem_pool(c: int = 8, size: int = 8, stride: int = 1):
    """ResNet's stem: a convolution over 3 channels (3x3, or with stride 2 7x7 as ResNet's), ReLU, a 3x3 stride-2 max
    pool, read by a block's first convolution and by its downsampling one; out = Relu(Conv_b(p) + Conv_d(p));
    x [N, 3, size, size]."""
    rng = np.random.default_rng(3)
    k = 3 if stride == 1 else 7
    inits = [numpy_helper.from_array((rng.standard_normal((c, 3, k, k)) / (3 * k)).astype(np.float32), "ws"),
             numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) / c).astype(np.float32), "wb"),
             numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) / c).astype(np.float32), "wd")]
    nodes = [helper.make_node("Conv", ["x", "ws"], ["c"], name="stem", pads=[k // 2] * 4, strides=[stride] * 2),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p", "wb"], ["b"]), helper.make_node("Conv", ["p", "wd"], ["d"]),
             helper.make_node("Add", ["b", "d"], ["s"]), helper.make_node("Relu", ["s"], ["out"])]
    out = size // (2 * stride)
    g = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", c, out, out])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_a_stride_2_rgb_stem_runs_as_an_8_bit_convolution_over_8_bit_patches(qtype):
    """passes/stem_patches.py: the 7x7 stride-2 stem reads its image as 8-bit patches, which the patches quantize
    themselves, and writes its output as 8-bit values for the max pool after it, at the pool's output scale."""
    model = _stem_pool(size=16, stride=2)
    rng = np.random.default_rng(6)
    calib = [{"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)} for _ in range(32)]
    prof = kiln.Profile({"x": ((2, 3, 16, 16),) * 3})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], calib=calib,
                                                **{qtype: True}))
    patches = next(n for n in engine.graph.nodes if n.op_type == "StemPatches")
    stem = next(n for n in engine.graph.nodes if n.op_type == "QConv" and n.inputs[0] == patches.outputs[0])
    assert stem.attrs["x_quantized"] == 1 and stem.precision == qtype and not stem.note
    assert patches.inputs[1] == stem.inputs[2] and patches.attrs["qtype"] == qtype  # its scale, its type
    pool = next(n for n in engine.graph.nodes if n.op_type == "MaxPool")
    assert pool.inputs[0] == stem.outputs[0] and pool.attrs["x_quantized"] == 1 and stem.inputs[6] == pool.inputs[1]
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    seen = _layer_values(engine, {"x": x})
    assert seen[patches.outputs[0]].dtype == seen[stem.outputs[0]].dtype == {"int8": torch.int8,
                                                                            "fp8": torch.float8_e4m3fn}[qtype]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = engine.create_execution_context().run({"x": x})["out"]
    assert np.abs(got - ref).max() <= (0.05 if qtype == "int8" else 0.1) * np.abs(ref).max()


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_a_max_pool_read_only_by_quantized_convolutions_writes_their_8_bit_input(qtype):
    model = _stem_pool()
    rng = np.random.default_rng(4)
    calib = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(32)]
    prof = kiln.Profile({"x": ((2, 3, 8, 8),) * 3})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], calib=calib,
                                                calib_method="minmax", **{qtype: True}))
    pool = next(n for n in engine.graph.nodes if n.op_type == "MaxPool")
    readers = [n for n in engine.graph.nodes if n.op_type == "QConv" and n.inputs[0] == "p"]
    assert len(readers) == 2 and all(r.attrs["x_quantized"] == 1 for r in readers)
    assert pool.inputs[1] == readers[0].inputs[2] and pool.attrs["qtype"] == qtype  # their scale, their type
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    seen = _layer_values(engine, {"x": x})
    assert seen["p"].dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[qtype]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = engine.create_execution_context().run({"x": x})["out"]
    assert np.abs(got - ref).max() <= (0.05 if qtype == "int8" else 0.1) * np.abs(ref).max()
    result = compare(model, engine, [{"x": x}], layerwise=True)  # the pool's 8-bit values are scaled back
    assert result.outputs[0].passed and all(layer.passed for layer in result.layers), result.layers


@pytest.mark.parametrize("qtype", ["int8", "fp8"])
def test_a_shortcut_read_only_as_a_residual_is_written_in_8_bits_at_its_calibrated_maximum(qtype):
    """In the stem-pool model one 1x1 convolution adds the other's output as its residual (a ResNet stage's
    downsampling shortcut): that output travels as 8-bit values at the scale of its calibrated maximum."""
    model = _stem_pool()
    rng = np.random.default_rng(5)
    calib = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(32)]
    prof = kiln.Profile({"x": ((2, 3, 8, 8),) * 3})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], calib=calib,
                                                **{qtype: True}))
    adder = next(n for n in engine.graph.nodes if n.op_type == "QConv" and len(n.inputs) > 5 and n.inputs[5])
    shortcut = next(n for n in engine.graph.nodes if n.op_type == "QConv" and n.outputs[0] == adder.inputs[5])
    scale = shortcut.inputs[6]
    assert scale.endswith(".shortcut_scale") and adder.inputs[8] == scale  # written and read back at one scale
    seen_max = engine.graph.quant_absmax[adder.inputs[5]]
    qmax = 127.0 if qtype == "int8" else 448.0
    assert float(engine.graph.initializers[scale]) == pytest.approx(seen_max / qmax, rel=1e-6)  # no clipping
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = engine.create_execution_context().run({"x": x})["out"]
    assert np.abs(got - ref).max() <= (0.05 if qtype == "int8" else 0.1) * np.abs(ref).max()


def test_a_max_pool_also_read_as_float_stays_float():
    model = _stem_pool()
    model.graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 8, 4, 4]))
    rng = np.random.default_rng(4)
    calib = [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(32)]
    prof = kiln.Profile({"x": ((2, 3, 8, 8),) * 3})
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], calib=calib,
                                                int8=True))
    pool = next(n for n in engine.graph.nodes if n.op_type == "MaxPool")
    assert pool.inputs == ["r"] and "qtype" not in pool.attrs


def test_a_block_output_read_as_residual_and_by_the_next_conv_is_written_once_in_8_bits():
    """MinMax calibration: the next convolution's input scale covers every value of o, so the residual is that
    8-bit copy too and o is written once."""
    model = _resnet_block()
    engine, x, ref = _int8_build(model, 2, "minmax")
    a, b, c = [n for n in engine.graph.nodes if n.op_type == "QConv"]
    # o is read by b (quantized with b's input scale) and as c's residual: a writes it once, as int8
    assert a.outputs == ["o.int8"] and a.inputs[6] == b.inputs[2] and a.inputs[7:] == [""]
    assert b.inputs[0] == "o.int8" and b.attrs["x_quantized"] == 1
    assert c.inputs[5] == "o.int8" and c.inputs[8] == b.inputs[2]  # the residual scaled back in c's epilogue
    assert c.inputs[0] == "p" and c.attrs["x_quantized"] == 1 and b.inputs[6] == c.inputs[2]  # b -> c: int8 only
    got = engine.create_execution_context().run({"x": x})["out"]
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()
    assert compare(model, engine, [{"x": x}], layerwise=True).outputs[0].passed


def test_a_residual_the_copys_scale_would_clip_widens_that_scale():
    """Entropy calibration clips o's tail for b's input; as o is also c's residual, the copy's scale is widened to
    the calibrated maximum, for b too, and o is still written once, in 8 bits."""
    model = _resnet_block()
    narrow = _int8_build(model, 2, "minmax")[0].graph.quant_absmax["o"] / 127
    engine, x, ref = _int8_build(model, 2, "entropy")
    a, b, c = [n for n in engine.graph.nodes if n.op_type == "QConv"]
    assert a.outputs == ["o.int8"] and a.inputs[6] == b.inputs[2] == c.inputs[8] == "o.block_scale"
    assert c.inputs[5] == "o.int8"
    wide = float(engine.graph.initializers["o.block_scale"])
    assert wide * 127 == pytest.approx(engine.graph.quant_absmax["o"]) and wide == pytest.approx(narrow)
    assert "widened" in a.note
    got = engine.create_execution_context().run({"x": x})["out"]
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()
    assert compare(model, engine, [{"x": x}], layerwise=True).outputs[0].passed


def test_a_block_output_also_read_as_float_keeps_it():
    model = _resnet_block()
    model.graph.output.append(helper.make_tensor_value_info("o", TensorProto.FLOAT, ["N", 8, 6, 6]))
    engine, x, _ = _int8_build(model, 3, "minmax")
    a, b, c = [n for n in engine.graph.nodes if n.op_type == "QConv"]
    assert a.outputs == ["o", "o.int8"] and a.inputs[7] == b.inputs[2]  # float o for the model's output
    assert c.inputs[5] == "o.int8" and c.inputs[8] == a.inputs[7]  # the residual reads the copy, which covers o
    assert compare(model, engine, [{"x": x}]).passed
    engine, x, _ = _int8_build(model, 3, "entropy")
    a, b, c = [n for n in engine.graph.nodes if n.op_type == "QConv"]
    assert a.outputs == ["o", "o.int8"] and c.inputs[5] == "o.int8"  # the copy's scale, widened, covers o too
    assert a.inputs[7] == b.inputs[2] == c.inputs[8] == "o.block_scale"
    assert compare(model, engine, [{"x": x}]).passed


@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_a_block_between_two_others_reads_and_writes_8_bit_residuals(method):
    """The middle block's last convolution reads an 8-bit residual (its z_scale) and writes 8-bit values only."""
    model = residual_blocks(3)
    engine, x, ref = _int8_build(model, 6, method)
    last = {n.inputs[0]: n for n in engine.graph.nodes if n.op_type == "QConv" and n.inputs[0].startswith("p")}
    middle = last["p2"]
    assert middle.inputs[5].startswith("o1.") and middle.inputs[8]
    assert all(o.startswith("o2.") for o in middle.outputs) and middle.inputs[6]  # y_scale: written as int8
    assert middle.outputs == ["o2.int8"] and not middle.inputs[7]  # the copy is the residual: one output
    got = engine.create_execution_context().run({"x": x})["o3"]
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()


def test_a_json_calibration_cache_rebuilds_the_same_residuals_and_a_tensorrt_one_keeps_them_float(tmp_path):
    """The residual's own scale comes from the largest value calibration saw: Kiln's JSON cache keeps it, so a
    rebuild from it is the same engine; TensorRT's text cache holds scales only, so residuals stay float."""
    model = residual_blocks(2)
    rng = np.random.default_rng(8)
    calib = [{"x": rng.standard_normal((2, 4, 6, 6)).astype(np.float32)} for _ in range(32)]
    prof = kiln.Profile({"x": ((2, 4, 6, 6),) * 3})
    x = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)

    def build(**kw):
        return kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], int8=True, **kw))

    def residuals(engine):  # (residual, its 8-bit scale or "") of every QConv adding one
        return [(n.inputs[5], (n.inputs + [""] * 9)[8]) for n in engine.graph.nodes
                if n.op_type == "QConv" and len(n.inputs) > 5 and n.inputs[5]]

    first = build(calib=calib, calib_cache=str(tmp_path / "c.json"))
    again = build(calib_cache=str(tmp_path / "c.json"))
    assert residuals(first) == residuals(again) and all(scale for _, scale in residuals(first))
    np.testing.assert_array_equal(first.create_execution_context().run({"x": x})["o2"],
                                  again.create_execution_context().run({"x": x})["o2"])
    build(calib=calib, calib_cache=str(tmp_path / "c.cache"))  # the same calibration in TensorRT's text form
    trt = build(calib_cache=str(tmp_path / "c.cache"))
    assert residuals(trt) and not any(scale for _, scale in residuals(trt))  # no statistics: float residuals


class _SelfAttention(torch.nn.Module):
    """BERT's attention: QKV projections, heads split, softmax(q k^T / sqrt(d)) v, heads merged, projection."""

    def __init__(self, width=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(3))
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = (p(x).view(b, s, self.heads, w // self.heads).transpose(1, 2) for p in self.qkv)
        a = torch.softmax(q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5, dim=-1) @ v
        return self.out(a.transpose(1, 2).reshape(b, s, w))


def _attention_engine(qtype: str):
    """(model, engine, feeds): _SelfAttention built for the CPU target with qtype, calibrated on 50 batches."""
    torch.manual_seed(0)
    model, _ = kiln.from_torch(_SelfAttention().eval(), (torch.randn(2, 8, 32),), opset=18)
    rng = np.random.default_rng(0)
    calib = [{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(50)]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, calib=calib, **{qtype: True}))
    return model, engine, {"x": rng.standard_normal((2, 8, 32)).astype(np.float32)}


def _matches_onnxruntime_and_its_file(tmp_path, model, engine, feeds, tol: float) -> None:
    """Within tol of onnxruntime's range, and the same after a save and load (the scale inputs survive the file)."""
    name = model.graph.input[0].name
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {name: feeds["x"]})[0]
    got = engine.create_execution_context().run({name: feeds["x"]})[engine.outputs[0].name]
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
    engine.save(tmp_path / "attention.kiln")
    again = kiln.load(tmp_path / "attention.kiln")
    np.testing.assert_array_equal(again.create_execution_context().run({name: feeds["x"]})[engine.outputs[0].name],
                                  got)


def test_an_attention_read_by_a_quantized_projection_writes_its_8_bit_input(tmp_path):
    model, engine, feeds = _attention_engine("int8")
    attention = next(n for n in engine.graph.nodes if n.op_type == "Attention")
    projection = engine.graph.nodes[-1]
    assert projection.op_type == "QGemm" and projection.attrs["x_quantized"] == 1
    assert attention.inputs[4] == projection.inputs[2] and attention.attrs["qtype"] == "int8"
    # through the head merge's views to the projection
    assert _layer_values(engine, feeds)[attention.outputs[0]].dtype == torch.int8
    _matches_onnxruntime_and_its_file(tmp_path, model, engine, feeds, 0.05)  # INT8 GEMM error only
    name = model.graph.input[0].name
    assert compare(model, engine, [{name: feeds["x"]}], layerwise=True).outputs[0].passed


def test_an_fp8_attention_reads_q_k_and_v_as_the_fp8_output_of_their_merged_projection(tmp_path):
    """FP8 engine: the merged QKV projection writes FP8 codes of one scale (the calibrated maximum of its output),
    which pass the Split and the head views as they are and which the attention reads with that scale."""
    model, engine, feeds = _attention_engine("fp8")
    attention = next(n for n in engine.graph.nodes if n.op_type == "Attention")
    qkv = next(n for n in engine.graph.nodes if n.op_type == "QGemm")
    assert qkv.inputs[5] == attention.inputs[5] == f"{qkv.outputs[0]}.fp8_scale"
    scale = float(engine.graph.initializers[attention.inputs[5]])
    assert scale * 448 == pytest.approx(engine.graph.quant_absmax[qkv.outputs[0]], rel=1e-6)
    seen = _layer_values(engine, feeds)
    assert all(seen[v].dtype == torch.float8_e4m3fn for v in [qkv.outputs[0], *attention.inputs[:3]])
    _matches_onnxruntime_and_its_file(tmp_path, model, engine, feeds, 0.1)  # FP8's 3-bit mantissa


class _SelfAttentionAlsoReturningQ(_SelfAttention):
    def forward(self, x):
        return super().forward(x), self.qkv[0](x)


def test_an_fp8_attention_keeps_float_q_k_v_when_a_projection_is_also_read_elsewhere():
    """q's projection is also a model output: it must stay float, so the merged projection writes float values
    and the attention reads them as such."""
    torch.manual_seed(0)
    model, _ = kiln.from_torch(_SelfAttentionAlsoReturningQ().eval(), (torch.randn(2, 8, 32),), opset=18)
    rng = np.random.default_rng(0)
    calib = [{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(50)]
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, calib=calib, fp8=True))
    attention = next(n for n in engine.graph.nodes if n.op_type == "Attention")
    assert len(attention.inputs) < 6 or not attention.inputs[5]
    feeds = {"x": rng.standard_normal((2, 8, 32)).astype(np.float32)}
    name = model.graph.input[0].name
    refs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {name: feeds["x"]})
    got = engine.create_execution_context().run({name: feeds["x"]})
    for out, ref in zip(engine.outputs, refs):
        assert got[out.name].dtype == np.float32 and np.abs(got[out.name] - ref).max() <= 0.1 * np.abs(ref).max()
