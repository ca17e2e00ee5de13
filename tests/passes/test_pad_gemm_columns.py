import numpy as np
import pytest

from kiln.passes import fuse_gemm, pad_gemm_columns

from .util import check_pass, helper, model, ops, rand


def test_an_lm_head_of_unaligned_width_runs_on_padded_weights_and_is_sliced_back():
    m = model([helper.make_node("MatMul", ["x", "w"], ["logits"])], [("x", [2, 3, 16])], [("logits", [2, 3, 301])],
              {"w": rand(16, 301)})
    _, after = check_pass(pad_gemm_columns, m, {"x": rand(2, 3, 16, seed=1)})
    assert ops(after) == ["MatMul", "Slice"]
    assert tuple(after.initializers[after.nodes[0].inputs[1]].shape) == (16, 304)
    assert after.nodes[1].outputs == ["logits"]


def test_a_fused_gemm_pads_its_bias_too():
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])],
              [("x", [4, 16])], [("z", [4, 259])], {"w": rand(16, 259), "b": rand(259, seed=2)})

    class Both:
        @staticmethod
        def run(g):
            fuse_gemm.run(g)
            pad_gemm_columns.run(g)

    _, after = check_pass(Both, m, {"x": rand(4, 16, seed=3)})
    assert ops(after) == ["kiln::FusedGemm", "Slice"]
    assert tuple(after.initializers[after.nodes[0].inputs[2]].shape) == (264,)


@pytest.mark.parametrize("width", [256, 100])  # aligned already; too narrow to matter
def test_aligned_or_narrow_outputs_are_left_alone(width):
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [2, 16])], [("y", [2, width])],
              {"w": rand(16, width)})
    _, after = check_pass(pad_gemm_columns, m, {"x": rand(2, 16, seed=1)})
    assert ops(after) == ["MatMul"]


def test_the_built_engine_returns_the_true_width():
    import kiln

    m = model([helper.make_node("MatMul", ["x", "w"], ["logits"])], [("x", [2, 16])], [("logits", [2, 301])],
              {"w": rand(16, 301)})
    engine = kiln.build(m, kiln.BuildConfig(device="cpu", progress=False))
    x = rand(2, 16, seed=4)
    out = engine.create_execution_context().run({"x": x})["logits"]
    np.testing.assert_allclose(np.asarray(out), x @ rand(16, 301), rtol=1e-4, atol=1e-4)
