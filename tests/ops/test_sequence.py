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
from kiln.engine.interpreter import call_node
from kiln.errors import KilnError
from kiln.frontend import check_model
from kiln.ir.from_onnx import graph_from_onnx
from kiln.ir.graph import Node

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


def _call(op, *args, body=None, **attrs):
    """One op's implementation on these inputs (None: an omitted optional input), as the interpreter calls it."""
    if body is not None:
        attrs["body"] = graph_from_onnx(body, {"": 18})
    node = Node(op, [f"in{i}" if a is not None else "" for i, a in enumerate(args)], ["out"], attrs,
                name=f"{op.lower()}_under_test", opset=18)
    outs = call_node(node, list(args))
    return outs[0] if len(outs) == 1 else outs


def _t(*arrays):
    return [torch.from_numpy(a) for a in arrays]


def test_sequence_empty():
    assert _call("SequenceEmpty", dtype=F) == []


def test_sequence_construct():
    _same(_call("SequenceConstruct", *_t(A, B, C)), [A, B, C])


@pytest.mark.parametrize("position", [None, 0, 1, 2, -1, -2])
def test_sequence_insert(position):
    seq = _t(A, B)
    got = _call("SequenceInsert", seq, torch.from_numpy(C), None if position is None else torch.tensor(position))
    want = [A, B]
    want.insert(len(want) if position is None else position, C)  # list.insert reads negatives as ONNX does
    _same(got, want)
    assert len(seq) == 2  # a new sequence; the input's is unchanged


@pytest.mark.parametrize("position", [0, 2, -1, -3])
def test_sequence_at(position):
    _same(_call("SequenceAt", _t(A, B, C), torch.tensor(position)), [A, B, C][position])


def test_sequence_at_outside_the_sequence_names_the_node():
    with pytest.raises(KilnError, match=r"'sequenceat_under_test'.*position 2 is outside \[-2, 1\]"):
        _call("SequenceAt", _t(A, B), torch.tensor(2))


@pytest.mark.parametrize("position", [None, 0, -2])
def test_sequence_erase(position):
    got = _call("SequenceErase", _t(A, B, C), None if position is None else torch.tensor(position))
    want = [A, B, C]
    del want[-1 if position is None else position]
    _same(got, want)


def test_sequence_length():
    got = _call("SequenceLength", _t(A, B, C))
    assert got.dtype == torch.int64 and got.shape == () and int(got) == 3


@pytest.mark.parametrize("axis, new_axis", [(0, 0), (-1, 0), (0, 1), (-1, 1), (2, 1)])
def test_concat_from_sequence(axis, new_axis):
    x, y = torch.from_numpy(A), torch.from_numpy(A[::-1].copy())
    got = _call("ConcatFromSequence", [x, y], axis=axis, new_axis=new_axis)
    _same(got, torch.stack([x, y], axis) if new_axis else torch.cat([x, y], axis))


@pytest.mark.parametrize("split, axis, keepdims", [(None, 1, 1), (None, 1, 0), (3, 1, 1), ([1, 3], 0, 1),
                                                   ([2, 2], -1, 0)])
def test_split_to_sequence(split, axis, keepdims):
    x = torch.arange(16.0).reshape(4, 4)
    got = _call("SplitToSequence", x, None if split is None else torch.tensor(split), axis=axis, keepdims=keepdims)
    if split is None:
        want = [p if keepdims else p.squeeze(axis) for p in torch.split(x, 1, axis)]
    else:
        want = list(torch.split(x, split, axis))  # keepdims applies only without split; a scalar: the last shorter
    _same(got, want)


def test_sequence_map_runs_the_body_per_element():
    body = helper.make_graph([helper.make_node("Mul", ["e", "w"], ["o"])], "body",
                             [helper.make_tensor_value_info("e", F, None), helper.make_tensor_value_info("w", F, None)],
                             [helper.make_tensor_value_info("o", F, None)])
    w = torch.tensor([2.0, 3.0, 4.0])
    _same(_call("SequenceMap", _t(A, B), w, body=body), [torch.from_numpy(A) * w, torch.from_numpy(B) * w])


