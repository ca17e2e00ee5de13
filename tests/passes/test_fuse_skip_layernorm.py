import pytest

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


def test_a_sum_of_three_joins_the_norm_with_a_constant_third_addend():
    """BERT's embeddings: (word + token type) + position, the position rows a constant [1, S, H]."""
    m = model([
        helper.make_node("Add", ["w", "t"], ["wt"]),
        helper.make_node("Add", ["wt", "pos"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
    ], [("w", [2, 3, 8]), ("t", [2, 3, 8])], [("y", [2, 3, 8])],
        {"pos": rand(1, 3, 8, seed=4), "g": rand(8), "b": rand(8, seed=1)})
    _, after = check_pass(fuse_skip_layernorm, m, {"w": rand(2, 3, 8, seed=2), "t": rand(2, 3, 8, seed=3)}, atol=1e-5)
    assert ops(after) == ["kiln::SkipLayerNorm"]
    assert after.nodes[0].inputs == ["w", "t", "g", "b", "", "pos"]


def test_an_inner_sum_read_elsewhere_stays_its_own_add():
    m = model([
        helper.make_node("Add", ["w", "t"], ["wt"]),
        helper.make_node("Add", ["wt", "p"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
        helper.make_node("Relu", ["wt"], ["z"]),
    ], [("w", [2, 3, 8]), ("t", [2, 3, 8]), ("p", [2, 3, 8])], [("y", [2, 3, 8]), ("z", [2, 3, 8])],
        {"g": rand(8), "b": rand(8, seed=1)})
    feeds = {"w": rand(2, 3, 8, seed=2), "t": rand(2, 3, 8, seed=3), "p": rand(2, 3, 8, seed=5)}
    _, after = check_pass(fuse_skip_layernorm, m, feeds, atol=1e-5)
    assert ops(after) == ["Add", "kiln::SkipLayerNorm", "Relu"]
    assert after.nodes[1].inputs == ["wt", "p", "g", "b"]


def test_bert_embeddings_build_into_a_gather_and_one_norm_that_match_onnxruntime():
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, numpy_helper

    import kiln

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((50, 16)).astype(np.float32), "word"),
             numpy_helper.from_array(rng.standard_normal((2, 16)).astype(np.float32), "type"),
             numpy_helper.from_array(rng.standard_normal((1, 6, 16)).astype(np.float32), "pos"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")]
    nodes = [helper.make_node("Gather", ["word", "ids"], ["e1"]), helper.make_node("Gather", ["type", "tt"], ["e2"]),
             helper.make_node("Add", ["e1", "e2"], ["s1"]), helper.make_node("Add", ["s1", "pos"], ["s2"]),
             helper.make_node("LayerNormalization", ["s2", "g", "b"], ["y"], axis=-1, epsilon=1e-12)]
    g = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info(n, TensorProto.INT64, ["N", 6])
                                         for n in ("ids", "tt")],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 16])], inits)
    onnx_model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    engine = kiln.build(onnx_model, kiln.BuildConfig(device="cpu", progress=False,
                                                     shapes={"ids": (3, 6), "tt": (3, 6)}))
    assert [n.op_type for n in engine.graph.nodes if n.placement == "device"] == ["Gather", "Gather", "SkipLayerNorm"]
    feeds = {"ids": rng.integers(-50, 50, (3, 6)), "tt": rng.integers(0, 2, (3, 6))}  # negative ids count from the end
    ref = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(engine.create_execution_context().run(feeds)["y"], ref, atol=1e-5, rtol=1e-5)


def test_a_reader_of_the_sum_placed_before_the_norm_runs_after_the_fused_layer():
    """GPT-2's embedding sum is read by a Shape (and what follows it) between the Add and the LayerNorm: the fused
    layer, which now makes the sum, must run before them."""
    m = model([
        helper.make_node("Add", ["x", "r"], ["s"]),
        helper.make_node("Relu", ["s"], ["z"]),
        helper.make_node("Neg", ["z"], ["z2"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
    ], [("x", [2, 3, 8]), ("r", [2, 3, 8])], [("y", [2, 3, 8]), ("z2", [2, 3, 8])],
        {"g": rand(8), "b": rand(8, seed=1)})
    _, after = check_pass(fuse_skip_layernorm, m, {"x": rand(2, 3, 8, seed=2), "r": rand(2, 3, 8, seed=3)}, atol=1e-5)
    assert ops(after) == ["kiln::SkipLayerNorm", "Relu", "Neg"]


def test_gpt2_embeddings_token_rows_plus_a_constant_position_table_join_the_norm():
    """GPT-2: wte[ids] + wpe[0:S] (the position slice folded to a constant [1, S, E]) -> LayerNorm, the sum read
    by the first residual: one layer, the table as its third addend, the sum its second output."""
    m = model([
        helper.make_node("Add", ["tok", "pos"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
        helper.make_node("Add", ["s", "d"], ["z"]),  # the first residual reads the embedding sum
    ], [("tok", [2, 3, 8]), ("d", [2, 3, 8])], [("y", [2, 3, 8]), ("z", [2, 3, 8])],
        {"pos": rand(1, 3, 8, seed=4), "g": rand(8), "b": rand(8, seed=1)})
    _, after = check_pass(fuse_skip_layernorm, m, {"tok": rand(2, 3, 8, seed=2), "d": rand(2, 3, 8, seed=3)},
                          atol=1e-5)
    assert ops(after) == ["kiln::SkipLayerNorm", "Add"]
    assert after.nodes[0].inputs == ["tok", "", "g", "b", "", "pos"] and after.nodes[0].outputs == ["y", "s"]


def test_a_bias_vector_added_before_the_norm_stays_apart():
    m = model([
        helper.make_node("Add", ["x", "bias"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
    ], [("x", [2, 3, 8])], [("y", [2, 3, 8])], {"bias": rand(8, seed=4), "g": rand(8), "b": rand(8, seed=1)})
    _, after = check_pass(fuse_skip_layernorm, m, {"x": rand(2, 3, 8, seed=2)}, atol=1e-5)
    assert ops(after) == ["Add", "LayerNormalization"]


@pytest.mark.gpu
def test_gpt2_fp16_engine_joins_the_embedding_sum_and_its_norm_on_the_gpu():
    """gpt2_lm (tiny): token rows + the position table and ln_1 are one layer, no plain LayerNorm is left, the
    attention reads k^T as a Transpose view, and the FP16 engine stays within the zoo's FP16 tolerance."""
    from bench import zoo

    from .test_fuse_rmsnorm import _fp16_engine_of_zoo_row

    engine, err = _fp16_engine_of_zoo_row("gpt2_lm")
    first = next(n for n in engine.graph.nodes if n.op_type == "SkipLayerNorm")
    assert first.inputs[1] == "" and first.inputs[5] and first.outputs[1], first.inputs
    assert not any(n.op_type in ("LayerNormalization", "Add") for n in engine.graph.nodes)
    attns = [n for n in engine.graph.nodes if n.op_type == "Attention"]  # merge_heads_as_view: k^T a view
    made = {o: n for n in engine.graph.nodes for o in n.outputs}
    assert all(made[a.inputs[1]].op_type == "Transpose" for a in attns), [made[a.inputs[1]].op_type for a in attns]
    assert err <= zoo.TOLERANCE["fp16"], (err, first.tactic, [a.tactic for a in attns])
