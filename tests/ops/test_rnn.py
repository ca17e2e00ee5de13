"""Hand tests for rnn.py: LSTM/GRU/RNN against torch.nn with copied weights, and the
ONNX-only features (clip, peepholes, input_forget, activations) against onnxruntime.
"""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.errors import UnsupportedError

_TYPES = {np.dtype("float32"): TensorProto.FLOAT, np.dtype("int32"): TensorProto.INT32}
_OUTS = {"RNN": ["Y", "Y_h"], "GRU": ["Y", "Y_h"], "LSTM": ["Y", "Y_h", "Y_c"]}
_INPUTS = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]

rng = np.random.default_rng(0)


def _randn(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _model(op, feeds, **attrs):
    """One `op` node; feeds maps ONNX input names (see _INPUTS) to arrays, others omitted."""
    last = max(_INPUTS.index(k) for k in feeds)
    names = [k if k in feeds else "" for k in _INPUTS[: last + 1]]
    node = helper.make_node(op, names, _OUTS[op], name=f"{op.lower()}_under_test", **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, _TYPES[v.dtype], v.shape) for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in _OUTS[op]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


def _kiln(op, feeds, **attrs):
    engine = kiln.build(_model(op, feeds, **attrs), kiln.BuildConfig(device="cpu", progress=False))
    return list(engine.create_execution_context().run(feeds).values())


def _ort(op, feeds, **attrs):
    sess = ort.InferenceSession(_model(op, feeds, **attrs).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _close(got, want, tol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# --- against torch.nn ---------------------------------------------------------

def _onnx_weights(mod, gate_order, bidirectional):
    """torch.nn weights -> ONNX W, R, B (gates reordered from torch's order to ONNX's)."""
    def gates(t):
        return torch.cat([t.chunk(len(gate_order))[g] for g in gate_order])

    suffixes = ["", "_reverse"] if bidirectional else [""]
    W = torch.stack([gates(getattr(mod, f"weight_ih_l0{s}")) for s in suffixes])
    R = torch.stack([gates(getattr(mod, f"weight_hh_l0{s}")) for s in suffixes])
    B = torch.stack([torch.cat([gates(getattr(mod, f"bias_ih_l0{s}")), gates(getattr(mod, f"bias_hh_l0{s}"))])
                     for s in suffixes])
    return {k: v.detach().numpy() for k, v in {"W": W, "R": R, "B": B}.items()}


# torch orders LSTM gates i,f,g,o and GRU gates r,z,n; ONNX wants i,o,f,c and z,r,h.
_TORCH = {"LSTM": (torch.nn.LSTM, [0, 3, 1, 2]), "GRU": (torch.nn.GRU, [1, 0, 2]), "RNN": (torch.nn.RNN, [0])}


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("layout", [0, 1])
def test_matches_torch(op, bidirectional, layout):
    T, N, I, H = 5, 3, 4, 6
    cls, order = _TORCH[op]
    torch.manual_seed(0)
    mod = cls(I, H, bidirectional=bidirectional, batch_first=bool(layout))
    D = 2 if bidirectional else 1
    x = torch.randn((N, T, I) if layout else (T, N, I))
    h0 = torch.randn(D, N, H)
    c0 = torch.randn(D, N, H)
    with torch.no_grad():
        want = mod(x, (h0, c0)) if op == "LSTM" else mod(x, h0)
    y, states = want[0], want[1] if op == "LSTM" else (want[1],)
    feeds = {"X": x.numpy(), **_onnx_weights(mod, order, bidirectional)}
    hs = [h0, c0] if op == "LSTM" else [h0]
    for name, s in zip(["initial_h", "initial_c"], hs):
        feeds[name] = (s.transpose(0, 1) if layout else s).contiguous().numpy()
    attrs = dict(hidden_size=H, direction="bidirectional" if bidirectional else "forward", layout=layout)
    if op == "GRU":
        attrs["linear_before_reset"] = 1  # torch applies the reset gate after the recurrent matmul
    got = _kiln(op, feeds, **attrs)
    # torch: Y [T, N, D*H] (or [N, T, D*H]); ONNX: [T, D, N, H] (or [N, T, D, H]).
    y_onnx = got[0].reshape(N, T, D * H) if layout else got[0].transpose(0, 2, 1, 3).reshape(T, N, D * H)
    np.testing.assert_allclose(y_onnx, y.numpy(), rtol=1e-5, atol=1e-5)
    for g, s in zip(got[1:], states):
        np.testing.assert_allclose(g, (s.transpose(0, 1) if layout else s).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_sequence_lens_match_packed_torch(op):
    """Shorter sequences: zeros past their length, final states at their last step,
    the reverse direction starting from each sequence's own last step."""
    T, N, I, H = 6, 4, 3, 5
    lens = [6, 2, 4, 1]
    cls, order = _TORCH[op]
    torch.manual_seed(1)
    mod = cls(I, H, bidirectional=True)
    x = torch.randn(T, N, I)
    for b, n in enumerate(lens):
        x[n:, b] = 0
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lens, enforce_sorted=False)
    with torch.no_grad():
        out, states = mod(packed)
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=T)
    states = states if op == "LSTM" else (states,)
    feeds = {"X": x.numpy(), **_onnx_weights(mod, order, True), "sequence_lens": np.array(lens, np.int32)}
    attrs = dict(hidden_size=H, direction="bidirectional")
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    got = _kiln(op, feeds, **attrs)
    np.testing.assert_allclose(got[0].transpose(0, 2, 1, 3).reshape(T, N, 2 * H), y.numpy(), rtol=1e-5, atol=1e-5)
    for g, s in zip(got[1:], states):
        np.testing.assert_allclose(g, s.numpy(), rtol=1e-5, atol=1e-5)


def test_rnn_relu_matches_torch():
    torch.manual_seed(2)
    mod = torch.nn.RNN(3, 4, nonlinearity="relu")
    x = torch.randn(5, 2, 3)
    with torch.no_grad():
        y, h = mod(x)
    got = _kiln("RNN", {"X": x.numpy(), **_onnx_weights(mod, [0], False)}, hidden_size=4, activations=["Relu"])
    np.testing.assert_allclose(got[0][:, 0], y.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], h.numpy(), rtol=1e-5, atol=1e-5)


# --- ONNX-only features, against onnxruntime -----------------------------------

def _feeds(op, D, T=5, N=3, I=4, H=6, peepholes=False, lens=None):
    g = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    feeds = {"X": _randn(T, N, I), "W": _randn(D, g * H, I, scale=0.5), "R": _randn(D, g * H, H, scale=0.5),
             "B": _randn(D, 2 * g * H)}
    if lens is not None:
        feeds["sequence_lens"] = np.array(lens, np.int32)
    feeds["initial_h"] = _randn(D, N, H)
    if op == "LSTM":
        feeds["initial_c"] = _randn(D, N, H)
        if peepholes:
            feeds["P"] = _randn(D, 3 * H)
    return feeds


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_lstm_peepholes_clip_input_forget(direction):
    D = 2 if direction == "bidirectional" else 1
    feeds = _feeds("LSTM", D, peepholes=True, lens=[5, 3, 1])
    for extra in ({}, {"clip": 0.7}, {"input_forget": 1}):
        attrs = dict(hidden_size=6, direction=direction, **extra)
        _close(_kiln("LSTM", feeds, **attrs), _ort("LSTM", feeds, **attrs))


@pytest.mark.parametrize("linear_before_reset", [0, 1])
@pytest.mark.parametrize("direction", ["reverse", "bidirectional"])
def test_gru_linear_before_reset_and_clip(linear_before_reset, direction):
    D = 2 if direction == "bidirectional" else 1
    feeds = _feeds("GRU", D, lens=[2, 5, 4])
    attrs = dict(hidden_size=6, direction=direction, linear_before_reset=linear_before_reset, clip=1.5)
    _close(_kiln("GRU", feeds, **attrs), _ort("GRU", feeds, **attrs))


@pytest.mark.parametrize("op, acts", [
    ("RNN", ["LeakyRelu", "HardSigmoid"]),
    ("RNN", ["Elu", "ThresholdedRelu"]),
    ("GRU", ["HardSigmoid", "ScaledTanh", "Sigmoid", "Affine"]),
    ("LSTM", ["HardSigmoid", "Softsign", "Softplus", "sigmoid", "LeakyRelu", "ScaledTanh"]),
])
def test_non_default_activations(op, acts):
    """alpha/beta are consumed in order by the activations that take them."""
    feeds = _feeds(op, 2)
    attrs = dict(hidden_size=6, direction="bidirectional", activations=acts,
                 activation_alpha=[0.3, 0.7, 0.2, 0.9, 0.5, 0.4], activation_beta=[0.4, 0.1, 0.6, 0.8, 0.5, 0.3])
    _close(_kiln(op, feeds, **attrs), _ort(op, feeds, **attrs))


def test_batchwise_layout_transposes_io():
    feeds = _feeds("LSTM", 2, peepholes=True)
    attrs = dict(hidden_size=6, direction="bidirectional")
    want = _kiln("LSTM", feeds, **attrs)
    batchwise = dict(feeds, X=feeds["X"].transpose(1, 0, 2).copy(),
                     initial_h=feeds["initial_h"].transpose(1, 0, 2).copy(),
                     initial_c=feeds["initial_c"].transpose(1, 0, 2).copy())
    got = _kiln("LSTM", batchwise, layout=1, **attrs)
    _close(got, [want[0].transpose(2, 0, 1, 3), want[1].transpose(1, 0, 2), want[2].transpose(1, 0, 2)])


@pytest.mark.parametrize("acts, why", [
    (["Sigmoid", "Swish", "Tanh"], "Swish"),
    (["Sigmoid", "Tanh"], "2 activations given, expected 3 per direction"),
])
def test_unsupported_activations_are_reported_with_node_name(acts, why):
    with pytest.raises(UnsupportedError, match=f"lstm_under_test.*{why}"):
        _kiln("LSTM", _feeds("LSTM", 1), hidden_size=6, activations=acts)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_cuda_graph_engine_matches_cpu(op):
    """Recurrent layers keep sequence_lens on the device, so the engine is captured and replayed."""
    feeds = _feeds(op, 2, peepholes=True, lens=[5, 3, 1])
    model = _model(op, feeds, hidden_size=6, direction="bidirectional")
    want = list(kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
                .create_execution_context().run(feeds).values())
    engine = kiln.build(model, kiln.BuildConfig(device="cuda", progress=False))
    ctx = engine.create_execution_context()
    assert ctx.uses_cuda_graphs
    cuda_feeds = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    for _ in range(2):  # capture, then replay
        got = [t.cpu().numpy() for t in ctx.run(cuda_feeds).values()]
        _close(got, want, tol=1e-4)
