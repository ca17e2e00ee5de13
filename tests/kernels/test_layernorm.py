import pytest
import torch

from kiln.kernels import layernorm

from .util import poisoned

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, cols", [(1, 7), (5, 33), (3, 100)])  # not multiples of the block
@pytest.mark.parametrize("with_beta", [True, False])
def test_skip_layernorm_matches_reference(rows, cols, with_beta):
    g = torch.Generator().manual_seed(rows * cols)
    a, b = (torch.randn(rows, cols, generator=g).to(DEV) for _ in range(2))
    gamma = torch.randn(cols, generator=g).to(DEV)
    beta = torch.randn(cols, generator=g).to(DEV) if with_beta else None
    y, s = layernorm.skip_layernorm(a, b, gamma, beta, 1e-5)
    ry, rs = layernorm.reference(a, b, gamma, beta, 1e-5)
    torch.testing.assert_close(y, ry, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, rs)


@pytest.mark.parametrize("launch", layernorm.LAUNCHES + (layernorm.Launch(4, 128), layernorm.Launch(8, 4096)),
                         ids=lambda launch: launch.name)
def test_every_launch_including_a_last_partial_program(launch):
    """Rows read through two leading strides (a transposed view), 10 rows: the last program's block runs past the
    end, which must be neither read nor written. The 8-bit copy matches quantizing the stored rows."""
    from kiln.kernels.gemm import QTYPES

    g = torch.Generator().manual_seed(launch.rows)
    a = torch.randn(5, 2, 40, generator=g).to(DEV).transpose(0, 1)  # [2, 5, 40], rows not contiguous
    b = torch.randn(2, 5, 40, generator=g).to(DEV)
    gamma, beta = torch.randn(40, generator=g).to(DEV), torch.randn(40, generator=g).to(DEV)
    q_scale = torch.tensor([0.02], device=DEV)
    y, s, q = poisoned(lambda: layernorm.skip_layernorm(a, b, gamma, beta, 1e-5, q_scale=q_scale, qtype="int8",
                                                        launch=launch))
    ry, rs = layernorm.reference(a, b, gamma, beta, 1e-5)
    torch.testing.assert_close(y, ry, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, rs)
    assert q.dtype == QTYPES["int8"]
    torch.testing.assert_close(q.float(), (y / q_scale).round().clamp(-128, 127), atol=1, rtol=0)


def test_fp16_rows_normalized_into_an_fp32_output():
    # a transformer's last norm writing the model's FP32 output itself (builder/precision.py): one kernel, no cast
    g = torch.Generator().manual_seed(12)
    a, b = (torch.randn(4, 48, generator=g).half().to(DEV) for _ in range(2))
    gamma, beta = torch.randn(48, generator=g).half().to(DEV), torch.randn(48, generator=g).half().to(DEV)
    y, s = poisoned(lambda: layernorm.skip_layernorm(a, b, gamma, beta, 1e-5, y_dtype=torch.float32))
    assert y.dtype == torch.float32 and s.dtype == torch.float16
    ry, rs = layernorm.reference(a.float(), b.float(), gamma.float(), beta.float(), 1e-5)
    torch.testing.assert_close(y, ry, atol=2e-3, rtol=2e-3)  # the sum rounds to FP16 only where it is stored
    parts = torch.stack([a.float(), torch.zeros_like(a, dtype=torch.float32)])
    y2, _ = poisoned(lambda: layernorm.partials_layernorm(parts, None, b, gamma, beta, 1e-5, y_dtype=torch.float32))
    assert y2.dtype == torch.float32
    torch.testing.assert_close(y2, ry, atol=2e-3, rtol=2e-3)


def test_fp32_gamma_and_beta_with_fp16_rows():
    # 8-bit engines keep the norm's weights in FP32 while its rows are FP16: the tactics pass them as stored
    g = torch.Generator().manual_seed(11)
    a, b = (torch.randn(4, 48, generator=g).half().to(DEV) for _ in range(2))
    gamma, beta = torch.randn(48, generator=g).to(DEV), torch.randn(48, generator=g).to(DEV)
    y, s = layernorm.skip_layernorm(a, b, gamma, beta, 1e-5)
    assert y.dtype == s.dtype == torch.float16
    ry, rs = layernorm.reference(a, b, gamma, beta, 1e-5)
    torch.testing.assert_close(y, ry, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(s, rs)


@pytest.mark.parametrize("rows, cols", [(1, 7), (5, 33)])
def test_plain_layernorm_matches_torch(rows, cols):
    # the LayerNormalization tactic: no residual
    g = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, cols, generator=g).to(DEV) * 3 + 1
    gamma, beta = torch.randn(cols, generator=g).to(DEV), torch.randn(cols, generator=g).to(DEV)
    y = poisoned(lambda: layernorm.layernorm(x, gamma, beta, 1e-5))  # any unwritten element stays NaN
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (cols,), gamma, beta, 1e-5), atol=1e-4, rtol=1e-4)


