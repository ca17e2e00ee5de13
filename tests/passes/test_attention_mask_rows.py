import copy

import numpy as np
import torch
from onnx import TensorProto

from kiln.ir.from_onnx import model_to_graph
from kiln.passes import attention_mask_rows, fuse_attention

from .util import helper, model, ops, rand
from .util import run as run_graph

S = 5


def _bert_mask_attention(extra_reader: str = "", ones: np.ndarray | None = None):
    """HF BERT's SDPA export: the per-key padding mask [B, 1, 1, S] And an all-True [1, 1, S, 1], then Where into
    the additive mask of an attention."""
    nodes = [
        helper.make_node("Cast", ["keys"], ["keys_b"], to=TensorProto.BOOL),
        helper.make_node("And", ["ones", "keys_b"], ["wide"]),
        helper.make_node("Where", ["wide", "zero", "neg"], ["mask"]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    outputs = [("y", [2, 2, S, 4])]
    if extra_reader == "output":  # the widened mask is also a graph output: its shape is visible
        nodes.append(helper.make_node("Cast", ["wide"], ["wide_f"], to=TensorProto.FLOAT))
        outputs.append(("wide_f", [2, 1, S, S]))
    ones = np.ones((1, 1, S, 1), bool) if ones is None else ones
    m = model(nodes, [("q", [2, 2, S, 4]), ("kt", [2, 2, 4, S]), ("v", [2, 2, S, 4]), ("keys", [2, 1, 1, S])],
              outputs, {"ones": ones, "zero": np.float32(0), "neg": np.float32(-1e4)})
    keys = np.ones((2, 1, 1, S), np.float32)
    keys[1, ..., 3:] = 0  # the second sequence's last two keys are padding
    feeds = {"q": rand(2, 2, S, 4), "kt": rand(2, 2, 4, S, seed=1), "v": rand(2, 2, S, 4, seed=2), "keys": keys}
    return m, {k: torch.as_tensor(v) for k, v in feeds.items()}


def _before_and_after(m, feeds):
    before = model_to_graph(m)
    fuse_attention.run(before)
    after = copy.deepcopy(before)
    attention_mask_rows.run(after)
    for a, b in zip(run_graph(before, feeds), run_graph(after, feeds)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    return before, after


def test_a_mask_widened_only_over_the_queries_keeps_its_row_shape():
    m, feeds = _bert_mask_attention()
    before, after = _before_and_after(m, feeds)
    assert "And" in ops(before) and ops(after) == ["Cast", "Where", "kiln::Attention"]
    env = {**after.initializers, **feeds}
    from kiln.engine.interpreter import execute

    execute(after.nodes, env)
    assert tuple(env["mask"].shape) == (2, 1, 1, S)  # one row per sequence: the flash kernel's MASK_ROW path


def test_a_widened_mask_read_elsewhere_or_not_all_true_is_kept():
    m, feeds = _bert_mask_attention(extra_reader="output")
    _, after = _before_and_after(m, feeds)
    assert "And" in ops(after)
    ones = np.ones((1, 1, S, 1), bool)
    ones[0, 0, 2, 0] = False  # a causal-like constant: it changes values, not only the shape
    m, feeds = _bert_mask_attention(ones=ones)
    _, after = _before_and_after(m, feeds)
    assert "And" in ops(after)
    m, feeds = _bert_mask_attention(ones=np.ones((1, 2, S, 1), bool))  # it would widen the heads too
    _, after = _before_and_after(m, feeds)
    assert "And" in ops(after)
