"""Hand tests for sequence.py, one per op, each against a torch / Python-list reference.

Sequences reach the graphs through SequenceConstruct or SequenceEmpty (a model input must be bound as tensors,
frontend/sequence_inputs.py); a sequence output comes back as a list of tensors. Positions are weights, read on
the host as the registry says.
"""

import numpy as np
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import kiln
from kiln.errors import KilnError

F, I64 = TP.FLOAT, TP.INT64
A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = -np.arange(3, dtype=np.float32).reshape(1, 3)
C = np.full((3, 3), 7, np.float32)


def _model(nodes, feeds, outputs, consts=None, opset=18):
    """outputs: name -> 'tensor' or 'sequence' (float); consts: name -> int64 array (initializers)."""
    inits = [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in (consts or {}).items()]
    outs = [helper.make_tensor_sequence_value_info(k, F, None) if kind == "sequence"
            else helper.make_tensor_value_info(k, TP.INT64 if kind == "int64" else F, None)
            for k, kind in outputs.items()]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, F, v.shape) for k, v in feeds.items()],
                              outs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(model, feeds, device="cpu", precision="float32"):
    engine = kiln.build(model, kiln.BuildConfig(device=device, fp16=precision == "float16", progress=False))
    return list(engine.create_execution_context().run({k: torch.from_numpy(v) for k, v in feeds.items()}).values())


def _construct(*names, out="s"):
    return helper.make_node("SequenceConstruct", list(names), [out], name="construct")


def _same(got, want):
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
        return
    assert tuple(got.shape) == tuple(want.shape)
    torch.testing.assert_close(got.cpu().float(), torch.as_tensor(want).float(), rtol=0, atol=0)


def test_sequence_empty_then_inserts():
    nodes = [helper.make_node("SequenceEmpty", [], ["e"], dtype=F),
             helper.make_node("SequenceInsert", ["e", "a"], ["s1"]),
             helper.make_node("SequenceInsert", ["s1", "b"], ["s"])]
    (got,) = _run(_model(nodes, {"a": A, "b": B}, {"s": "sequence"}), {"a": A, "b": B})
    _same(got, [A, B])


def test_sequence_construct():
    (got,) = _run(_model([_construct("a", "b", "c")], {"a": A, "b": B, "c": C}, {"s": "sequence"}),
                  {"a": A, "b": B, "c": C})
    _same(got, [A, B, C])


@pytest.mark.parametrize("position", [None, 0, 1, 2, -1, -2])
def test_sequence_insert_at_position(position):
    ins = ["s", "c"] + (["pos"] if position is not None else [])
    nodes = [_construct("a", "b"), helper.make_node("SequenceInsert", ins, ["y"])]
    consts = {"pos": position} if position is not None else {}
    (got,) = _run(_model(nodes, {"a": A, "b": B, "c": C}, {"y": "sequence"}, consts), {"a": A, "b": B, "c": C})
    want = [A, B]
    want.insert(len(want) if position is None else position if position >= 0 else position + 2, C)
    _same(got, want)


@pytest.mark.parametrize("position", [0, 2, -1, -3])
def test_sequence_at(position):
    nodes = [_construct("a", "b", "c"), helper.make_node("SequenceAt", ["s", "pos"], ["y"])]
    (got,) = _run(_model(nodes, {"a": A, "b": B, "c": C}, {"y": "tensor"}, {"pos": position}),
                  {"a": A, "b": B, "c": C})
    _same(got, [A, B, C][position])


def test_sequence_at_outside_the_sequence_names_the_node():
    nodes = [_construct("a", "b"), helper.make_node("SequenceAt", ["s", "pos"], ["y"], name="pick")]
    with pytest.raises(KilnError, match=r"'pick'.*position 2 is outside \[-2, 1\]"):
        _run(_model(nodes, {"a": A, "b": B}, {"y": "tensor"}, {"pos": 2}), {"a": A, "b": B})


def test_sequence_length():
    nodes = [_construct("a", "b", "c"), helper.make_node("SequenceLength", ["s"], ["n"])]
    (got,) = _run(_model(nodes, {"a": A, "b": B, "c": C}, {"n": "int64"}), {"a": A, "b": B, "c": C})
    assert got.dtype == torch.int64 and got.shape == () and int(got) == 3


@pytest.mark.parametrize("position", [None, 0, -2])
def test_sequence_erase(position):
    ins = ["s"] + (["pos"] if position is not None else [])
    nodes = [_construct("a", "b", "c"), helper.make_node("SequenceErase", ins, ["y"])]
    consts = {"pos": position} if position is not None else {}
    (got,) = _run(_model(nodes, {"a": A, "b": B, "c": C}, {"y": "sequence"}, consts), {"a": A, "b": B, "c": C})
    want = [A, B, C]
    del want[-1 if position is None else position]
    _same(got, want)


@pytest.mark.parametrize("axis, new_axis", [(0, 0), (-1, 0), (0, 1), (-1, 1), (2, 1)])
def test_concat_from_sequence(axis, new_axis):
    x, y = A, A[::-1].copy()
    nodes = [_construct("x", "y"), helper.make_node("ConcatFromSequence", ["s"], ["z"], axis=axis, new_axis=new_axis)]
    (got,) = _run(_model(nodes, {"x": x, "y": y}, {"z": "tensor"}), {"x": x, "y": y})
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    _same(got, torch.stack([tx, ty], axis) if new_axis else torch.cat([tx, ty], axis))


