"""Hand tests for control_flow.py: If, Loop, Scan (opset 8 and 9+), nested bodies.

References are onnxruntime or hand-computed values. Bodies use ops from other
families; a test needing one that is not registered is skipped, naming it.
"""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper

import kiln
from kiln.ops import lookup

F, I64, BOOL = TP.FLOAT, TP.INT64, TP.BOOL


def _needs(*ops):
    missing = [op for op in ops if lookup(op) is None]
    if missing:
        pytest.skip(f"body uses unregistered op(s) {missing}")


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, opset=17, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _kiln(model, feeds, device="cpu"):
    engine = kiln.build(model, kiln.BuildConfig(device=device, progress=False))
    assert not engine.capturable  # control flow always runs eagerly
    outs = engine.create_execution_context().run(feeds).values()
    return [t.cpu().numpy() if isinstance(t, torch.Tensor) else t for t in outs]


def _ort(model, feeds):
    feeds = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in feeds.items()}
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# --- If ------------------------------------------------------------------------

def _if_model():
    """then: x + [1, 2, 3] (a branch initializer); else: concat(x, x) -- a different shape."""
    one = helper.make_tensor("one", F, [3], [1.0, 2.0, 3.0])
    then = helper.make_graph([helper.make_node("Add", ["x", "one"], ["t"])], "then", [], [_vi("t", F, None)],
                             initializer=[one])
    other = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["e"], axis=0)], "else", [], [_vi("e", F, None)])
    node = helper.make_node("If", ["cond"], ["y"], name="if_under_test", then_branch=then, else_branch=other)
    return _model([node], [_vi("cond", BOOL, []), _vi("x", F, [2, 3])], [_vi("y", F, None)])


@pytest.mark.parametrize("cond", [True, False])
def test_if_runs_the_chosen_branch(cond):
    _needs("Add", "Concat")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (y,) = _kiln(_if_model(), {"cond": torch.tensor(cond), "x": x})
    np.testing.assert_array_equal(y, x + [1, 2, 3] if cond else np.concatenate([x, x]))


def test_if_branch_shape_changes_between_runs_of_one_engine():
    _needs("Add", "Concat")
    engine = kiln.build(_if_model(), kiln.BuildConfig(device="cpu", progress=False))
    ctx = engine.create_execution_context()
    x = torch.ones(2, 3)
    assert ctx.run({"cond": torch.tensor(True), "x": x})["y"].shape == (2, 3)
    assert ctx.run({"cond": torch.tensor(False), "x": x})["y"].shape == (4, 3)


# --- Loop ----------------------------------------------------------------------

def _loop_model(with_trip_count, with_cond):
    """acc += i + x per iteration, scanning acc; the body's cond is acc < limit."""
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i_f"], to=F),
         helper.make_node("Add", ["acc_in", "i_f"], ["acc_i"]),
         helper.make_node("Add", ["acc_i", "x"], ["acc_out"]),  # x comes from the enclosing graph
         helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"]),
         helper.make_node("Identity", ["acc_out"], ["scan_out"])],
        "body", [_vi("i", I64, []), _vi("cond_in", BOOL, []), _vi("acc_in", F, [2])],
        [_vi("cond_out", BOOL, []), _vi("acc_out", F, [2]), _vi("scan_out", F, [2])])
    node = helper.make_node("Loop", ["M" if with_trip_count else "", "cond" if with_cond else "", "acc0"],
                            ["acc", "accs"], body=body)
    inputs = [_vi("M", I64, [])] * with_trip_count + [_vi("cond", BOOL, [])] * with_cond
    inputs += [_vi("acc0", F, [2]), _vi("x", F, [2]), _vi("limit", F, [])]
    return _model([node], inputs, [_vi("acc", F, [2]), _vi("accs", F, None)], opset=13)


