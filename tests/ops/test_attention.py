"""Hand tests for attention.py: what ONNX's node cases leave out. RotaryEmbedding: 3-D input with
position ids and partial interleaved rotation, an FP16 build. Attention: grouped-query attention over
a KV cache with every output, external-cache padding with a causal window, an FP16 build.
References: ONNX's reference evaluator and torch's scaled_dot_product_attention."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import kiln
from kiln.errors import KilnError, UnsupportedError

rng = np.random.default_rng(0)


def _rope_model(x_shape, cache_shape, with_positions, **attrs):
    inputs = ["x", "cos", "sin"] + (["pos"] if with_positions else [])
    node = helper.make_node("RotaryEmbedding", inputs, ["y"], name="rope", **attrs)
    vis = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
           helper.make_tensor_value_info("cos", TensorProto.FLOAT, cache_shape),
           helper.make_tensor_value_info("sin", TensorProto.FLOAT, cache_shape)]
    if with_positions:
        vis.append(helper.make_tensor_value_info("pos", TensorProto.INT64, x_shape[:2]))
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _feeds(x_shape, cache_shape, with_positions):
    angles = rng.uniform(0, 2 * np.pi, cache_shape).astype(np.float32)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32), "cos": np.cos(angles), "sin": np.sin(angles)}
    if with_positions:
        feeds["pos"] = rng.integers(0, cache_shape[0], x_shape[:2]).astype(np.int64)
    return feeds


def _kiln(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return engine.create_execution_context().run(feeds)["y"]


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_3d_input_with_positions_and_partial_rotation(interleaved):
    # 3 heads of 8 features packed in 24; only the first 4 features of each head rotate.
    x_shape, cache_shape = [2, 5, 24], [16, 2]
    model = _rope_model(x_shape, cache_shape, True, num_heads=3, rotary_embedding_dim=4, interleaved=interleaved)
    feeds = _feeds(x_shape, cache_shape, True)
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_allclose(_kiln(model, feeds), want, rtol=1e-5, atol=1e-6)
    unrotated = feeds["x"].reshape(2, 5, 3, 8)[..., 4:]
    np.testing.assert_array_equal(_kiln(model, feeds).reshape(2, 5, 3, 8)[..., 4:], unrotated)


def test_rotary_fp16_build_stays_within_half_precision():
    x_shape, cache_shape = [1, 4, 6, 16], [1, 6, 8]  # 4-D input, caches per (batch, position)
    model = _rope_model(x_shape, cache_shape, False)
    feeds = _feeds(x_shape, cache_shape, False)
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    got = _kiln(model, feeds, fp16=True)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_rotary_odd_rotation_dim_is_refused():
    model = _rope_model([1, 2, 3, 8], [4, 2], True, rotary_embedding_dim=3)
    with pytest.raises(UnsupportedError, match="rope.*rotary_embedding_dim=3 must be even"):
        kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))


def _attention_model(inputs, outputs, opset=24, **attrs):
    """inputs/outputs: (name, ONNX type, shape); an empty input name omits that optional input."""
    node = helper.make_node("Attention", [n for n, _, _ in inputs], [n for n, _, _ in outputs], name="attn", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*i) for i in inputs if i[0]],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _outputs(model, feeds, **config):
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))
    return list(engine.create_execution_context().run(feeds).values())


F, B = TensorProto.FLOAT, TensorProto.BOOL


def test_gqa_over_kv_cache_returns_every_output():
    # 3-D inputs: 4 query heads share 2 KV heads of 8 features; 3 new tokens after 5 cached ones, causal,
    # a boolean mask shorter than the 8 keys (padded as not attended), softcap and the post-softmax output.
    feeds = {"q": rng.standard_normal((2, 3, 32)).astype(np.float32),
             "k": rng.standard_normal((2, 3, 16)).astype(np.float32),
             "v": rng.standard_normal((2, 3, 16)).astype(np.float32),
             "mask": rng.random((3, 7)) > 0.2,
             "past_k": rng.standard_normal((2, 2, 5, 8)).astype(np.float32),
             "past_v": rng.standard_normal((2, 2, 5, 8)).astype(np.float32)}
    model = _attention_model(
        [("q", F, [2, 3, 32]), ("k", F, [2, 3, 16]), ("v", F, [2, 3, 16]), ("mask", B, [3, 7]),
         ("past_k", F, [2, 2, 5, 8]), ("past_v", F, [2, 2, 5, 8])],
        [("y", F, None), ("present_k", F, None), ("present_v", F, None), ("qk", F, None)],
        q_num_heads=4, kv_num_heads=2, is_causal=1, softcap=3.0, qk_matmul_output_mode=3)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = _outputs(model, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_external_cache_padding_and_window_match_sdpa():
    """nonpad_kv_seqlen hides each sample's padded keys; with is_causal the frontier sits at its last valid key."""
    import torch

    q = rng.standard_normal((2, 2, 2, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    nonpad = np.array([4, 6], np.int64)
    model = _attention_model([("q", F, q.shape), ("k", F, k.shape), ("v", F, v.shape), ("", F, None), ("", F, None),
                              ("", F, None), ("nonpad", TensorProto.INT64, [2])], [("y", F, None)], is_causal=1)
    (got,) = _outputs(model, {"q": q, "k": k, "v": v, "nonpad": nonpad})
    for b, n in enumerate(nonpad):
        allowed = np.arange(6)[None, :] <= np.arange(2)[:, None] + (n - 2)  # bottom-right causal over n keys
        want = torch.nn.functional.scaled_dot_product_attention(
            torch.from_numpy(q[b]), torch.from_numpy(k[b]), torch.from_numpy(v[b]), attn_mask=torch.from_numpy(allowed))
        np.testing.assert_allclose(got[b], want.numpy(), rtol=1e-5, atol=1e-6)


def test_attention_fp16_build_and_fully_masked_row():
    q, k, v = (rng.standard_normal((1, 2, 3, 16)).astype(np.float32) for _ in range(3))
    mask = np.full((3, 3), True)
    mask[1] = False  # query 1 attends no key: its output row is zeros, not NaN
    model = _attention_model([("q", F, q.shape), ("k", F, k.shape), ("v", F, v.shape), ("mask", B, [3, 3])],
                             [("y", F, None)])
    feeds = {"q": q, "k": k, "v": v, "mask": mask}
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    (got,) = _outputs(model, feeds, fp16=True)
    assert np.all(got[:, :, 1] == 0) and np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def _linear_attention_model(with_state, rule, t):
    inputs = ["q", "k", "v", "s" if with_state else "", "g", "beta"]
    node = helper.make_node("LinearAttention", inputs, ["y", "state"], q_num_heads=4, kv_num_heads=2,
                            update_rule=rule)
    vis = [helper.make_tensor_value_info("q", F, [1, t, 4 * 8]), helper.make_tensor_value_info("k", F, [1, t, 2 * 8]),
           helper.make_tensor_value_info("v", F, [1, t, 2 * 6]), helper.make_tensor_value_info("g", F, [1, t, 2]),
           helper.make_tensor_value_info("beta", F, [1, t, 2])]
    if with_state:
        vis.append(helper.make_tensor_value_info("s", F, [1, 2, 8, 6]))
    outs = [helper.make_tensor_value_info(n, F, None) for n in ("y", "state")]
    return helper.make_model(helper.make_graph([node], "g", vis, outs),
                             opset_imports=[helper.make_opsetid("", 27)], ir_version=11)


def test_linear_attention_gqa_gated_delta_chunks_carry_the_state():
    """Gated delta rule with 4 query heads over 2 KV heads: 6 steps at once equal 4 then 2 with the state
    carried, and match ONNX's reference."""
    t = 6
    feeds = {"q": rng.standard_normal((1, t, 32)).astype(np.float32) * 0.3,
             "k": rng.standard_normal((1, t, 16)).astype(np.float32) * 0.3,
             "v": rng.standard_normal((1, t, 12)).astype(np.float32),
             "g": -rng.random((1, t, 2)).astype(np.float32), "beta": rng.random((1, t, 2)).astype(np.float32)}
    model = _linear_attention_model(False, "gated_delta", t)
    y, state = _outputs(model, feeds)
    want_y, want_state = ReferenceEvaluator(model).run(None, feeds)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-6)
    head = {n: a[:, :4] for n, a in feeds.items()}
    tail = {n: a[:, 4:] for n, a in feeds.items()}
    y1, s1 = _outputs(_linear_attention_model(False, "gated_delta", 4), head)
    y2, s2 = _outputs(_linear_attention_model(True, "gated_delta", 2), {**tail, "s": s1})
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2, state, rtol=1e-5, atol=1e-6)


def test_linear_attention_rule_and_inputs_must_agree():
    model = _linear_attention_model(False, "linear", 3)  # the linear rule takes neither decay nor beta
    feeds = {"q": np.zeros((1, 3, 32), np.float32), "k": np.zeros((1, 3, 16), np.float32),
             "v": np.zeros((1, 3, 12), np.float32), "g": np.zeros((1, 3, 2), np.float32),
             "beta": np.zeros((1, 3, 2), np.float32)}
    with pytest.raises(KilnError, match="update_rule 'linear'.* decay input"):
        _outputs(model, feeds)