# --- built into engines ----------------------------------------------------------------------------------------

def test_sequences_the_build_cannot_resolve_run_in_the_interpreter():
    """A position read from an input, and a sequence as the output: the sequence ops stay in the engine."""
    nodes = [_construct("a", "b"), helper.make_node("SequenceInsert", ["s", "c"], ["t"]),
             helper.make_node("SequenceAt", ["t", "pos"], ["at"]),
             helper.make_node("SequenceErase", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, F, v.shape) for k, v in
                                           {"a": A, "b": B, "c": C}.items()] + [helper.make_tensor_value_info("pos", I64, [])],
                              [helper.make_tensor_value_info("at", F, None), helper.make_tensor_sequence_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    assert {"SequenceConstruct", "SequenceInsert", "SequenceAt", "SequenceErase"} <= {n.op_type for n in engine.graph.nodes}
    ctx = engine.create_execution_context()
    for pos in (2, -3):
        got = ctx.run({"a": torch.from_numpy(A), "b": torch.from_numpy(B), "c": torch.from_numpy(C),
                       "pos": torch.tensor(pos)})
        _same(got["at"], [A, B, C][pos])
        _same(got["y"], [A, B])


def test_a_sequence_of_known_elements_becomes_tensors():
    nodes = [_construct("a", "b"), helper.make_node("SequenceInsert", ["s", "c", "pos"], ["t"]),
             helper.make_node("ConcatFromSequence", ["t"], ["y"], axis=0)]
    feeds = {"a": A, "b": B, "c": C}
    engine = kiln.build(_model(nodes, feeds, {"y": "tensor"}, {"pos": 1}), kiln.BuildConfig(device="cpu", progress=False))
    assert [n.op_type for n in engine.graph.nodes] == ["Concat"] and engine.capturable
    got = engine.create_execution_context().run({k: torch.from_numpy(v) for k, v in feeds.items()})["y"]
    _same(got, np.concatenate([A, C, B]))


def test_kiln_check_accepts_a_sequence_output_and_names_the_binding_for_a_sequence_input():
    split = _model([helper.make_node("SplitToSequence", ["x"], ["s"], axis=0)], {"x": A}, {"s": "sequence"})
    assert check_model(split).buildable
    t = helper.make_sequence_type_proto(helper.make_tensor_type_proto(F, [2]))
    graph = helper.make_graph([helper.make_node("ConcatFromSequence", ["x"], ["y"], axis=0)], "g",
                              [helper.make_value_info("x", t)], [helper.make_tensor_value_info("y", F, [4])])
    report = check_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    assert not report.buildable
    assert any("'x' is a sequence value" in p and "bind_sequence_inputs" in p for p in report.other_problems)


def _bag_loop_model(bags: int, offsets_input=False, opset=18):
    """What torch.onnx writes for nn.EmbeddingBag(mode='sum'): a Loop over the bags, each iteration summing its
    rows of x into a tensor it appends to a loop-carried sequence, then ConcatFromSequence. The trip count comes
    from a constant (the number of bags), so the build can unroll it (passes/inline_control_flow.py); with
    offsets_input the offsets are an input and the count is its length less one (as a dynamic batch would
    make it), so the Loop stays and runs in the interpreter."""
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
             numpy_helper.from_array(np.array(True), "true")]
    inputs = [vi("x", F, [8, 4])]
    if offsets_input:
        inputs.append(vi("offsets", I64, [bags + 1]))
        nodes[:0] = [helper.make_node("Shape", ["offsets"], ["n_1d"]), helper.make_node("Squeeze", ["n_1d", "zero"], ["m"]),
                     helper.make_node("Sub", ["m", "one"], ["n"])]
    else:
        inits += [numpy_helper.from_array(_offsets(bags), "offsets"), numpy_helper.from_array(np.array(bags, np.int64), "n")]
    graph = helper.make_graph(nodes, "bags", inputs, [vi("y", F, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _offsets(bags: int) -> np.ndarray:
    return np.array([0, 2, 3, 6, 8][:bags + 1], np.int64)


def _bag_reference(x: np.ndarray, bags: int) -> torch.Tensor:
    offsets = torch.tensor([0, 2, 3, 6, 8][:bags])
    ids = torch.arange([0, 2, 3, 6, 8][bags])
    return torch.nn.functional.embedding_bag(ids, torch.from_numpy(x), offsets, mode="sum")


def test_loop_carried_sequence_unrolled_matches_embedding_bag():
    """A count the build knows: unrolled into Slice/ReduceSum/Concat, no Loop or sequence left, one CUDA graph."""
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    engine = kiln.build(_bag_loop_model(4), kiln.BuildConfig(device="cpu", progress=False))
    assert engine.capturable and not {"Loop", "SequenceInsert", "ConcatFromSequence"} & {n.op_type for n in engine.graph.nodes}
    got = engine.create_execution_context().run({"x": torch.from_numpy(x)})["y"]
    torch.testing.assert_close(got, _bag_reference(x, 4))


@pytest.mark.parametrize("bags", [1, 4])
def test_loop_carried_sequence_in_the_interpreter_matches_embedding_bag(bags):
    """Offsets read from an input: the Loop and its sequence run in the interpreter."""
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    engine = kiln.build(_bag_loop_model(bags, offsets_input=True), kiln.BuildConfig(device="cpu", progress=False))
    assert not engine.capturable and "Loop" in {n.op_type for n in engine.graph.nodes}
    got = engine.create_execution_context().run({"x": torch.from_numpy(x), "offsets": torch.from_numpy(_offsets(bags))})["y"]
    torch.testing.assert_close(got, _bag_reference(x, bags))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "float16"])
@pytest.mark.parametrize("offsets_input", [False, True])
def test_cuda_loop_carried_sequence_matches_embedding_bag(precision, offsets_input):
    """On the device, FP16 too: unrolled to tensor kernels (one CUDA graph), or the Loop and its sequence eagerly."""
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    engine = kiln.build(_bag_loop_model(4, offsets_input),
                        kiln.BuildConfig(device="cuda", fp16=precision == "float16", progress=False))
    assert engine.capturable is not offsets_input
    feeds = {"x": torch.from_numpy(x).cuda(), **({"offsets": torch.from_numpy(_offsets(4)).cuda()} if offsets_input else {})}
    ctx = engine.create_execution_context()
    for _ in range(2):  # the second run replays the captured graph
        got = ctx.run(feeds)["y"]
        assert got.is_cuda and got.dtype == torch.float32
        tol = 1e-2 if precision == "float16" else 1e-5
        torch.testing.assert_close(got.cpu(), _bag_reference(x, 4), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_cuda_sequence_ops_in_the_interpreter_match_cpu(precision):
    """Sequence values on the device: positions read from an input, a sequence output of device tensors."""
    nodes = [_construct("a", "b"), helper.make_node("SequenceInsert", ["s", "c", "pos"], ["t"]),
             helper.make_node("SequenceAt", ["t", "pos"], ["at"]),
             helper.make_node("ConcatFromSequence", ["t"], ["cat"], axis=0), helper.make_node("SequenceErase", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, F, v.shape) for k, v in
                                           {"a": A, "b": B, "c": C}.items()] + [helper.make_tensor_value_info("pos", I64, [])],
                              [helper.make_tensor_value_info("at", F, None), helper.make_tensor_value_info("cat", F, None),
                               helper.make_tensor_sequence_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    feeds = {"a": torch.from_numpy(A), "b": torch.from_numpy(B), "c": torch.from_numpy(C), "pos": torch.tensor(1)}
    engine = kiln.build(model, kiln.BuildConfig(device="cuda", fp16=precision == "float16", progress=False))
    got = engine.create_execution_context().run(feeds)
    assert got["at"].is_cuda and all(t.is_cuda and t.dtype == torch.float32 for t in got["y"])
    _same(got["cat"].cpu(), np.concatenate([A, C, B]))
    _same(got["at"].cpu(), C)
    _same([t.cpu() for t in got["y"]], [A, C])
