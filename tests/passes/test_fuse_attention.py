import numpy as np

from kiln.passes import fuse_attention

from .util import check_pass, helper, model, ops, rand


def test_exported_sdpa_pattern_becomes_one_attention_layer():
    # torch's exporter: (q * s) @ (kT * s) + mask -> softmax -> NaN guard -> @ v
    m = model([
        helper.make_node("Mul", ["q", "s"], ["qs"]),
        helper.make_node("Mul", ["kt", "s"], ["ks"]),
        helper.make_node("MatMul", ["qs", "ks"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["pg"]),
        helper.make_node("MatMul", ["pg", "v"], ["y"]),
    ], [("q", [1, 2, 5, 4]), ("kt", [1, 2, 4, 5]), ("v", [1, 2, 5, 4]), ("mask", [1, 1, 5, 5])],
        [("y", [1, 2, 5, 4])], {"s": np.float32(0.5 ** 0.5), "zero": np.float32(0)})
    mask = np.where(np.arange(5) < 3, 0, -np.inf).astype(np.float32) * np.ones((1, 1, 5, 1), np.float32)
    feeds = {"q": rand(1, 2, 5, 4), "kt": rand(1, 2, 4, 5, seed=1), "v": rand(1, 2, 5, 4, seed=2), "mask": mask}
    _, after = check_pass(fuse_attention, m, feeds, atol=1e-5)
    assert ops(after) == ["kiln::Attention"]
    a = after.nodes[0]
    assert abs(a.attrs["scale"] - 0.5) < 1e-6 and a.attrs["nan_guard"] == 1 and len(a.sources) == 8


def test_softmax_read_elsewhere_is_reported():
    m = model([
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ], [("q", [2, 3]), ("kt", [3, 2]), ("v", [2, 3])], [("y", [2, 3]), ("p", [2, 2])])
    _, after = check_pass(fuse_attention, m, {"q": rand(2, 3), "kt": rand(3, 2), "v": rand(2, 3)})
    assert "kiln::Attention" not in ops(after)
    assert after.findings[0]["pattern"] == "attention"


def _attention_through_kt_chain(shape, swap_last_two=True):
    """Attention whose K^T is torch's exporter's chain for 4-D K: Reshape(K, [-1, S, D]) -> Transpose ->
    Reshape(K.shape[:-2] + [D, S]); with swap_last_two=False the last Reshape asks for [S, D] instead."""
    i64 = lambda *v: np.array(v, np.int64)
    split = ["lead", "d", "s"] if swap_last_two else ["lead", "s", "d"]
    m = model([
        helper.make_node("Shape", ["k"], ["shp"]),
        helper.make_node("Slice", ["shp", "m1", "big"], ["d"]),  # [D]
        helper.make_node("Slice", ["shp", "m2", "m1"], ["s"]),  # [S]
        helper.make_node("Slice", ["shp", "small", "m2"], ["lead"]),  # [B, H]
        helper.make_node("Concat", ["m1", "s", "d"], ["merged"], axis=0),
        helper.make_node("Reshape", ["k", "merged"], ["k3"]),
        helper.make_node("Transpose", ["k3"], ["k3t"], perm=[0, 2, 1]),
        helper.make_node("Concat", split, ["split"], axis=0),
        helper.make_node("Reshape", ["k3t", "split"], ["kt"]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ], [("q", shape), ("k", shape), ("v", shape)], [("y", shape)],
        {"m1": i64(-1), "m2": i64(-2), "big": i64(2**63 - 1), "small": i64(-2**63)})
    feeds = {"q": rand(*shape), "k": rand(*shape, seed=1), "v": rand(*shape, seed=2)}
    _, after = check_pass(fuse_attention, m, feeds)
    return after, next(n for n in after.nodes if n.op_type == "Attention")


def test_exported_k_transpose_chain_is_read_through():
    after, attn = _attention_through_kt_chain([2, 3, 5, 4])
    assert attn.inputs[1] == "k" and attn.attrs["k_transposed"] == 0
    assert not {"Reshape", "Transpose"} & set(ops(after))  # the copies are gone; Shape arithmetic is dead code


def test_a_reshape_that_is_not_k_transpose_is_kept():
    # With S == D the wrong Reshape even computes the same numbers; the shapes, not the values, decide.
    _, attn = _attention_through_kt_chain([2, 3, 4, 4], swap_last_two=False)
    assert attn.inputs[1] == "kt" and attn.attrs["k_transposed"] == 1


def _masked_attention(masked_value):
    """HF BERT's mask: Where(keep, 0, masked_value) added to the scores, then the exporter's NaN guard."""
    return model([
        helper.make_node("Where", ["keep", "zero", "masked"], ["mask"]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["pg"]),
        helper.make_node("MatMul", ["pg", "v"], ["y"]),
    ], [("q", [2, 1, 3, 4]), ("kt", [2, 1, 4, 3]), ("v", [2, 1, 3, 4])], [("y", [2, 1, 3, 4])],
        {"zero": np.float32(0), "masked": np.float32(masked_value),
         "keep": np.array([[[[True, True, False]]], [[[False, False, False]]]])})  # batch 1: every key masked


def test_nan_guard_is_dropped_when_the_mask_is_finite_by_construction():
    feeds = {"q": rand(2, 1, 3, 4), "kt": rand(2, 1, 4, 3, seed=1), "v": rand(2, 1, 3, 4, seed=2)}
    _, after = check_pass(fuse_attention, _masked_attention(np.finfo(np.float32).min), feeds)
    assert next(n for n in after.nodes if n.op_type == "Attention").attrs["nan_guard"] == 0
    _, after = check_pass(fuse_attention, _masked_attention(-np.inf), feeds)  # -inf: the fully masked row is NaN
    assert next(n for n in after.nodes if n.op_type == "Attention").attrs["nan_guard"] == 1


def test_swin_window_attention_with_bias_and_shift_mask_is_one_layer_on_five_dim_views():
    """Swin's shifted block adds its relative position bias to the scores [B * nW, H, N, N], then its shift mask
    through the view [B, nW, H, N, N]: one attention layer on [B, nW, H, N, D] views, the two as one constant."""
    import copy

    import torch

    from kiln import passes
    from kiln.ir.from_onnx import model_to_graph

    from .swin_block import HEADS, SIDE, WINDOW, N, exported
    from .util import run

    module, x, onnx_model = exported()
    before = model_to_graph(onnx_model)
    after = copy.deepcopy(before)
    for p in passes.up_to(fuse_attention):
        p.run(after)
    layers = [n for n in after.nodes if n.op_type == "Attention"]
    assert len(layers) == 2 and "Softmax" not in ops(after) and not after.findings
    shifted = module.blocks[1]
    mask = after.initializers[layers[1].inputs[3]]
    windows = (SIDE // WINDOW) ** 2
    assert mask.shape == (1, windows, HEADS, N, N)
    torch.testing.assert_close(mask, shifted.bias.detach().unsqueeze(0) + shifted.mask.unsqueeze(1).unsqueeze(0))
    got, = run(after, {"x": x})
    torch.testing.assert_close(got, run(before, {"x": x})[0], atol=1e-5, rtol=1e-5)
