"""Hand tests for random.py. ONNX cannot check random values, so these check shapes,
dtypes, seeding and distribution moments; the window / DFT / STFT / mel ops are checked
against torch, numpy and the ONNX reference implementation."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import kiln
from kiln.ir import dtypes

_NP = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
       np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.int64): TensorProto.INT64,
       np.dtype(np.int32): TensorProto.INT32}


def _model(op, feeds=None, out_type=TensorProto.FLOAT, opset=22, inits=(), **attrs):
    feeds = feeds or {}
    node = helper.make_node(op, list(feeds) + [t.name for t in inits], ["y"], name="op_under_test", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, _NP[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", out_type, None)], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _engine(model, **config):
    return kiln.build(model, kiln.BuildConfig(device="cpu", progress=False, **config))


def _run(model, feeds=None):
    (y,) = _engine(model).create_execution_context().run(feeds or {}).values()
    return dtypes.to_numpy(y) if isinstance(y, torch.Tensor) else y


N = 200_000


@pytest.mark.parametrize("dtype, np_dtype", [(TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64),
                                             (TensorProto.FLOAT16, np.float16)])
def test_random_normal_moments_and_dtype(dtype, np_dtype):
    y = _run(_model("RandomNormal", out_type=dtype, shape=[N // 100, 100], dtype=dtype, mean=2.0, scale=3.0))
    assert y.shape == (N // 100, 100) and y.dtype == np_dtype
    y = y.astype(np.float64)
    assert abs(y.mean() - 2.0) < 0.05 and abs(y.std() - 3.0) < 0.05
    assert abs(((y - y.mean()) ** 3).mean() / y.std() ** 3) < 0.05  # symmetric


def test_random_uniform_range_and_moments():
    y = _run(_model("RandomUniform", shape=[N], low=-1.0, high=3.0)).astype(np.float64)
    assert y.min() >= -1.0 and y.max() < 3.0
    assert abs(y.mean() - 1.0) < 0.02 and abs(y.var() - 16 / 12) < 0.02


def test_seed_makes_runs_and_builds_reproducible():
    seeded = _model("RandomNormal", shape=[64], seed=7.0)
    a = _run(seeded)
    ctx = _engine(seeded).create_execution_context()
    b, c = ctx.run({})["y"].numpy(), ctx.run({})["y"].numpy()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(b, c)
    assert not np.array_equal(a, _run(_model("RandomNormal", shape=[64], seed=7.5)))  # fractional seeds differ
    unseeded = _engine(_model("RandomNormal", shape=[64])).create_execution_context()
    assert not torch.equal(unseeded.run({})["y"], unseeded.run({})["y"])


def test_random_ops_are_neither_folded_nor_captured():
    engine = _engine(_model("RandomUniform", shape=[4]))
    assert [n.op_type for n in engine.graph.nodes] == ["RandomUniform"]
    assert not engine.capturable  # a CUDA graph would replay the same numbers


def test_like_variants_take_shape_and_dtype_from_input():
    x = np.zeros((3, 5), np.float16)
    y = _run(_model("RandomUniformLike", {"x": x}, out_type=TensorProto.FLOAT16, low=5.0, high=6.0), {"x": x})
    assert y.shape == (3, 5) and y.dtype == np.float16 and (y >= 5).all() and (y <= 6).all()
    ints = np.zeros((2, 2), np.int64)
    y = _run(_model("RandomNormalLike", {"x": ints}, out_type=TensorProto.DOUBLE, dtype=TensorProto.DOUBLE),
             {"x": ints})
    assert y.shape == (2, 2) and y.dtype == np.float64
    with pytest.raises(kiln.KilnError, match="float `dtype`"):
        _run(_model("RandomNormalLike", {"x": ints}), {"x": ints})


def test_bernoulli_extremes_mean_and_dtype():
    p = np.concatenate([np.zeros(100), np.ones(100), np.full(N, 0.3)]).astype(np.float32)
    y = _run(_model("Bernoulli", {"p": p}, out_type=TensorProto.INT32, dtype=TensorProto.INT32), {"p": p})
    assert y.dtype == np.int32
    assert (y[:100] == 0).all() and (y[100:200] == 1).all()
    assert abs(y[200:].mean() - 0.3) < 0.01
    p64 = p.astype(np.float64)
    y = _run(_model("Bernoulli", {"p": p64}, out_type=TensorProto.DOUBLE, seed=3.0), {"p": p64})
    assert y.dtype == np.float64 and set(np.unique(y)) <= {0.0, 1.0}


def test_multinomial_follows_softmax_of_logits():
    logits = np.log(np.array([[0.2, 0.8, 1e-30], [0.5, 0.25, 0.25]], np.float32))
    y = _run(_model("Multinomial", {"x": logits}, out_type=TensorProto.INT64, sample_size=50_000,
                    dtype=TensorProto.INT64, seed=1.0), {"x": logits})
    assert y.shape == (2, 50_000) and y.dtype == np.int64
    freq = np.stack([np.bincount(row, minlength=3) / row.size for row in y])
    np.testing.assert_allclose(freq, [[0.2, 0.8, 0.0], [0.5, 0.25, 0.25]], atol=0.01)


@pytest.mark.parametrize("op, torch_fn", [("HannWindow", torch.hann_window), ("HammingWindow", None),
                                          ("BlackmanWindow", torch.blackman_window)])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_match_torch(op, torch_fn, periodic):
    size = np.array(9, np.int64)
    y = _run(_model(op, {"n": size}, out_type=TensorProto.DOUBLE, periodic=periodic,
                    output_datatype=TensorProto.DOUBLE, opset=17), {"n": size})
    if torch_fn is None:  # ONNX's Hamming uses alpha = 25/46, not torch's 0.54
        want = torch.hamming_window(9, periodic=bool(periodic), alpha=25 / 46, beta=21 / 46, dtype=torch.float64)
    else:
        want = torch_fn(9, periodic=bool(periodic), dtype=torch.float64)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, want.numpy(), atol=1e-12)


def test_window_of_a_constant_size_is_folded():
    size = helper.make_tensor("n", TensorProto.INT64, [], [16])
    engine = _engine(_model("HannWindow", inits=[size], opset=17))
    assert engine.graph.nodes == []  # computed once at build time


@pytest.mark.parametrize("complex_input", [False, True])
def test_stft_matches_torch(complex_input):
    rng = np.random.default_rng(0)
    signal = rng.standard_normal((2, 64, 2 if complex_input else 1)).astype(np.float32)
    window = torch.hann_window(16, dtype=torch.float32).numpy()
    step = helper.make_tensor("step", TensorProto.INT64, [], [5])  # a frame step is a constant in practice
    feeds = {"x": signal, "w": window}
    model = _model("STFT", feeds, onesided=0 if complex_input else 1, opset=17, inits=[step])
    model.graph.node[0].input[:] = ["x", "step", "w"]
    y = _run(model, feeds)
    x = torch.from_numpy(signal)
    x = torch.complex(x[..., 0], x[..., 1]) if complex_input else x[..., 0]
    want = torch.stft(x, n_fft=16, hop_length=5, window=torch.from_numpy(window), center=False,
                      onesided=not complex_input, return_complex=True).transpose(1, 2)
    assert y.shape == (2, (64 - 16) // 5 + 1, 16 if complex_input else 9, 2)
    np.testing.assert_allclose(y, torch.view_as_real(want).numpy(), atol=1e-4)


def test_mel_weight_matrix_matches_onnx_reference():
    args = [np.array(v, np.int64) for v in (12, 512, 16000)] + [np.array(v, np.float32) for v in (40.0, 7000.0)]
    names = ["bins", "n_fft", "rate", "lo", "hi"]
    inits = [helper.make_tensor(k, _NP[v.dtype], [], [v.item()]) for k, v in zip(names, args)]
    model = _model("MelWeightMatrix", out_type=TensorProto.DOUBLE, output_datatype=TensorProto.DOUBLE, opset=17,
                   inits=inits)
    y = _run(model)
    (want,) = ReferenceEvaluator(model).run(None, {})
    assert y.shape == (257, 12) and y.dtype == np.float64
    np.testing.assert_allclose(y, want, atol=1e-12)
    assert (y.max(axis=0) == 1.0).all()  # every filter peaks at 1


def test_dft_onesided_real_spectrum_and_its_inverse():
    """rfft of a padded real signal on axis 1 (opset 20: axis and length as inputs), then the real
    inverse (onesided + inverse) of that half spectrum gives the padded signal back."""
    x = np.random.default_rng(0).standard_normal((2, 6, 3, 1)).astype(np.float32)
    n = np.array(8, np.int64)
    inits = [helper.make_tensor("n", TensorProto.INT64, [], [8]),
             helper.make_tensor("axis", TensorProto.INT64, [], [1])]
    fwd = _model("DFT", {"x": x}, opset=20, inits=inits, onesided=1)
    spectrum = _engine(fwd).create_execution_context().run({"x": x})["y"]
    want = np.fft.rfft(x[..., 0], n=int(n), axis=1)
    np.testing.assert_allclose(spectrum, np.stack([want.real, want.imag], -1), rtol=1e-5, atol=1e-5)
    inv = _model("DFT", {"s": spectrum}, opset=20, inits=inits, onesided=1, inverse=1)
    signal = _engine(inv).create_execution_context().run({"s": spectrum})["y"]
    padded = np.concatenate([x, np.zeros((2, 2, 3, 1), np.float32)], axis=1)
    np.testing.assert_allclose(signal, padded, rtol=1e-5, atol=1e-5)


def test_dft_opset17_axis_attribute_matches_reference():
    x = np.random.default_rng(1).standard_normal((1, 4, 5, 2)).astype(np.float32)  # complex input
    model = _model("DFT", {"x": x}, opset=17, axis=2, inverse=1)
    got = _engine(model).create_execution_context().run({"x": x})["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