def test_transposed_inputs_are_read_in_place():
    # ViT's sequence-first attention output: a [B, S, E] view of a [S, B, E] tensor.
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 3, 40, generator=g).to(DEV).transpose(0, 1)
    b = torch.randn(3, 5, 40, generator=g).to(DEV)
    gamma, beta = torch.randn(40, generator=g).to(DEV), torch.randn(40, generator=g).to(DEV)
    assert layernorm.supports(a, b, gamma)
    y, s = layernorm.skip_layernorm(a, b, gamma, beta, 1e-5)
    ry, rs = layernorm.reference(a, b, gamma, beta, 1e-5)
    torch.testing.assert_close(y, ry, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, rs)


def test_every_output_element_is_written():
    a = torch.randn(4, 19).to(DEV)
    b = torch.randn(4, 19).to(DEV)
    gamma = torch.ones(19).to(DEV)
    poisoned = torch.full_like(a, float("nan"))
    orig = torch.empty
    try:  # poison the buffers the kernel allocates: any unwritten element stays NaN
        torch.empty = lambda *shape, **kw: poisoned.clone()
        y, s = layernorm.skip_layernorm(a, b, gamma, None, 1e-5)
    finally:
        torch.empty = orig
    assert torch.isfinite(y).all() and torch.isfinite(s).all()


# FP8 on the GPU only: Triton's interpreter drops the mantissa carry when it rounds to FP8 (126.85 -> 64).
@pytest.mark.parametrize("qtype", ["int8", pytest.param("fp8", marks=pytest.mark.gpu)])
def test_an_8bit_copy_of_the_rows_for_quantized_readers(qtype):
    from kiln.ops.fused import quantize_fp8, quantize_int8

    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(6, 37, generator=g).to(DEV) for _ in range(2))
    gamma, beta = torch.randn(37, generator=g).to(DEV), torch.randn(37, generator=g).to(DEV)
    scale = torch.tensor(0.015625 if qtype == "int8" else 0.0078125, device=DEV)  # powers of two: exact
    y, s, q = layernorm.skip_layernorm(a, b, gamma, beta, 1e-5, q_scale=scale, qtype=qtype)
    from kiln.builder.tactic_selection import _close

    want = quantize_int8(y, scale) if qtype == "int8" else quantize_fp8(y, scale)  # the stored rows, quantized
    assert q.dtype == want.dtype
    assert torch.equal(q, want) if qtype == "int8" else _close(q, want, "fp8")[0]  # FP8: x * (1/s) vs x / s
    torch.testing.assert_close(y, layernorm.reference(a, b, gamma, beta, 1e-5)[0], atol=1e-4, rtol=1e-4)


def test_layernorm_tactic_matches_the_op_reference():
    from kiln.ir.graph import Node
    from kiln.ops.norm import layer_norm
    from kiln.tactics import _TACTICS, triton_tactics  # noqa: F401  (registers)

    tactic = next(t for t in _TACTICS[("", "LayerNormalization")] if t.name == "triton_layernorm")
    x = torch.randn(2, 3, 24).to(DEV)
    gamma, beta = torch.randn(24).to(DEV), torch.randn(24).to(DEV)
    node = Node("LayerNormalization", ["x", "g", "b"], ["y"], {"epsilon": 1e-3}, opset=17)
    assert tactic.applies(node, [x, gamma, beta]) == x.is_cuda  # CPU tensors are refused
    torch.testing.assert_close(tactic.fn(node, x, gamma, beta), layer_norm(node, x, gamma, beta), atol=1e-4, rtol=1e-4)
    stats = Node("LayerNormalization", ["x", "g"], ["y", "mean", ""], {}, opset=17)
    axis1 = Node("LayerNormalization", ["x", "g"], ["y"], {"axis": 1}, opset=17)
    assert not tactic.applies(stats, [x, gamma]) and not tactic.applies(axis1, [x, torch.randn(3, 24).to(DEV)])


