import copy

import numpy as np
import torch

from kiln.ir.from_onnx import model_to_graph
from kiln.passes import fuse_gemm, fuse_pooled_gemm

from .util import helper, model, ops, rand, run

C, OUT = 6, 5


def _head(pool="ReduceMean", flatten="Reshape", extra_reader=False, axes=(2, 3)):
    """A CNN's head: average pool over H, W -> flatten -> classifier (MatMul + bias Add)."""
    inits = {"w": rand(C, OUT), "b": rand(OUT, seed=1), "axes": np.array(axes, dtype=np.int64),
             "shape": np.array([-1, C], dtype=np.int64)}
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["pooled"], keepdims=1) if pool == "ReduceMean"
             else helper.make_node("GlobalAveragePool", ["x"], ["pooled"])]
    nodes.append(helper.make_node("Reshape", ["pooled", "shape"], ["flat"]) if flatten == "Reshape"
                 else helper.make_node("Flatten", ["pooled"], ["flat"], axis=1))
    nodes += [helper.make_node("MatMul", ["flat", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["y"])]
    outputs = [("y", [2, OUT])]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["pooled"], ["z"]))
        outputs.append(("z", [2, C, 1, 1]))
    return model(nodes, [("x", [2, C, 4, 3])], outputs, inits, opset=18)


def _fused(m):
    before = model_to_graph(m)
    after = copy.deepcopy(before)
    for p in (fuse_gemm, fuse_pooled_gemm):
        p.run(after)
    return before, after


def test_pool_flatten_and_classifier_become_one_layer():
    for pool, flatten in (("ReduceMean", "Reshape"), ("GlobalAveragePool", "Flatten")):
        before, after = _fused(_head(pool, flatten))
        assert ops(after) == ["kiln::PooledGemm"]
        layer = after.nodes[0]
        assert layer.inputs[0] == "x" and layer.outputs == ["y"]
        assert len(layer.sources) == 4  # pool, flatten, MatMul, bias Add: the inspector shows them
        feeds = {"x": torch.as_tensor(rand(2, C, 4, 3, seed=4))}
        torch.testing.assert_close(run(after, feeds)[0], run(before, feeds)[0], atol=1e-5, rtol=1e-4)


def test_a_pool_read_elsewhere_or_over_other_axes_stays_apart():
    for m in (_head(extra_reader=True), _head(axes=(1, 2))):
        _, after = _fused(m)
        assert "kiln::PooledGemm" not in ops(after)
        assert "kiln::FusedGemm" in ops(after)
