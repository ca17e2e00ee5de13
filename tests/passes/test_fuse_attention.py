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