@pytest.mark.parametrize("split, axis, keepdims", [(None, 1, 1), (None, 1, 0), (2, 1, 1), ([1, 3], 0, 1),
                                                   ([2, 2], -1, 0)])
def test_split_to_sequence(split, axis, keepdims):
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    ins = ["x"] + (["split"] if split is not None else [])
    nodes = [helper.make_node("SplitToSequence", ins, ["s"], axis=axis, keepdims=keepdims)]
    consts = {"split": split} if split is not None else {}
    (got,) = _run(_model(nodes, {"x": x}, {"s": "sequence"}, consts), {"x": x})
    tx = torch.from_numpy(x)
    if split is None:
        want = [p if keepdims else p.squeeze(axis) for p in torch.split(tx, 1, axis)]
    else:
        want = list(torch.split(tx, split, axis))  # keepdims applies only without split
    _same(got, want)


def test_sequence_map_runs_the_body_per_element():
    body = helper.make_graph([helper.make_node("Mul", ["e", "w"], ["o"])], "body",
                             [helper.make_tensor_value_info("e", F, None), helper.make_tensor_value_info("w", F, None)],
                             [helper.make_tensor_value_info("o", F, None)])
    nodes = [_construct("a", "b"), helper.make_node("SequenceMap", ["s", "w"], ["y"], body=body)]
    w = np.array([2, 3, 4], np.float32)
    (got,) = _run(_model(nodes, {"a": A, "b": B, "w": w}, {"y": "sequence"}), {"a": A, "b": B, "w": w})
    _same(got, [A * w, B * w])


def _bag_loop_model(bags: int, opset=18):
    """What torch.onnx writes for nn.EmbeddingBag(mode='sum'): a Loop over the bags, each iteration summing its
    rows of x into a tensor it appends to a loop-carried sequence, then ConcatFromSequence. The trip count comes
    from a constant (the number of bags), so the build can unroll it (passes/inline_control_flow.py)."""
    vi = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Add", ["i", "one"], ["i1"]),
         helper.make_node("Unsqueeze", ["i", "zero"], ["i_1d"]),
         helper.make_node("Unsqueeze", ["i1", "zero"], ["i1_1d"]),
         helper.make_node("Slice", ["offsets", "i_1d", "i1_1d"], ["start"]),
         helper.make_node("Add", ["i_1d", "one"], ["next_1d"]),
         helper.make_node("Add", ["next_1d", "one"], ["after_1d"]),
         helper.make_node("Slice", ["offsets", "next_1d", "after_1d"], ["end"]),
         helper.make_node("Slice", ["x", "start", "end"], ["rows"]),
         helper.make_node("ReduceSum", ["rows", "zero"], ["bag"], keepdims=1),
         helper.make_node("SequenceInsert", ["seq_in", "bag"], ["seq_out"]),
         helper.make_node("Less", ["i1", "n"], ["cond_out"])],
        "bag_body", [vi("i", I64, []), vi("cond_in", TP.BOOL, []), helper.make_tensor_sequence_value_info("seq_in", F, None)],
        [vi("cond_out", TP.BOOL, []), helper.make_tensor_sequence_value_info("seq_out", F, None)])
    nodes = [helper.make_node("SequenceEmpty", [], ["empty"], dtype=F),
             helper.make_node("Loop", ["", "true", "empty"], ["bags"], body=body, name="bag_loop"),
             helper.make_node("ConcatFromSequence", ["bags"], ["y"], axis=0)]
    inits = [numpy_helper.from_array(np.array(1, np.int64), "one"), numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array(bags, np.int64), "n"), numpy_helper.from_array(np.array(True), "true"),
             numpy_helper.from_array(np.array([0, 2, 3, 6, 8][:bags + 1], np.int64), "offsets")]
    graph = helper.make_graph(nodes, "bags", [vi("x", F, [8, 4])], [vi("y", F, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _bag_reference(x: np.ndarray, bags: int) -> torch.Tensor:
    offsets = torch.tensor([0, 2, 3, 6, 8][:bags])
    ids = torch.arange([0, 2, 3, 6, 8][bags])
    return torch.nn.functional.embedding_bag(ids, torch.from_numpy(x), offsets, mode="sum")


def test_loop_carried_sequence_matches_embedding_bag():
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    (got,) = _run(_bag_loop_model(4), {"x": x})
    torch.testing.assert_close(got, _bag_reference(x, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_cuda_sequence_ops_match_cpu(precision):
    """On the device, in FP16 too: inserts, reads and concatenation of sequences, and a loop-carried sequence."""
    nodes = [_construct("a", "b"), helper.make_node("SequenceInsert", ["s", "c", "pos"], ["t"]),
             helper.make_node("SequenceAt", ["t", "pos"], ["at"]),
             helper.make_node("ConcatFromSequence", ["t"], ["cat"], axis=0)]
    feeds = {"a": A, "b": B, "c": C}
    model = _model(nodes, feeds, {"at": "tensor", "cat": "tensor"}, {"pos": 1})
    tol = 1e-3 if precision == "float16" else 0
    for got, want in zip(_run(model, feeds, "cuda", precision), _run(model, feeds)):
        assert got.is_cuda and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    (got,) = _run(_bag_loop_model(4), {"x": x}, "cuda", precision)
    torch.testing.assert_close(got.cpu(), _bag_reference(x, 4), rtol=tol * 10, atol=tol * 10)
