import math

import numpy as np
import pytest

from kiln.passes import fuse_gemm

from .util import check_pass, helper, model, ops, rand


def test_matmul_bias_gelu_erf_as_exported():
    m = model([
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["a"]),
        helper.make_node("Div", ["a", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["half", "e1"], ["e2"]),
        helper.make_node("Mul", ["a", "e2"], ["y"]),
    ], [("x", [2, 3, 8])], [("y", [2, 3, 16])],
        {"w": rand(8, 16), "b": rand(16, seed=1), "sqrt2": np.float32(math.sqrt(2)),
         "one": np.float32(1), "half": np.float32(0.5)})
    _, after = check_pass(fuse_gemm, m, {"x": rand(2, 3, 8, seed=2)}, atol=1e-4)
    assert ops(after) == ["kiln::FusedGemm"] and after.nodes[0].attrs["activation"] == "GeluErf"
    assert len(after.nodes[0].sources) == 7


def test_gemm_transb_relu_stores_weight_kn():
    m = model([helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["y"])],
              [("x", [2, 8])], [("y", [2, 4])], {"w": rand(4, 8), "c": rand(4, seed=1)})
    _, after = check_pass(fuse_gemm, m, {"x": rand(2, 8, seed=2)}, atol=1e-4)
    assert ops(after) == ["kiln::FusedGemm"]
    assert tuple(after.initializers[after.nodes[0].inputs[1]].shape) == (8, 4)


def test_plain_matmul_inside_the_graph_is_left_alone():
    m = model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Neg", ["h"], ["y"])],
              [("x", [2, 8])], [("y", [2, 4])], {"w": rand(8, 4)})
    _, after = check_pass(fuse_gemm, m, {"x": rand(2, 8)})
    assert ops(after) == ["MatMul", "Neg"]


def test_a_plain_matmul_writing_a_model_output_becomes_a_fused_gemm():
    """An LM head: as a FusedGemm it can write the model's FP32 logits itself (builder/precision.py)."""
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [2, 8])], [("y", [2, 4])], {"w": rand(8, 4)})
    _, after = check_pass(fuse_gemm, m, {"x": rand(2, 8)})
    assert ops(after) == ["kiln::FusedGemm"] and after.nodes[0].inputs[1] == "w"


def test_a_tied_head_read_through_a_transpose_gets_its_own_kn_weight():
    """GPT-2's LM head reads the embedding table [N, K] through a Transpose too big for fold_constants."""
    m = model([helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
               helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
               helper.make_node("MatMul", ["x", "table_t"], ["logits"])],
              [("x", [2, 3, 8])], [("logits", [2, 3, 40]), ("e", [4, 8])], {"table": rand(40, 8), "ids": [1, 2, 3, 0]})
    _, after = check_pass(fuse_gemm, m, {"x": rand(2, 3, 8, seed=1)})
    assert ops(after) == ["Gather", "Transpose", "kiln::FusedGemm"]  # dead_code drops the unread Transpose
    w = after.initializers[after.nodes[2].inputs[1]]
    assert tuple(w.shape) == (8, 40) and w.is_contiguous()
    assert after.nodes[0].inputs[0] == "table"  # the embedding reads the table as it was


@pytest.mark.gpu
def test_on_cuda_an_fp16_lm_head_writes_fp32_logits_from_cublas():
    """llama_lm's head widths (1024 -> 32000, aligned) at 256 tokens: the GEMM writes the FP32 logits itself
    (torch.mm's out_dtype, which this torch must have), no cast kernel after it."""
    import torch

    import kiln

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    half = torch.ones(16, 16, device="cuda", dtype=torch.half)
    assert torch.mm(half, half, out_dtype=torch.float32).dtype == torch.float32  # else cublas_matmul widens
    w = rand(1024, 32000, seed=3) * 0.03
    m = model([helper.make_node("MatMul", ["x", "w"], ["logits"])], [("x", [1, 256, 1024])],
              [("logits", [1, 256, 32000])], {"w": w})
    engine = kiln.build(m, kiln.BuildConfig(device="cuda", fp16=True, progress=False))
    (head,) = engine.graph.nodes
    assert head.op_type == "FusedGemm" and head.tactic == "cublas_matmul" and head.attr("output_type") == "float32"
    x = torch.as_tensor(rand(1, 256, 1024, seed=4))
    got = engine.create_execution_context().run({"x": x.cuda()}, copy_outputs=False)["logits"]
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), x @ torch.as_tensor(w), atol=0.05, rtol=2e-2)
