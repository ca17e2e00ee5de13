from kiln.passes import fuse_gemm, merge_parallel_gemms

from .util import check_pass, helper, model, ops, rand


def test_q_k_v_projections_merge_into_one_gemm_and_split():
    nodes, inits = [], {}
    for i, name in enumerate("qkv"):
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"m{name}"]),
                  helper.make_node("Add", [f"m{name}", f"b{name}"], [name]),
                  helper.make_node("Neg", [name], [f"{name}_out"])]  # each read right after it is made
        inits[f"w{name}"], inits[f"b{name}"] = rand(8, 6, seed=i), rand(6, seed=10 + i)
    m = model(nodes, [("x", [2, 5, 8])], [(f"{n}_out", [2, 5, 6]) for n in "qkv"], inits)

    class Both:
        @staticmethod
        def run(g):
            fuse_gemm.run(g)
            merge_parallel_gemms.run(g)

    _, after = check_pass(Both, m, {"x": rand(2, 5, 8, seed=3)}, atol=1e-4)
    assert ops(after) == ["kiln::FusedGemm", "Split", "Neg", "Neg", "Neg"]
    assert tuple(after.initializers[after.nodes[0].inputs[1]].shape) == (8, 18)


def _qdq_projections(same_weight_scale: bool):
    """x -> Q/DQ(sx) -> three MatMul+Add on int8 weights (per-tensor scales), as quantizers write Q/K/V."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "z"], ["xd"])]
    inits = {"sx": np.float32(0.04), "z": np.zeros((), np.int8)}
    for i, name in enumerate("qkv"):
        inits[f"w{name}"] = rng.integers(-127, 128, (16, 8)).astype(np.int8)
        inits[f"s{name}"] = np.float32(0.01 if same_weight_scale else 0.01 * (i + 1))
        inits[f"b{name}"] = rng.standard_normal(8).astype(np.float32)
        nodes += [helper.make_node("DequantizeLinear", [f"w{name}", f"s{name}", "z"], [f"wd{name}"]),
                  helper.make_node("MatMul", ["xd", f"wd{name}"], [f"m{name}"]),
                  helper.make_node("Add", [f"m{name}", f"b{name}"], [name])]
    g = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 8]) for n in "qkv"],
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _build(model, **kw):
    import kiln

    prof = kiln.Profile({"x": ((1, 16), (4, 16), (8, 16))})
    return kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, profiles=[prof], **kw))


def _ort(model, x):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_quantized_projections_merge_when_they_quantize_their_input_alike():
    import numpy as np

    x = np.random.default_rng(1).standard_normal((6, 16)).astype(np.float32)
    for same in (True, False):
        model = _qdq_projections(same)
        engine = _build(model)
        assert [n.op_type for n in engine.graph.nodes] == ["QGemm", "Split"]
        scale = engine.graph.initializers[engine.graph.nodes[0].inputs[3]]
        assert scale.numel() == (1 if same else 24)  # one shared scale stays one (cuBLASLt FP8 takes only that)
        got = engine.create_execution_context().run({"x": x})
        for name, ref in zip("qkv", _ort(model, x)):
            np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_fp8_projections_calibrated_by_kiln_merge_too():
    import numpy as np

    nodes, inits = [], {}
    for i, name in enumerate("qkv"):
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"m{name}"]),
                  helper.make_node("Add", [f"m{name}", f"b{name}"], [name])]
        inits[f"w{name}"], inits[f"b{name}"] = rand(16, 8, seed=i) * (i + 1), rand(8, seed=10 + i)
    m = model(nodes, [("x", ["N", 16])], [(n, ["N", 8]) for n in "qkv"], inits)
    calib = [{"x": np.random.default_rng(s).standard_normal((4, 16)).astype(np.float32)} for s in range(8)]
    engine = _build(m, fp8=True, calib=calib)
    assert [n.op_type for n in engine.graph.nodes] == ["QGemm", "Split"]
    assert engine.graph.initializers[engine.graph.nodes[0].inputs[3]].numel() == 1  # one shared FP8 weight scale
    x = np.random.default_rng(9).standard_normal((6, 16)).astype(np.float32)
    got = engine.create_execution_context().run({"x": x})
    for name, ref in zip("qkv", _ort(m, x)):  # FP8: a few percent of the range
        assert np.abs(got[name] - ref).max() <= 0.1 * np.abs(ref).max(), name


class _FuseThenMerge:
    @staticmethod
    def run(g):
        fuse_gemm.run(g)
        merge_parallel_gemms.run(g)


def test_bias_free_matmuls_and_a_swiglu_gate_merge_into_one_matmul():
    """Llama's projections: q/k/v plain MatMuls -> one MatMul + Split; gate (SiLU epilogue) + up the same, the
    gate's SiLU applied to its slice."""
    nodes = [helper.make_node("MatMul", ["x", f"w{n}"], [f"m{n}"]) for n in "qkv"]
    nodes += [helper.make_node("Neg", [f"m{n}"], [n]) for n in "qkv"]  # a model output would be a FusedGemm
    nodes += [helper.make_node("MatMul", ["h", "wg"], ["g"]), helper.make_node("Sigmoid", ["g"], ["sg"]),
              helper.make_node("Mul", ["g", "sg"], ["silu"]), helper.make_node("MatMul", ["h", "wu"], ["u"]),
              helper.make_node("Mul", ["silu", "u"], ["gu"])]
    inits = {"wq": rand(8, 8, seed=1), "wk": rand(8, 4, seed=2), "wv": rand(8, 4, seed=3),
             "wg": rand(8, 12, seed=4), "wu": rand(8, 12, seed=5)}
    m = model(nodes, [("x", [2, 5, 8]), ("h", [2, 5, 8])], [("q", [2, 5, 8]), ("k", [2, 5, 4]), ("v", [2, 5, 4]),
                                                               ("gu", [2, 5, 12])], inits)
    _, after = check_pass(_FuseThenMerge, m, {"x": rand(2, 5, 8, seed=6), "h": rand(2, 5, 8, seed=7)}, atol=1e-4)
    assert ops(after) == ["MatMul", "Split", "Neg", "Neg", "Neg", "MatMul", "Split", "Sigmoid", "Mul", "Mul"]
    assert [tuple(after.initializers[n.inputs[1]].shape) for n in after.nodes if n.op_type == "MatMul"] == \
        [(8, 16), (8, 24)]


def test_matmuls_on_other_inputs_or_computed_weights_stay_apart():
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("MatMul", ["h", "w2"], ["b"]),
             helper.make_node("MatMul", ["x", "h2"], ["c"])]
    m = model(nodes, [("x", [2, 8]), ("h", [2, 8]), ("h2", [8, 3])], [("a", [2, 4]), ("b", [2, 4]), ("c", [2, 3])],
              {"w1": rand(8, 4, seed=1), "w2": rand(8, 4, seed=2)})
    _, after = check_pass(merge_parallel_gemms, m, {"x": rand(2, 8, seed=3), "h": rand(2, 8, seed=4),
                                                    "h2": rand(8, 3, seed=5)})
    assert ops(after) == ["MatMul", "MatMul", "MatMul"]
