import copy

import torch

from kiln.ir.from_onnx import model_to_graph
from kiln.passes import fuse_gemm, fuse_gemm_skip_layernorm, fuse_skip_layernorm

from .util import helper, model, ops, rand, run


def _block(extra_reader: bool = False, activation: bool = False):
    """BERT's out-projection: y = LayerNorm(x @ w + b + r)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["lin"])]
    if activation:
        nodes.append(helper.make_node("Relu", ["lin"], ["act"]))
    top = "act" if activation else "lin"
    nodes += [helper.make_node("Add", [top, "r"], ["s"]),
              helper.make_node("LayerNormalization", ["s", "g", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    outputs = [("y", [2, 3, 8])]
    if extra_reader:
        nodes.append(helper.make_node("Neg", [top], ["z"]))
        outputs.append(("z", [2, 3, 8]))
    return model(nodes, [("x", [2, 3, 12]), ("r", [2, 3, 8])], outputs,
                 {"w": rand(12, 8), "b": rand(8, seed=1), "g": rand(8, seed=2), "beta": rand(8, seed=3)})


def _fused(m):
    before = model_to_graph(m)
    after = copy.deepcopy(before)
    for p in (fuse_gemm, fuse_skip_layernorm, fuse_gemm_skip_layernorm):
        p.run(after)
    return before, after


def test_gemm_feeding_only_the_norm_joins_it():
    before, after = _fused(_block())
    assert ops(after) == ["kiln::GemmSkipLayerNorm"]
    layer = after.nodes[0]
    assert layer.inputs[:4] == ["x", "w", "b", "r"] and layer.outputs[0] == "y"
    assert len(layer.sources) == 4  # MatMul, bias Add, residual Add, LayerNormalization: the inspector shows them
    feeds = {"x": torch.as_tensor(rand(2, 3, 12, seed=4)), "r": torch.as_tensor(rand(2, 3, 8, seed=5))}
    torch.testing.assert_close(run(after, feeds)[0], run(before, feeds)[0], atol=1e-5, rtol=1e-4)


def test_gemm_read_elsewhere_or_with_an_activation_stays_apart():
    for m in (_block(extra_reader=True), _block(activation=True)):
        _, after = _fused(m)
        assert "kiln::GemmSkipLayerNorm" not in ops(after)
        assert "kiln::SkipLayerNorm" in ops(after)
