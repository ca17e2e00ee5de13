"""The build's memory estimate counts the intermediate activations (builder/footprint.py): a liveness walk over
the layers the engine runs, at the profile's max shapes, on real small ONNX graphs whose peaks are worked out
by hand below."""

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import passes
from kiln.builder import footprint, placement
from kiln.engine.target import resolve
from kiln.errors import ConfigError
from kiln.ir.from_onnx import model_to_graph

F32 = 4
CPU = {"device": "cpu"}


def _model(nodes, inputs, outputs, weights=None):
    """inputs / outputs: [(name, shape)], float32; weights: {name: array}."""
    graph = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (weights or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _w(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1


def _fused(model):
    graph = model_to_graph(model)
    for p in passes.PIPELINE:
        p.run(graph)
    placement.assign(graph)
    return graph


def chain():
    """x [N, 16] -> MatMul [16, 64] -> h1 [N, 64] -> MatMul [64, 8] -> h2 [N, 8] -> MatMul [8, 32] -> y [N, 32]."""
    return _model([helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
                   helper.make_node("MatMul", ["h1", "w2"], ["h2"], name="mm2"),
                   helper.make_node("MatMul", ["h2", "w3"], ["y"], name="mm3")],
                  [("x", ["N", 16])], [("y", ["N", 32])],
                  {"w1": _w(16, 64), "w2": _w(64, 8, seed=1), "w3": _w(8, 32, seed=2)})


def test_chain_peak_is_the_two_tensors_around_its_widest_layer():
    # h1 is live until mm2 has written h2: the peak is h1 + h2 = 72 floats a row, after mm2; then h1 goes,
    # and h2 + y is 40 a row.
    n = 1000
    fp = footprint.estimate(model_to_graph(chain()), {"x": (n, 16)})
    assert fp.activations == n * (64 + 8) * F32 and fp.peak_layer == "mm2"
    assert fp.inputs == n * 16 * F32 and fp.weights == (16 * 64 + 64 * 8 + 8 * 32) * F32
    assert fp.layers == 3 and fp.stopped is None
    assert [row[0] for row in fp.largest] == ["h1", "h2"]
    # FP16/BF16 builds may hold every float in 2 bytes: the estimate stays a lower bound.
    assert footprint.estimate(model_to_graph(chain()), {"x": (n, 16)}, float_bytes=2).activations == n * 72 * 2
    # The built engine runs these layers in this order: its validation run measures the same peak at max.
    engine = kiln.build(chain(), kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 16), (8, 16), (n, 16))})], **CPU))
    assert engine.arena_bytes == [n * 72 * F32]
    assert footprint.estimate(engine.graph, {"x": (n, 16)}).activations == n * 72 * F32


def test_branches_keep_two_tensors_live():
    """x -> a = x @ W1 [N, 64] and b = x @ W2 [N, 32], both live; c = a @ W3 [N, 32]; y = b + c."""
    m = _model([helper.make_node("MatMul", ["x", "w1"], ["a"], name="left"),
                helper.make_node("MatMul", ["x", "w2"], ["b"], name="right"),
                helper.make_node("MatMul", ["a", "w3"], ["c"], name="left2"),
                helper.make_node("Add", ["b", "c"], ["y"], name="join")],
               [("x", ["N", 16])], [("y", ["N", 32])],
               {"w1": _w(16, 64), "w2": _w(16, 32, seed=1), "w3": _w(64, 32, seed=2)})
    n = 500
    # After 'left2': a (64) + b (32) + c (32) a row; a then goes, and at 'join' b + c + y is 96.
    fp = footprint.estimate(model_to_graph(m), {"x": (n, 16)})
    assert fp.activations == n * 128 * F32 and fp.peak_layer == "left2"
    assert [row[0] for row in fp.largest] == ["a", "b"]


def test_views_keep_the_tensor_they_view_allocated():
    """h = x @ W [N, 96] split into views a [N, 64] and b [N, 32]; c = a @ W3; y = b + c. h's memory stays
    allocated until its last view, b, is read at 'join': h 96 + c 32 + y 32 a row then."""
    m = _model([helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
                helper.make_node("Split", ["h", "sizes"], ["a", "b"], axis=1, name="split"),
                helper.make_node("MatMul", ["a", "w3"], ["c"], name="left2"),
                helper.make_node("Add", ["b", "c"], ["y"], name="join")],
               [("x", ["N", 16])], [("y", ["N", 32])],
               {"w": _w(16, 96), "sizes": np.array([64, 32], np.int64), "w3": _w(64, 32, seed=2)})
    n = 500
    fp = footprint.estimate(model_to_graph(m), {"x": (n, 16)})
    assert fp.activations == n * 160 * F32 and fp.peak_layer == "join"
    assert fp.largest[0] == ("b", (n, 32), n * 96 * F32, (n, 96))  # b named, h's bytes counted