def test_rms_norm_kernel_and_tactic_match_the_layer_reference():
    from kiln.ir.graph import Node
    from kiln.ops.fused import rms_norm
    from kiln.tactics import _TACTICS, triton_tactics  # noqa: F401  (registers)

    tactic = next(t for t in _TACTICS[("kiln", "RMSNorm")] if t.name == "triton_rms_norm")
    x = torch.randn(3, 5, 37).to(DEV) * 2 + 0.5
    gamma = torch.randn(37).to(DEV)
    node = Node("RMSNorm", ["x", "g"], ["y"], {"epsilon": 1e-5}, domain="kiln")
    want = rms_norm(node, x, gamma)
    torch.testing.assert_close(layernorm.rms_norm(x, gamma, 1e-5), want, atol=1e-5, rtol=1e-5)
    assert tactic.applies(node, [x, gamma]) == x.is_cuda and not tactic.applies(node, [x, None])
    torch.testing.assert_close(tactic.fn(node, x, gamma), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parts, rows, cols", [(1, 3, 7), (3, 5, 33), (4, 2, 100)])
def test_norm_sums_split_k_partials_with_bias_and_skip(parts, rows, cols):
    # GemmSkipLayerNorm's split-K tactic: the norm reduces the GEMM's FP32 slices
    g = torch.Generator().manual_seed(parts * rows * cols)
    p = torch.randn(parts, rows, cols, generator=g).to(DEV)
    bias, b = torch.randn(cols, generator=g).to(DEV), torch.randn(rows, cols, generator=g).to(DEV)
    gamma, beta = torch.randn(cols, generator=g).to(DEV), torch.randn(cols, generator=g).to(DEV)
    y, s = poisoned(lambda: layernorm.partials_layernorm(p, bias, b, gamma, beta, 1e-5))  # unwritten: NaN
    ry, rs = layernorm.reference(p.sum(0) + bias, b, gamma, beta, 1e-5)
    torch.testing.assert_close(y, ry, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, rs, atol=1e-5, rtol=1e-5)


def test_a_norm_without_the_add_writes_an_8_bit_copy():
    # a LayerNormalization given an 8-bit copy (builder/quantized_io.py): the kernel without the skip, with the copy
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=g).to(DEV)
    gamma, beta = torch.randn(40, generator=g).to(DEV), torch.randn(40, generator=g).to(DEV)
    q_scale = torch.tensor([0.03], device=DEV)
    y, s, q = poisoned(lambda: layernorm.skip_layernorm(x, None, gamma, beta, 1e-5, write_sum=False, q_scale=q_scale,
                                                        qtype="int8"))
    assert s is None
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (40,), gamma, beta, 1e-5), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q.float(), (y / q_scale).round().clamp(-128, 127), atol=1, rtol=0)


@pytest.mark.parametrize("launch", layernorm.LAUNCHES[::3], ids=lambda launch: launch.name)
def test_a_third_addend_broadcast_over_the_batch_is_read_where_it_lies(launch):
    """LayerNorm((a + b) + c) with c [1, S, H] expanded over the batch (stride 0: BERT's position embeddings), the
    sum written too."""
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randn(3, 5, 40, generator=g).to(DEV) for _ in range(2))
    c = torch.randn(1, 5, 40, generator=g).to(DEV)
    gamma, beta = torch.randn(40, generator=g).to(DEV), torch.randn(40, generator=g).to(DEV)
    y, s = poisoned(lambda: layernorm.skip_layernorm(a, b, gamma, beta, 1e-5, launch=launch, c=c.expand(a.shape)))
    ry, rs = layernorm.reference(a + b, c.expand(a.shape), gamma, beta, 1e-5)
    torch.testing.assert_close(y, ry, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, rs)


def test_skip_layernorm_tactics_with_a_third_addend_match_the_op_reference():
    """kiln::SkipLayerNorm's input 5 (a broadcast third addend) through the Triton tactic and the library one."""
    from kiln.ir.graph import Node
    from kiln.ops.fused import skip_layer_norm
    from kiln.tactics import _TACTICS, library, triton_tactics  # noqa: F401  (registers)

    triton = next(t for t in _TACTICS[("kiln", "SkipLayerNorm")] if t.name == "triton_fused_add_layernorm")
    g = torch.Generator().manual_seed(3)
    a, b, c = torch.randn(2, 3, 24, generator=g).to(DEV), torch.randn(2, 3, 24, generator=g).to(DEV), \
        torch.randn(1, 3, 24, generator=g).to(DEV)
    gamma, beta = torch.randn(24, generator=g).to(DEV), torch.randn(24, generator=g).to(DEV)
    node = Node("SkipLayerNorm", ["a", "b", "g", "beta", "", "c"], ["y", "s"], {"epsilon": 1e-5}, domain="kiln")
    args = [a, b, gamma, beta, None, c]
    assert triton.applies(node, args) == a.is_cuda
    assert not triton.applies(node, [a, b, gamma, beta, None, torch.randn(4, 3, 24).to(DEV)])  # does not broadcast
    ry, rs = skip_layer_norm(node, *args)
    for y, s in (triton.fn(node, *args)[:2], library.add_then_layer_norm(node, *args)[:2]):
        torch.testing.assert_close(y, ry, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s, rs)