@pytest.mark.parametrize("trip_count, cond, limit", [
    (10, True, 1e9),   # stops at the trip count
    (10, True, 20.0),  # stops when the body's cond turns false
    (None, True, 20.0),  # while loop
    (4, None, -1.0),  # for loop: the body's cond (false at once) is ignored
    (0, True, 1e9),  # no iteration: empty scan output of the body's declared shape
    (10, False, 1e9),  # no iteration: cond false on entry
])
def test_loop_trip_count_and_cond(trip_count, cond, limit):
    _needs("Cast", "Add", "ReduceSum", "Less", "Identity")
    model = _loop_model(trip_count is not None, cond is not None)
    feeds = {"acc0": np.array([1, -1], np.float32), "x": np.array([0.5, 2], np.float32),
             "limit": torch.tensor(limit)}
    if trip_count is not None:
        feeds["M"] = torch.tensor(trip_count)
    if cond is not None:
        feeds["cond"] = torch.tensor(cond)
    got = _kiln(model, feeds)
    _same(got, _loop_reference(trip_count, cond, feeds["acc0"], feeds["x"], limit))
    if cond is not None:  # onnxruntime reads the body's cond even without a cond input; the spec ignores it
        _same(got, _ort(model, feeds))
    if trip_count == 0:
        assert got[1].shape == (0, 2)


def _loop_reference(trip_count, cond, acc, x, limit):
    accs, i, running = [], 0, True if cond is None else cond
    while running and (trip_count is None or i < trip_count):
        acc = acc + i + x
        accs.append(acc)
        i += 1
        if cond is not None:
            running = acc.sum() < limit
    return [acc, np.array(accs, np.float32).reshape(-1, 2)]


def test_if_inside_loop_reads_outer_scopes():
    """Even iterations add x, odd ones subtract it; x is two scopes out."""
    _needs("Mod", "Equal", "Add", "Sub", "Identity")
    two = helper.make_tensor("two", I64, [], [2])
    zero = helper.make_tensor("zero", I64, [], [0])
    add = helper.make_graph([helper.make_node("Add", ["acc_in", "x"], ["a"])], "add", [], [_vi("a", F, [3])])
    sub = helper.make_graph([helper.make_node("Sub", ["acc_in", "x"], ["s"])], "sub", [], [_vi("s", F, [3])])
    body = helper.make_graph(
        [helper.make_node("Mod", ["i", "two"], ["parity"]),
         helper.make_node("Equal", ["parity", "zero"], ["even"]),
         helper.make_node("If", ["even"], ["acc_out"], then_branch=add, else_branch=sub),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_vi("i", I64, []), _vi("cond_in", BOOL, []), _vi("acc_in", F, [3])],
        [_vi("cond_out", BOOL, []), _vi("acc_out", F, [3])], initializer=[two, zero])
    loop = helper.make_node("Loop", ["M", "", "acc0"], ["acc"], body=body)
    model = _model([loop], [_vi("M", I64, []), _vi("acc0", F, [3]), _vi("x", F, [3])], [_vi("acc", F, [3])])
    x = np.array([1, 2, 3], np.float32)
    for trips, times in ((5, 1), (4, 0)):
        (acc,) = _kiln(model, {"M": torch.tensor(trips), "acc0": np.zeros(3, np.float32), "x": x})
        np.testing.assert_array_equal(acc, times * x)


# --- Scan ----------------------------------------------------------------------

def test_scan9_axes_and_directions():
    """Two scan inputs (axis 0 forward, axis 1 reverse), outputs stacked on axis 1 and -1 reversed."""
    _needs("Add", "Mul", "Identity")
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "a"], ["s_out"]),
         helper.make_node("Mul", ["s_out", "b"], ["prod"]),
         helper.make_node("Identity", ["b"], ["b_out"])],
        "body", [_vi("s_in", F, [2]), _vi("a", F, [2]), _vi("b", F, [2])],
        [_vi("s_out", F, [2]), _vi("prod", F, [2]), _vi("b_out", F, [2])])
    node = helper.make_node("Scan", ["s0", "xa", "xb"], ["s", "prods", "bs"], body=body, num_scan_inputs=2,
                            scan_input_axes=[0, -1], scan_input_directions=[0, 1],
                            scan_output_axes=[1, -1], scan_output_directions=[0, 1])
    model = _model([node], [_vi("s0", F, [2]), _vi("xa", F, [4, 2]), _vi("xb", F, [2, 4])],
                   [_vi("s", F, [2]), _vi("prods", F, [2, 4]), _vi("bs", F, [2, 4])])
    feeds = {"s0": np.array([1, 2], np.float32), "xa": np.arange(8, dtype=np.float32).reshape(4, 2),
             "xb": np.arange(8, dtype=np.float32).reshape(2, 4) - 3}
    got = _kiln(model, feeds)
    _same(got, _ort(model, feeds))
    np.testing.assert_array_equal(got[2], feeds["xb"])  # read backwards, written backwards: unchanged