def test_the_walk_ends_where_sizes_depend_on_values():
    """NonZero's output length depends on x's values: what comes before it is counted, the rest is not."""
    m = _model([helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
                helper.make_node("NonZero", ["h"], ["idx"], name="nonzero"),
                helper.make_node("Cast", ["idx"], ["y"], to=TensorProto.FLOAT, name="cast")],
               [("x", ["N", 16])], [("y", [2, "K"])], {"w": _w(16, 64)})
    fp = footprint.estimate(model_to_graph(m), {"x": (100, 16)})
    assert fp.layers == 1 and fp.activations == 100 * 64 * F32
    assert fp.stopped.startswith("the sizes from layer 'nonzero' (NonZero) on cannot be derived without running it")


def attention(heads=2, dim=8):
    """Unfused scaled dot-product attention: scores = q @ k^T [B, H, S, S], * 1/sqrt(D), Softmax, @ v."""
    shape = ["B", heads, "S", dim]
    return _model([helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="kT"),
                   helper.make_node("MatMul", ["q", "kt"], ["scores"], name="qk"),
                   helper.make_node("Mul", ["scores", "scale"], ["scaled"], name="scale"),
                   helper.make_node("Softmax", ["scaled"], ["p"], axis=-1, name="softmax"),
                   helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")],
                  [("q", shape), ("k", shape), ("v", shape)], [("y", shape)],
                  {"scale": np.float32(dim ** -0.5)})


def test_attention_score_matrix_counts_only_while_the_graph_materialises_it():
    b, h, s, d = 1, 2, 256, 8
    shapes = {n: (b, h, s, d) for n in ("q", "k", "v")}
    before = footprint.estimate(model_to_graph(attention(h, d)), shapes)
    # kt is a view of k; 'scale' and 'softmax' each hold two [B, H, S, S] tensors at once.
    assert before.activations == 2 * b * h * s * s * F32 and before.peak_layer == "scale"
    after = _fused(attention(h, d))
    assert [n.op_type for n in after.nodes if n.op_type != "Transpose"] == ["Attention"]  # K^T: a view
    fused = footprint.estimate(after, shapes)
    assert fused.activations == b * h * s * d * F32  # the output alone: no score matrix is ever a tensor


def test_an_unfused_score_matrix_too_big_for_memory_is_refused_and_the_fused_graph_is_not():
    """At a sequence length where one [S, S] score matrix exceeds the memory there is (the CPU target's
    available memory), the unfused graph is refused naming the score tensors; the fused one fits."""
    target = resolve("cpu")
    free = footprint.available_bytes(target)
    s = math.isqrt(2 * free // F32)  # twice what is free: other processes may free memory before the check reads it
    profiles = [kiln.Profile({n: ((1, 1, 1, 8), (1, 1, s, 8), (1, 1, s, 8)) for n in ("q", "k", "v")})]
    with pytest.raises(ConfigError, match=r"profile 0 cannot fit in memory: .* intermediate activations live at "
                       r"once \(the peak is reached at layer 'scale'; largest live: 'scores' 1x1x\d+x\d+"):
        footprint.check(model_to_graph(attention(1, 8)), profiles, target)
    [fp] = footprint.check(_fused(attention(1, 8)), profiles, target)
    assert fp.activations == s * 8 * F32


def test_a_model_whose_activations_exceed_memory_is_refused_before_allocating():
    """Tiny inputs and weights, a Tile whose output at the profile's max is larger than the available memory:
    the inputs-and-weights check passes it, the activation estimate refuses it with the layer and the bytes."""
    free = footprint.available_bytes(resolve("cpu"))
    rows = 1024
    repeats = 2 * free // (rows * 8 * F32)  # twice what is free, as above
    m = _model([helper.make_node("Tile", ["x", "reps"], ["wide"], name="tile"),
                helper.make_node("ReduceSum", ["wide", "axes"], ["y"], keepdims=1, name="sum")],
               [("x", ["N", 8])], [("y", ["N", 1])],
               {"reps": np.array([1, repeats], np.int64), "axes": np.array([1], np.int64)})
    with pytest.raises(ConfigError) as e:
        kiln.build(m, kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (4, 8), (rows, 8))})], **CPU))
    msg = " ".join(str(e.value).split())
    assert "profile 0 cannot fit in memory: at its max shapes the engine needs at least" in msg
    # The peak: the Tile's output still live while the sum is written.
    assert f"the peak is reached at layer 'sum'; largest live: 'wide' {rows}x{8 * repeats}" in msg
    assert "of weights, 32.00 KiB of inputs and" in msg
    assert "the host's available memory is" in msg and "--maxShapes" in msg
    # The same model at a max that fits builds.
    kiln.build(m, kiln.BuildConfig(profiles=[kiln.Profile({"x": ((1, 8), (1, 8), (1, 8))})], **CPU, validate=False))