@pytest.mark.parametrize("write_sum", [True, False])
def test_rms_norm_of_a_residual_sum_matches_the_layer_reference(write_sum):
    """kiln::RMSNorm(a, gamma, skip) (fuse_rmsnorm's residual Add joined): the norm of a + skip and the sum, one
    pass of the kernel's RMS mode; without a reader of the sum, no sum is written."""
    from kiln.ir.graph import Node
    from kiln.ops.fused import rms_norm
    from kiln.tactics import _TACTICS, triton_tactics  # noqa: F401  (registers)

    tactic = next(t for t in _TACTICS[("kiln", "RMSNorm")] if t.name == "triton_rms_norm")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 5, 40, generator=g).to(DEV), torch.randn(2, 5, 40, generator=g).to(DEV)
    gamma = torch.randn(40, generator=g).to(DEV)
    node = Node("RMSNorm", ["a", "g", "b"], ["y", "s" if write_sum else ""], {"epsilon": 1e-6}, domain="kiln")
    want_y, want_s = rms_norm(node, a, gamma, b)
    torch.testing.assert_close(want_s, a + b)
    assert tactic.applies(node, [a, gamma, b]) == a.is_cuda
    assert not tactic.applies(node, [a, gamma, b[:, :1]])  # a skip of another shape is no residual
    y, s = tactic.fn(node, a, gamma, b)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    if write_sum:
        torch.testing.assert_close(s, want_s, atol=1e-6, rtol=1e-6)
    else:
        assert s is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_rms_norm_of_a_residual_sum_at_llama_width_on_the_gpu():
    """Llama-real's shape (hidden 1024, 32 x 128 rows) in FP16 against the op reference (FP16 add, FP32 norm)."""
    from kiln.ir.graph import Node
    from kiln.ops.fused import rms_norm
    from kiln.tactics import _TACTICS, triton_tactics  # noqa: F401  (registers)

    tactic = next(t for t in _TACTICS[("kiln", "RMSNorm")] if t.name == "triton_rms_norm")
    a = torch.randn(32, 128, 1024, device="cuda", dtype=torch.float16)
    b = torch.randn(32, 128, 1024, device="cuda", dtype=torch.float16)
    gamma = torch.randn(1024, device="cuda", dtype=torch.float16)
    node = Node("RMSNorm", ["a", "g", "b"], ["y", "s"], {"epsilon": 1e-6}, domain="kiln")
    want_y, want_s = rms_norm(node, a, gamma, b)
    assert tactic.applies(node, [a, gamma, b])
    y, s = tactic.fn(node, a, gamma, b)
    torch.testing.assert_close(s, want_s, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(y, want_y, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("launch", [x for x in layernorm.LAUNCHES if x.fill], ids=lambda launch: launch.name)
def test_filling_launches_pack_narrow_rows_and_mask_the_last_program(launch):
    """ConvNeXt's channels-last norm: 40-wide rows, many a program (2048 // 64 = 32 for f2048), 100 rows so the last
    program is partial; rows of a channels-last map seen as [N, H, W, C] (a transposed view)."""
    assert launch.rows_for(64) > 2 and launch.offered(40) and not launch.offered(768)
    g = torch.Generator().manual_seed(launch.fill)
    x = torch.randn(2, 40, 5, 10, generator=g).to(DEV).to(memory_format=torch.channels_last).permute(0, 2, 3, 1)
    gamma, beta = torch.randn(40, generator=g).to(DEV), torch.randn(40, generator=g).to(DEV)
    y = poisoned(lambda: layernorm.layernorm(x, gamma, beta, 1e-6, launch=launch))
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (40,), gamma, beta, 1e-6), atol=1e-4, rtol=1e-4)