@pytest.mark.parametrize("direction", [0, 1])
def test_scan8_batch_and_sequence_lens(direction):
    """Scan-8: per batch entry; past its length the state holds and outputs are zero."""
    _needs("Add", "Mul")
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x"], ["s_out"]), helper.make_node("Mul", ["s_out", "x"], ["y"])],
        "body", [_vi("s_in", F, [2]), _vi("x", F, [2])], [_vi("s_out", F, [2]), _vi("y", F, [2])])
    node = helper.make_node("Scan", ["lens", "s0", "xs"], ["s", "ys"], num_scan_inputs=1, body=body,
                            directions=[direction])
    model = _model([node], [_vi("lens", I64, [3]), _vi("s0", F, [3, 2]), _vi("xs", F, [3, 4, 2])],
                   [_vi("s", F, [3, 2]), _vi("ys", F, [3, 4, 2])], opset=8)
    feeds = {"lens": np.array([4, 2, 1], np.int64), "s0": np.ones((3, 2), np.float32),
             "xs": np.arange(24, dtype=np.float32).reshape(3, 4, 2)}
    got = _kiln(model, feeds)
    _same(got, _ort(model, feeds))
    assert not got[1][2, 1:].any()


@pytest.mark.gpu
def test_cuda_if_matches_cpu():
    """The branch's own weight must reach the device too."""
    _needs("Add", "Concat")
    x = torch.arange(6.0).reshape(2, 3)
    for cond in (True, False):
        feeds = {"cond": torch.tensor(cond), "x": x}
        _same(_kiln(_if_model(), feeds, "cuda"), _kiln(_if_model(), feeds))


@pytest.mark.gpu
def test_cuda_loop_matches_cpu():
    _needs("Cast", "Add", "ReduceSum", "Less", "Identity")
    loop = _loop_model(True, True)
    feeds = {"M": torch.tensor(10), "cond": torch.tensor(True), "acc0": torch.tensor([1.0, -1.0]),
             "x": torch.tensor([0.5, 2.0]), "limit": torch.tensor(20.0)}
    _same(_kiln(loop, feeds, "cuda"), _kiln(loop, feeds))


@pytest.mark.gpu
def test_cuda_scan8_matches_cpu():
    """sequence_lens masks and reversal run on the device."""
    _needs("Add", "Mul")
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x"], ["s_out"]), helper.make_node("Mul", ["s_out", "x"], ["y"])],
        "body", [_vi("s_in", F, [2]), _vi("x", F, [2])], [_vi("s_out", F, [2]), _vi("y", F, [2])])
    scan = _model([helper.make_node("Scan", ["lens", "s0", "xs"], ["s", "ys"], num_scan_inputs=1, body=body,
                                     directions=[1])],
                  [_vi("lens", I64, [3]), _vi("s0", F, [3, 2]), _vi("xs", F, [3, 4, 2])],
                  [_vi("s", F, [3, 2]), _vi("ys", F, [3, 4, 2])], opset=8)
    feeds = {"lens": torch.tensor([4, 2, 1]), "s0": torch.ones(3, 2), "xs": torch.arange(24.0).reshape(3, 4, 2)}
    _same(_kiln(scan, feeds, "cuda"), _kiln(scan, feeds))
