import numpy as np
import onnx
import pytest
import torch

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


def _tied_head(vocab=301, hidden=16, tokens=3):
    """GPT-2's head as exported: the embedding table [vocab, hidden] gathered for the input and read by the LM
    head through a Transpose (tied weights), logits of an unaligned width as the FP32 model output."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("Add", ["e", "h"], ["s"]),
             helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["s", "table_t"], ["logits"])]
    m = model(nodes, [("h", [1, tokens, hidden])], [("logits", [1, tokens, vocab])],
              {"table": rand(vocab, hidden, seed=5)})
    m.graph.input.append(helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, tokens]))
    return m


def test_a_tied_gpt2_head_runs_on_padded_weights():
    """The head after the passes that run before the pad (fold_constants leaves the real one's Transpose: it
    is 38.6M elements): one FusedGemm on its own [K, N + pad] weight, the embedding reading the table unpadded."""
    class Both:
        @staticmethod
        def run(g):
            fuse_gemm.run(g)
            pad_gemm_columns.run(g)

    ids = np.array([[0, 7, 300]], dtype=np.int64)
    _, after = check_pass(Both, _tied_head(), {"h": rand(1, 3, 16, seed=1), "ids": ids}, atol=1e-4)
    head = next(n for n in after.nodes if n.op_type == "FusedGemm")
    assert tuple(after.initializers[head.inputs[1]].shape) == (16, 304)
    assert [n.op_type for n in after.nodes if n.outputs[0] == "logits"] == ["Slice"]
    assert tuple(after.initializers["table"].shape) == (301, 16)


def test_an_fp16_engine_writes_the_padded_logits_in_fp32_without_a_copy():
    """The FP16 head writes FP32 itself (output_type); the Slice to the true width passes it on as a view."""
    import kiln

    engine = kiln.build(_tied_head(), kiln.BuildConfig(device="cpu", fp16=True, progress=False))
    head = next(n for n in engine.graph.nodes if n.op_type == "FusedGemm")
    narrow = next(n for n in engine.graph.nodes if n.op_type == "Slice")
    assert head.precision == "float16" and head.attr("output_type") == "float32"
    assert narrow.precision == "float32" and narrow.outputs == ["logits"]
    h, ids = rand(1, 3, 16, seed=1), np.array([[0, 7, 300]], dtype=np.int64)
    out = engine.create_execution_context().run({"h": torch.as_tensor(h), "ids": torch.as_tensor(ids)},
                                                copy_outputs=False)["logits"]
    assert out.dtype == torch.float32 and out.shape == (1, 3, 301) and out.stride()[-2] == 304  # a view
    table = rand(301, 16, seed=5)
    ref = (table[ids[0]][None] + h) @ table.T
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_on_cuda_the_gpt2_head_is_an_aligned_fp32_writing_cublas_gemm():
    """GPT-2's head widths (768 -> 50257) at 256 tokens: cuBLAS through cublas_matmul, FP32 logits, no cast."""
    import kiln

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = kiln.build(_tied_head(vocab=50257, hidden=768, tokens=256),
                        kiln.BuildConfig(device="cuda", fp16=True, progress=False))
    head = next(n for n in engine.graph.nodes if n.op_type == "FusedGemm")
    assert head.tactic == "cublas_matmul" and head.attr("output_type") == "float32"
    h = torch.randn(1, 256, 768, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 50257, (1, 256), generator=torch.Generator().manual_seed(2))
    out = engine.create_execution_context().run({"h": h.cuda(), "ids": ids.cuda()}, copy_outputs=False)["logits"]
    assert out.dtype == torch.float32 and out.stride()[-2] == 50264
    table = torch.as_tensor(rand(50257, 768, seed=5)).cuda()
    ref = (table[ids.cuda()] + h.cuda()) @ table.T
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=0.5)
