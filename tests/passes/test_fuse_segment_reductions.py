import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.passes import dead_code, fuse_segment_reductions

from .util import check_pass, ops, rand

vi = helper.make_tensor_value_info


class _Pipeline:  # the pass, then dead_code dropping the per-segment slices and reductions
    @staticmethod
    def run(graph):
        fuse_segment_reductions.run(graph)
        dead_code.run(graph)


def _bags(starts, length, op="ReduceSum", opset=18, x_shape=(12, 3, 2)):
    """Concat of op(x[s:s+length], axis 0, keepdims) for each s: what an unrolled EmbeddingBag loop leaves."""
    nodes, inits, parts = [], {"zero": np.array([0], np.int64)}, []
    for k, s in enumerate(starts):
        inits[f"s{k}"], inits[f"e{k}"] = np.array([s], np.int64), np.array([s + length], np.int64)
        nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}"], [f"rows{k}"]))
        axes_input = opset >= (13 if op == "ReduceSum" else 18)
        nodes.append(helper.make_node(op, [f"rows{k}", "zero"] if axes_input else [f"rows{k}"], [f"bag{k}"],
                                      **({} if axes_input else {"axes": [0]})))
        parts.append(f"bag{k}")
    nodes.append(helper.make_node("Concat", parts, ["y"], axis=0))
    graph = helper.make_graph(nodes, "t", [vi("x", TensorProto.FLOAT, list(x_shape))], [vi("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("op, opset", [("ReduceSum", 18), ("ReduceSum", 13), ("ReduceMean", 18), ("ReduceMax", 11)])
def test_consecutive_equal_bags_become_one_reduction(op, opset):
    _, after = check_pass(_Pipeline, _bags([2, 5, 8], 3, op, opset), {"x": rand(12, 3, 2)})
    assert ops(after)[-2:] == ["Reshape", op] and ops(after).count(op) == 1


@pytest.mark.parametrize("starts, length", [([0, 4, 8], 3), ([0, 2, 5], 2), ([3, 0], 3)])
def test_gaps_overlaps_and_reordered_bags_stay(starts, length):
    _, after = check_pass(_Pipeline, _bags(starts, length), {"x": rand(12, 3, 2)})
    assert ops(after).count("ReduceSum") == len(starts)


def test_an_exported_embedding_bag_is_one_gather_and_one_reduction():
    """torch.onnx's nn.EmbeddingBag (a Loop over the bags appending to a sequence), through the whole build:
    unrolled, lowered to tensors, then the per-bag slices and sums fused (passes/inline_control_flow.py,
    passes/lower_sequences.py, this pass)."""
    import torch

    import kiln

    bag = torch.nn.EmbeddingBag(50, 4, mode="sum").eval()
    ids = torch.randint(0, 50, (6, 5), generator=torch.Generator().manual_seed(0))
    model, _ = kiln.from_torch(bag, (ids,))
    engine = kiln.build(model, kiln.BuildConfig(device="cpu", progress=False))
    kinds = [n.op_type for n in engine.graph.nodes]
    assert engine.capturable and not {"Loop", "If", "SequenceInsert", "ConcatFromSequence"} & set(kinds)
    assert kinds.count("ReduceSum") == 1 and kinds.count("Gather") == 1
    (got,) = engine.create_execution_context().run([ids]).values()
    torch.testing.assert_close(got, bag(ids).detach())
